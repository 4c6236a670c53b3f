"""The stress study's runs: the regime read back from committed sweep files by the
pre-registered rule, the blocks the plan names, each run's result file (outcomes, a digest
that ignores only wall times) and its commit of exactly that file."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from moe_rl.ablations import stress_runs
from moe_rl.ablations.result_commits import ResultCommits
from moe_rl.ablations.runner import MARKER, Run
from moe_rl.ablations.settings import settings
from moe_rl.ablations.stress_explore import ExploreRate, explore_rate
from moe_rl.ablations.stress_runs import (
    Block,
    Recorder,
    metrics_digest,
    plan,
    regime,
    result_path,
    run_plan,
    run_result,
)


def _sweep(results: Path, block: str, lr: str, collapsed: list[bool]) -> None:
    d = results / block / f"lr{lr}"
    d.mkdir(parents=True, exist_ok=True)
    for seed, c in enumerate(collapsed, 1):
        (d / f"seed{seed}.json").write_text(json.dumps({"collapsed": c}))


def test_regime_follows_the_plans_rule_then_its_step_3(tmp_path):
    none, all4 = [False] * 4, [True] * 4
    _sweep(tmp_path / "a", "sweep", "0.0002", none)
    _sweep(tmp_path / "a", "sweep", "0.0003", [True, True, False, False])  # half: the rule's pick
    _sweep(tmp_path / "a", "sweep", "0.0004", [True, True, True, False])
    assert regime(tmp_path / "a") == (3e-4, 4)
    _sweep(tmp_path / "b", "sweep", "0.0002", none)
    _sweep(tmp_path / "b", "sweep", "0.0003", all4)
    _sweep(tmp_path / "b", "sweep", "0.0004", all4)
    _sweep(tmp_path / "b", "sweep-updates8", "0.0002", all4)
    assert regime(tmp_path / "b") == (3e-4, 4)  # step 3: the smallest collapsing rate at 4 updates first
    _sweep(tmp_path / "c", "sweep", "0.0002", none)
    _sweep(tmp_path / "c", "sweep-updates8", "0.0002", [True, False, False, False])  # 1 of 4: below half
    _sweep(tmp_path / "c", "sweep-updates8", "0.0003", [True, True, False, False])
    assert regime(tmp_path / "c") == (3e-4, 8)
    _sweep(tmp_path / "d", "sweep", "0.0002", none)
    with pytest.raises(SystemExit, match="no stress regime"):
        regime(tmp_path / "d")


def test_plan_blocks_match_the_pre_registration(tmp_path):
    _sweep(tmp_path, "sweep", "0.0003", [True] * 4)
    blocks = {b.name: b for b in plan(tmp_path)}
    assert list(blocks) == ["repeat", "main", "stage2", "contrast", "explore-repeat", "explore-sweep-0.00025"]
    main = blocks["main"]
    assert len(settings()) == 17 and len(main.runs) == 170 and main.lr == 3e-4
    # seed-major: the first 17 runs are seed 1 of every setting
    assert {r.seed for r in main.runs[:17]} == {1} and {r.setting for r in main.runs[:17]} == set(settings())
    assert all(r.overrides == ("optimizer.lr=0.0003",) for r in main.runs)
    assert {(r.setting, r.seed) for r in blocks["stage2"].runs} == {
        (n, s) for n in ("grpo-off", "gspo-off", "grpo-r3-off", "rspo-post-off") for s in range(11, 21)}
    assert blocks["repeat"].runs == (Run("grpo-off", 1, ("optimizer.lr=0.0003",)),)
    assert blocks["contrast"].lr == 2e-4 and len(blocks["contrast"].runs) == 51
    one = plan(tmp_path, ["gspo-off"], (11, 12), "main")
    assert [(r.setting, r.seed) for r in one[0].runs] == [("gspo-off", 11), ("gspo-off", 12)]
    with pytest.raises(SystemExit, match="--settings nope: unknown"):
        plan(tmp_path, ["nope"], None, "main")
    with pytest.raises(SystemExit, match="need --block"):
        plan(tmp_path, ["gspo-off"])


def _rows(rewards: list[float], **extra: float) -> list[dict]:
    return [{"step": i + 1, "reward/mean": r, "time/step": 1.0 + i, "sync/seconds": 0.1 * i,
             "perf/learner_tokens_per_s_per_gpu": 900.0 + i, "policy/clip_frac": 0.1, "routing/dlogr_layer0": 0.03,
             "routing/sampler_disagree_layer0": 0.05, "perf/learner_tokens": 100.0, **extra}
            for i, r in enumerate(rewards)]


def test_result_outcomes_and_a_digest_blind_only_to_wall_times():
    rows = _rows([0.4] * 35 + [0.0] * 5)
    out = run_result(rows, {"setting": "grpo-off"})
    assert out["collapsed"] and out["final_reward"] == 0.0 and out["reward_auc"] == pytest.approx(0.35)
    assert out["first_reward"] == 0.4 and out["steps"] == 40
    # kept: the outcome and mechanism metrics; not the per-layer sampler disagreement or throughput
    assert set(out["per_step"]) == {"reward/mean", "policy/clip_frac", "routing/dlogr_layer0"}
    survived = run_result(_rows([0.4] * 35 + [0.2] * 5), {})
    assert not survived["collapsed"]  # 0.2 below the first step: within 0.3
    retimed = [{**r, "time/step": 99.0, "sync/seconds": 5.0, "perf/learner_tokens_per_s_per_gpu": 1.0} for r in rows]
    assert metrics_digest(retimed) == metrics_digest(rows)
    for key in ("perf/learner_tokens", "policy/clip_frac", "reward/mean"):
        nudged = [dict(r) for r in rows]
        nudged[7][key] = nudged[7][key] + 1e-12
        assert metrics_digest(nudged) != metrics_digest(rows), key


def test_recorder_writes_each_file_and_commits_them_in_batches(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True, text=True).stdout  # noqa: E731
    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (repo / "other.txt").write_text("work in progress\n")
    git("add", "other.txt")  # staged by someone else: must not ride along
    runs = [Run("grpo-off", s) for s in (1, 2, 3)]
    for run, reward in zip(runs, (0.3, 0.0, 0.5)):
        run_dir = tmp_path / "runs" / "grpo-off" / f"seed{run.seed}"
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _rows([reward] * 40)) + "\n")
        (run_dir / MARKER).write_text(json.dumps({"seconds": 150.0}))
    blk = Block("main", 3e-4, 4, tuple(runs))
    commits = ResultCommits("stress", every=2)
    record = Recorder(tmp_path / "runs", repo / "stress", blk, "abc1234", "0123456789abcdef", commits)
    record(runs[0])
    path = repo / "stress" / "main" / "grpo-off" / "seed1.json"
    saved = json.loads(path.read_text())  # written at once, committed with the batch
    assert saved["warm_start"] == "0123456789abcdef"
    assert saved["commit"] == "abc1234" and saved["lr"] == 3e-4 and saved["updates"] == 4 and saved["seconds"] == 150.0
    assert not saved["collapsed"] and saved["final_reward"] == pytest.approx(0.3)
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True).returncode != 0  # none yet
    record(runs[1])
    assert git("log", "--format=%s").splitlines() == ["stress main: 2 run(s) landed, 1 collapsed"]
    assert git("log", "-1", "--format=%b").strip().splitlines() == [
        "- grpo-off seed 1 survived (final reward 0.300)", "- grpo-off seed 2 collapsed (final reward 0.000)"]
    assert git("show", "--name-only", "--format=", "HEAD").split() == [
        "stress/main/grpo-off/seed1.json", "stress/main/grpo-off/seed2.json"]
    record(runs[2])  # a batch of one, committed when the block ends
    assert len(git("log", "--format=%s").splitlines()) == 1
    commits.flush("main")
    assert git("log", "-1", "--format=%s").strip() == "stress main: 1 run(s) landed, 0 collapsed"
    assert git("show", "--name-only", "--format=", "HEAD").split() == ["stress/main/grpo-off/seed3.json"]
    assert "A  other.txt" in git("status", "--porcelain")


def test_results_are_not_committed_without_commit(tmp_path):
    commits = ResultCommits("stress", enabled=False, every=1)
    commits.add("main", tmp_path / "nowhere.json", "x", False)  # would fail loudly if it tried git
    commits.flush()


def test_the_cli_names_the_block_a_seed_list_needs():
    from moe_rl.ablations.__main__ import main

    with pytest.raises(SystemExit, match="need --block"):
        main(["stress", "--seeds", "11-20"])


def _explore_sweep(results: Path, lr: str, collapsed: list[bool]) -> None:
    for seed, c in enumerate(collapsed, 1):
        p = results / f"explore-sweep-{lr}" / "grpo-off" / f"seed{seed}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"collapsed": c}))


def test_the_exploratory_rate_follows_the_plans_change_6(tmp_path):
    """GRPO at 2.5e-4 first; 1-3 collapses of 4 choose it; none sends the second point above
    (2.75e-4), all below (2.25e-4); a second point outside 1-3 ends the rule without a rate."""
    assert explore_rate(tmp_path / "a") == ExploreRate((2.5e-4,), None, False)
    _explore_sweep(tmp_path / "a", "0.00025", [True, False, False])  # 3 of 4 seeds finished: undecided
    assert explore_rate(tmp_path / "a").lr is None and not explore_rate(tmp_path / "a").concluded
    _explore_sweep(tmp_path / "a", "0.00025", [True, False, False, True])
    assert explore_rate(tmp_path / "a").lr == 2.5e-4
    _explore_sweep(tmp_path / "b", "0.00025", [False] * 4)
    assert explore_rate(tmp_path / "b").sweep_lrs == (2.5e-4, 2.75e-4) and explore_rate(tmp_path / "b").lr is None
    _explore_sweep(tmp_path / "b", "0.000275", [True, False, False, False])
    assert explore_rate(tmp_path / "b").lr == 2.75e-4
    _explore_sweep(tmp_path / "c", "0.00025", [True] * 4)
    _explore_sweep(tmp_path / "c", "0.000225", [True] * 4)
    rate = explore_rate(tmp_path / "c")
    assert rate.sweep_lrs == (2.5e-4, 2.25e-4) and rate.lr is None and rate.concluded


def test_the_runner_reads_the_plan_again_as_the_exploratory_sweep_lands(tmp_path, monkeypatch):
    """One `make ablations-stress` goes from the code check through the sweep to the chosen
    rate's 40 runs: after each pass the plan is read again; it stops when nothing is missing."""
    _sweep(tmp_path, "sweep", "0.0003", [True] * 4)
    passes = []

    def fake_run_stress(out, blocks, base, jobs, results, commit, mix_warm_starts):
        passes.append([b.name for b in blocks if any(not result_path(results, b.name, r).is_file() for r in b.runs)])
        for b in blocks:
            for r in b.runs:  # GRPO at 2.5e-4: seeds 1 and 2 collapse, 3 and 4 do not
                p = result_path(results, b.name, r)
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(json.dumps({"collapsed": r.seed <= 2}))
        return []

    monkeypatch.setattr(stress_runs, "run_stress", fake_run_stress)
    assert run_plan(tmp_path / "runs", lambda: plan(tmp_path, None, None, "explore"), None, 1, tmp_path) == []
    assert passes == [["explore-repeat", "explore-sweep-0.00025"], ["explore-0.00025"]]
    chosen = {b.name: b for b in plan(tmp_path, None, None, "explore")}["explore-0.00025"]
    assert len(chosen.runs) == 40 and chosen.runs[0].overrides == ("optimizer.lr=0.00025",)


