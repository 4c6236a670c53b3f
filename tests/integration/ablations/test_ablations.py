"""The ablation driver: settings, the statistics against hand-derived values, the report
from per-seed runs, and the runner's resume on real (one-step, tiny-model) training runs."""

import json
import math
import os
import subprocess
import sys

import pytest

from moe_rl.ablations import parse_seeds, settings, stats
from moe_rl.ablations.report import report
from moe_rl.ablations.runner import MARKER, Run, run_all
from moe_rl.config import load_config
from moe_rl_testing import ROOT


def test_settings_cover_the_issue_grid_and_are_valid():
    s = settings()
    methods = ("grpo", "grpo-r2", "grpo-r3", "gspo", "gmpo", "rspo-post", "rspo-pre", "sapo")
    assert set(s) == {"grpo-on"} | {f"{m}{t}-off" for m in methods for t in ("", "-tis")}
    for name, overrides in s.items():
        cfg = load_config(ROOT / "examples/ablations.yaml", overrides)
        assert cfg.rl.num_minibatches == (1 if name == "grpo-on" else 4)
        assert (cfg.rl.rollout_correction == "tis") == ("-tis" in name)
        assert cfg.rl.replay == ("R2" if "-r2" in name else "R3" if "-r3" in name else "none")
        assert cfg.rl.objective == name.split("-")[0]
        if name.startswith("rspo"):
            want = "pre_clip" if name.startswith("rspo-pre") else "post_clip"
            assert cfg.rl.objective_args["rspo"].gamma_placement == want


def test_holm_adjusted_p_and_welch_interval_by_hand():
    # m = 3: 0.01 x 3 = 0.03; 0.02 x 2 = 0.04; 0.04 x 1 = 0.04 (monotone: max(0.04, 0.04))
    adj = stats.holm_adjusted({"a": 0.01, "b": 0.02, "c": 0.04, "d": float("nan")})
    assert adj["a"] == pytest.approx(0.03) and adj["b"] == pytest.approx(0.04) and adj["c"] == pytest.approx(0.04)
    assert math.isnan(adj["d"])
    # monotone: 0.02 x 2 = 0.04 < 0.015 x 3 = 0.045, so b's adjusted p is lifted to a's
    adj = stats.holm_adjusted({"a": 0.015, "b": 0.02, "c": 0.9})
    assert adj == pytest.approx({"a": 0.045, "b": 0.045, "c": 0.9})
    # Welch with a = (1, 2, 3), b = (4, 5, 6): se = sqrt(2/3), df = 4, t(0.975, 4) = 2.776445
    lo, hi = stats.welch_interval([1, 2, 3], [4, 5, 6])
    half = 2.776445 * math.sqrt(2 / 3)
    assert lo == pytest.approx(-3 - half, rel=1e-6) and hi == pytest.approx(-3 + half, rel=1e-6)
    assert stats.welch_interval([1, 1], [0, 0]) == (1.0, 1.0) and math.isnan(stats.welch_interval([1], [2, 3])[0])


def test_parse_seeds():
    assert parse_seeds("1,2,3") == (1, 2, 3) and parse_seeds("4-6") == (4, 5, 6) and parse_seeds("1, 3-4") == (1, 3, 4)
    for bad in ("", "a", "1,1", "2-x"):
        with pytest.raises(ValueError, match="SEEDS"):
            parse_seeds(bad)


def test_interval_is_the_student_t_interval():
    # mean 2, sample sd 1, n = 3: half-width = t(0.975, 2) * 1 / sqrt(3) = 4.302653 / 1.732051
    iv = stats.interval([1.0, 2.0, 3.0])
    assert iv["mean"] == 2.0 and iv["hi"] - 2.0 == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    one = stats.interval([0.5])
    assert one["mean"] == 0.5 and math.isnan(one["lo"])


def test_welch_and_holm():
    # a = (1, 2, 3), b = (4, 5, 6): t = -3 / sqrt(2/3) = -3.674, Welch df = 4 -> p = 0.02131
    assert stats.welch([1, 2, 3], [4, 5, 6]) == pytest.approx(0.021312, abs=1e-5)
    assert stats.welch([1, 1], [1, 1]) == 1.0 and stats.welch([1, 1], [2, 2]) == 0.0
    assert math.isnan(stats.welch([1], [2, 3]))
    # Holm at 0.05 over 3 p-values: 0.01 <= 0.05/3, 0.02 <= 0.05/2, 0.04 <= 0.05/1 -> all three
    assert stats.holm({"a": 0.01, "b": 0.02, "c": 0.04}) == {"a", "b", "c"}
    # 0.03 > 0.05/2 stops the procedure: only the smallest survives
    assert stats.holm({"a": 0.01, "b": 0.03, "c": 0.04}) == {"a"}


