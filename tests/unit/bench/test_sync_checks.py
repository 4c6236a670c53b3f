"""The sync-checks generator's comparison and tables (bench/generators/sync_checks.py), on
hand-made metrics rows: rewards compared exactly per step, the check per push read from the
row that reports it (`sync/verify_version` under the separate placement), delta bytes as
`sync/delta_frac` x `sync/bytes_streamed`."""

from __future__ import annotations

from bench.generators.sync_checks import command, summarize, tables


def _row(step: int, reward: float, **more: float) -> dict:
    return {"step": step, "reward/mean": reward, **{k.replace("__", "/"): v for k, v in more.items()}}


def test_summarize_and_tables_from_hand_rows(tmp_path):
    plain = [_row(1, 0.25), _row(2, 0.5), _row(3, 0.75)]
    separate = [  # (push 1 whole, pushes 2-3 deltas; push n's check in step n + 1's row)
        _row(1, 0.25, sync__bytes_streamed=2**20, sync__delta_frac=1.0),
        _row(2, 0.5, sync__bytes_streamed=2**20, sync__delta_frac=0.25, sync__verify_max_abs_diff=2e-6,
             sync__verify_mean_abs_diff=5e-7, sync__verify_version=1.0),
        _row(3, 0.75, sync__bytes_streamed=2**20, sync__delta_frac=0.125, sync__verify_max_abs_diff=4e-6,
             sync__verify_mean_abs_diff=1e-6, sync__verify_version=2.0)]
    sep = summarize(plain, separate)
    assert sep["rewards_equal"] and sep["max_reward_diff"] == 0.0 and sep["steps"] == 3
    assert [p["push"] for p in sep["checks"]] == [1, 2] and sep["checks"][1]["max_abs_diff"] == 4e-6
    assert [w["sent_bytes"] for w in sep["wire"]] == [2**20, 2**18, 2**17]

    colocated = [_row(1, 0.25, sync__verify_max_abs_diff=1e-6, sync__verify_mean_abs_diff=3e-7),
                 _row(2, 0.5 + 2**-10, sync__verify_max_abs_diff=3e-6, sync__verify_mean_abs_diff=8e-7)]
    col = summarize(plain, colocated)  # (a step missing and one reward off by 2^-10)
    assert not col["rewards_equal"] and col["max_reward_diff"] == 2**-10 and col["steps"] == 2
    assert [p["push"] for p in col["checks"]] == [1, 2] and col["wire"] == []

    text = tables({"separate": sep, "EP2": col}, (1e-4, 1e-4))
    # separate: deltas of pushes 2 and 3 average (0.25 + 0.125) / 2 MiB = 0.1875; full 1 MiB
    assert "| separate | 3 | yes | 0 | 2 | 4e-06 | yes | 1e-06 | 0.188 | 1 |" in text
    assert "| EP2 | 2 | NO | 0.000977 | 2 | 3e-06 | yes | 8e-07 | - | - |" in text
    assert "| 3 | - | - | 0.125 | 0.125 |" in text  # (push 3: sent, its check not logged)
    assert "| 1 | 2e-06 | 5e-07 | 1 | 1.000 |" in text
    assert "1e-4" not in text and "0.0001 on the largest" in text
    header = next(line for line in text.splitlines() if line.startswith("| placement"))
    assert header.count(" | ") == 9  # (the |dlogp| of the headers escaped: ten columns)


def test_the_runs_launch_as_the_multiproc_tests_do(tmp_path):
    one = command(1, ["run.steps=2"], tmp_path, "a")
    two = command(2, ["run.steps=2"], tmp_path, "b")
    assert one[1:3] == ["-m", "moe_rl.train"] and "run.steps=2" in one and f"run.output_dir={tmp_path}" in one
    assert two[3:5] == ["--standalone", "--nproc-per-node=2"] and two[5:7] == one[1:3] and two[-1] == "run.name=b"