def _checkpoint(path: Path, hashes: dict[str, str], config: str) -> Path:
    path.mkdir(parents=True)
    files = {name: {"size": 1, "sha256": h} for name, h in hashes.items()}
    (path / "manifest.json").write_text(json.dumps({"format": 1, "unhashed": ["config.yaml"], "files": files}))
    (path / "config.yaml").write_text(config)
    return path


def test_the_warm_start_id_is_its_file_hashes_not_its_place(tmp_path):
    """Change 7 of the plan: the id names the SFT checkpoint by its manifest's hashes, so the
    same warm start gets the same id wherever it lies (config.yaml and .metadata hold its path)
    and any other checkpoint another; a directory without a manifest is refused with the fix."""
    hashes = {"__0_0.distcp": "aa" * 32, ".metadata": "bb" * 32}
    here = stress_runs.warm_start_id(_checkpoint(tmp_path / "a", hashes, "output: /a\n"))
    there = stress_runs.warm_start_id(_checkpoint(tmp_path / "b", dict(reversed(hashes.items())), "output: /b\n"))
    # .metadata holds the path it was written to: another place, other bytes, the same tensors
    moved = stress_runs.warm_start_id(_checkpoint(tmp_path / "c", {**hashes, ".metadata": "cc" * 32}, "output: /c\n"))
    other = stress_runs.warm_start_id(_checkpoint(tmp_path / "e", {**hashes, "__0_0.distcp": "dd" * 32}, "output: /a\n"))
    assert here == there == moved != other and len(here) == 16
    import hashlib
    expect = hashlib.sha256(json.dumps({"__0_0.distcp": "aa" * 32}).encode()).hexdigest()
    assert here == expect[:16]
    (tmp_path / "d").mkdir()
    with pytest.raises(SystemExit, match=r"--base .*d: cannot read the file hashes in .*manifest.json"):
        stress_runs.warm_start_id(tmp_path / "d")