def test_collapse_means_ending_below_half_the_smoothed_peak():
    rising = [0.1 * i for i in range(20)]
    assert not stats.collapsed(rising)
    # peak of the 5-step mean is 0.8 (steps of 0.8); the last 10 steps average 0.2 < 0.4
    assert stats.collapsed([0.8] * 10 + [0.2] * 10)
    assert not stats.collapsed([0.8] * 10 + [0.5] * 10)
    assert not stats.collapsed([0.0] * 20)  # never rose: nothing to collapse from


def _rows(rewards, flip=0.2, k3=1e-3, used=0.1, layers=(0.03, 0.07)):
    return [{"step": i + 1, "reward/mean": r, "policy/clip_frac": 0.1, "routing/gamma_mean": 0.9,
             "routing/gamma_min": 0.5, "routing/flip_rate_mean": flip, "routing/flip_rate_layer0": flip,
             "mismatch/k3": k3, "routing/sampler_used_disagree_any": used, "routing/sampler_disagree_any": 0.1,
             **{f"routing/sampler_disagree_layer{j}": v for j, v in enumerate(layers)}, "time/step": 1.0}
            for i, r in enumerate(rewards)]


def _write_run(out, setting, seed, rows):
    d = out / setting / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / MARKER).write_text(json.dumps({"setting": setting, "seed": seed, "seconds": 60.0}))


def test_report_from_seeds(tmp_path):
    for seed, level in zip((1, 2, 3), (0.5, 0.6, 0.7)):
        _write_run(tmp_path, "grpo-on", seed, _rows([level] * 20))
        _write_run(tmp_path, "grpo-off", seed, _rows([level] * 10 + [0.0] * 10, flip=0.3))
        _write_run(tmp_path, "grpo-r3-off", seed, _rows([level] * 20, k3=2e-4, used=0.0))
    (tmp_path / "grpo-off" / "seed4").mkdir()  # a killed run: no marker, not counted
    text = report(tmp_path).read_text()
    # grpo-on final rewards 0.5, 0.6, 0.7: mean 0.6, t half-width 4.302653 * 0.1 / sqrt(3) = 0.248
    assert "| grpo-on | 3 | 0/3 | 0.600 [0.352, 0.848] | 0.600 [0.352, 0.848] |" in text
    assert "| grpo-off | 3 | 3/3 | 0.000 [0.000, 0.000] |" in text  # every seed ends at 0: no spread
    assert "up to 0.300" in text and "meets" in text  # flip rate target 0.10
    assert "up to 0.070" in text  # worst-layer disagreement
    assert "| grpo-r3-off vs grpo-off | 0 | 0.100 |" in text
    assert "grpo-on vs grpo-off: +0.600" in text  # a difference far outside the seed spread
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["grpo-off"]["collapses"] == 3 and results["grpo-on"]["seeds"] == [1, 2, 3]
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {
        "reward.png", "flip_rate.png", "gamma.png", "clip_frac.png", "token_ratio_std.png", "k3.png"}


TINY = ["model.num_layers=4", "model.num_experts=8", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=128",
        "run.steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "sampler.max_new_tokens=4"]


@pytest.mark.slow
def test_runner_trains_missing_runs_and_resumes(tmp_path):
    """Real one-step runs on the shipped tiny model: finished runs are skipped, a run
    without its marker (killed half-way) is trained again, from scratch."""
    base = ROOT / "moe_rl/assets/tiny_base"
    runs = [Run("grpo-on", 1, tuple(TINY)), Run("grpo-r3-off", 1, tuple(TINY))]
    assert run_all(runs, tmp_path, base, jobs=2) == []
    first = {r: (r.directory(tmp_path) / "metrics.jsonl").stat().st_mtime_ns for r in runs}
    (runs[1].directory(tmp_path) / MARKER).unlink()
    assert run_all(runs, tmp_path, base, jobs=2) == []
    again = {r: (r.directory(tmp_path) / "metrics.jsonl").stat().st_mtime_ns for r in runs}
    assert again[runs[0]] == first[runs[0]] and again[runs[1]] != first[runs[1]]
    marker = json.loads((runs[1].directory(tmp_path) / MARKER).read_text())
    assert marker["seed"] == 1 and "rl.replay=R3" in marker["overrides"] and "run.steps=1" in marker["overrides"]
    rows = [json.loads(x) for x in (runs[1].directory(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["routing/sampler_used_disagree_any"] == 0  # R3: the sampler's routing was used


def test_cli_errors_are_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for args, needle in ((["run", "nope"], "unknown or no settings"), (["run", "--all", "--seeds", "x"], "SEEDS"),
                         (["report", "--out", str(tmp_path)], "no finished ablation runs")):
        proc = subprocess.run([sys.executable, "-m", "moe_rl.ablations", *args], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=120)
        assert proc.returncode != 0 and needle in proc.stderr + proc.stdout
        assert "Traceback" not in proc.stderr