def test_a_block_is_not_extended_from_another_warm_start(tmp_path):
    """A block whose runs name one warm start (or predate the field) refuses runs from another,
    naming both and the two ways on; a complete block or a new one is not checked."""
    results = tmp_path / "stress"
    done = {"warm_start": "078d2e86c3529df3"}
    for seed in (1, 2):
        p = results / "explore-x" / "grpo-off" / f"seed{seed}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(done if seed == 1 else {}))
    blk = Block("explore-x", 2.5e-4, 4, (Run("grpo-off", 1), Run("grpo-off", 2), Run("grpo-off", 3)))
    with pytest.raises(SystemExit, match=r"block explore-x: its runs trained from warm start 078d2e86c3529df3, "
                                         r"one not recorded and --base /b is ffff.*--mix-warm-starts"):
        stress_runs.check_warm_start(results, [blk], Path("/b"), "ffff")
    stress_runs.check_warm_start(results, [blk], Path("/b"), "078d2e86c3529df3")  # the block's own: fine
    stress_runs.check_warm_start(results, [Block("explore-x", 2.5e-4, 4, blk.runs[:2])], Path("/b"), "ffff")
    stress_runs.check_warm_start(results, [Block("new", 2.5e-4, 4, blk.runs)], Path("/b"), "ffff")
