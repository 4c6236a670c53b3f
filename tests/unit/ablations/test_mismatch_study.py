"""The mismatch study's pre-registered rules, block order, settings and reports, on result
files written here (no training: the runs themselves are the study's, `make ablations-mismatch`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from moe_rl.ablations import mismatch_report as report
from moe_rl.ablations import mismatch_rules as rules
from moe_rl.ablations import mismatch_study as study
from moe_rl.ablations.mismatch_report import write_reports
from moe_rl.ablations.stats import stratified_difference
from moe_rl.config import load_config
from moe_rl_testing import ROOT


def test_collapse_is_the_plans_definition():
    flat = [0.4] * 100
    assert not rules.run_collapsed(flat) and not rules.run_collapsed([])
    assert rules.run_collapsed([0.4] * 90 + [0.04] * 10)  # below the floor
    assert rules.run_collapsed([0.5] * 5 + [0.5] * 85 + [0.19] * 10)  # 0.31 below the first five steps' 0.5
    assert not rules.run_collapsed([0.5] * 5 + [0.5] * 85 + [0.21] * 10)  # 0.29 below: kept training
    # the last 10 steps decide, not the last 25
    assert not rules.run_collapsed([0.4] * 80 + [0.0] * 10 + [0.3] * 10)


def test_outcomes_of_a_run():
    rows = [{"step": i + 1, "reward/mean": i / 100, rules.K3: 1e-3 + 1e-5 * i, rules.EXTREME: 0.01,
             rules.DISAGREE: 0.2} for i in range(100)]
    out = rules.run_outcomes(rows)
    assert out["steps"] == 100 and out["final_reward"] == pytest.approx(sum(range(75, 100)) / 100 / 25)
    assert out["reward_auc"] == pytest.approx(0.495) and not out["collapsed"]
    assert out["k3_slope"] == pytest.approx(1e-5) and out["k3_end"] == pytest.approx(1e-3 + 1e-5 * 87)
    assert out["extreme_slope"] == pytest.approx(0.0, abs=1e-15) and out["disagree_end"] == pytest.approx(0.2)


def test_the_learning_rate_rule():
    assert rules.chosen_lr({2e-4: [False] * 4, 4e-4: [False, False, False, True], 8e-4: [True, True, False, False]}) \
        == (4e-4, True)
    assert rules.chosen_lr({2e-4: [False] * 4, 4e-4: [False] * 4, 8e-4: [False] * 4}) == (8e-4, True)
    assert rules.chosen_lr({2e-4: [True, True, False, False], 4e-4: [True] * 4, 8e-4: [True] * 4}) == (2e-4, False)


def test_the_precision_and_horizon_rules():
    assert rules.chosen_precision({"bf16": 1e-3, "fp8_emulated": 2e-3}) == "fp8_emulated"
    assert rules.chosen_precision({"bf16": 2e-3, "fp8_emulated": 2e-3}) == "bf16"
    flat = [1e-3] * 100
    assert rules.horizon(flat)[0] == 100
    growing = [1e-3 * (1 + i / 50) for i in range(100)]  # 76-100 is 1.5x 26-50, a clear slope
    steps, why = rules.horizon(growing)
    assert steps == 200 and why["k3_76_100"] / why["k3_26_50"] > 1.2 and why["slope_lo"] > 0
    # a jump with no trend over 51-100 is not "still growing"
    jump = [1e-3] * 50 + [2e-3] * 50
    assert rules.horizon(jump)[0] == 100


def test_rounding_and_thresholds_from_measured_ratios():
    assert rules.round_sig(1.23401, 3, up=True) == 1.24 and rules.round_sig(1.234, 3, up=False) == 1.23
    assert rules.round_sig(0.0012345, 2, up=False) == 0.0012 and rules.round_sig(1.2, 3, up=True) == 1.2
    # token log ratios 0, 0.001, ..., 0.999 (1000 values): the 99th percentile of exp(d) is
    # exp(0.98901) (numpy's linear interpolation), the 0.1th exp(0.000999)
    d = [i / 1000 for i in range(1000)]
    m = [-(i / 100) for i in range(101)]  # response means 0, -0.01, ..., -1
    t = rules.thresholds(d, m)
    assert t["tis_cap"] == rules.round_sig(math.exp(np.quantile(d, 0.99)), 3, up=True) == 2.69
    assert t["veto_below"] == 1.0  # exp(0.000999) = 1.000999, down to 2 digits
    assert t["geo_high"] == rules.round_sig(math.exp(0.99), 3, up=True) == 2.7
    assert t["opsm_delta"] == 0.95
    with pytest.raises(ValueError, match="no response token"):
        rules.thresholds([], [])


def test_stage2_rule_and_pooled_sd():
    assert rules.pooled_sd([[1.0, 3.0], [2.0, 4.0]]) == pytest.approx(math.sqrt(2.0))
    assert rules.needs_stage2((-0.05, 0.2), 0.1) and rules.needs_stage2((-0.3, 0.0), 0.1)
    assert not rules.needs_stage2((-0.05, 0.05), 0.1) and not rules.needs_stage2((0.2, 0.4), 0.1)


@pytest.mark.parametrize("name", study.SETTINGS)
def test_every_setting_is_a_valid_on_policy_recipe(name):
    t = {"tis_cap": 1.17, "geo_high": 1.03, "veto_below": 0.31, "opsm_delta": 0.012}
    choices = {"lr": 4e-4, "precision": "fp8_emulated", "steps": 100, "thresholds": t}
    (run,) = study.main_runs(choices, [name], (3,))
    cfg = load_config(ROOT / "examples" / "ablations.yaml", list(run.overrides))
    assert cfg.rl.epochs * cfg.rl.num_minibatches == 1 and cfg.optimizer.lr == 4e-4 and cfg.run.steps == 100
    assert cfg.sampler.precision == ("fp32" if name == study.CONTROL else "fp8_emulated")
    a = cfg.rl.rollout_correction_args
    expect = {"grpo-tis": lambda: a.is_level == "token" and a.tis_cap == 1.17,
              "grpo-georej-veto": lambda: (a.rs_level, a.rs_high, a.veto_below, a.is_level) == ("geometric", 1.03, 0.31,
                                                                                                "none"),
              "grpo-opsm": lambda: cfg.rl.opsm_delta == 0.012, "grpo-r3": lambda: cfg.rl.replay == "R3",
              "grpo-bypass": lambda: cfg.rl.old_logprobs == "sampler" and cfg.rl.objective == "grpo",
              "gspo-bypass": lambda: cfg.rl.old_logprobs == "sampler" and cfg.rl.objective == "gspo"}
    assert expect.get(name, lambda: cfg.rl.rollout_correction == "none" and cfg.rl.replay == "none")()


def _result(block: str, setting: str, seed: int, rewards: list[float], k3: list[float], **extra) -> dict:
    rows = [{"step": i + 1, "reward/mean": r, rules.K3: k, rules.EXTREME: k * 5, rules.DISAGREE: 0.1}
            for i, (r, k) in enumerate(zip(rewards, k3, strict=True))]
    out = {"block": block, "setting": setting, "seed": seed, **rules.run_outcomes(rows),
           "metrics_sha256": f"{seed:064d}", "commit": "c0ffee", "warm_start": "w",
           "per_step": {k: [r[k] for r in rows] for k in (rules.K3, rules.EXTREME, rules.DISAGREE, "reward/mean")}}
    return {**out, **extra}


def _write(results: Path, res: dict) -> None:
    path = results / res["block"] / res["setting"] / f"seed{res['seed']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res))


def _pilot(results: Path) -> None:
    for lr in rules.PILOT_LRS:
        for s in study.LR_SEEDS:
            dead = lr == 8e-4 and s <= 2  # 8e-4 keeps training in 2 of 4: 4e-4 is the rate
            _write(results, _result("pilot-lr", study.lr_setting(lr), s, [0.3] * 90 + [0.0 if dead else 0.4] * 10,
                                    [1e-6] * 100))
    rng = np.random.default_rng(0)
    for p, scale in (("bf16", 1e-3), ("fp8_emulated", 2e-3)):
        for s in study.PRECISION_SEEDS:
            d = rng.normal(0, 0.05, 500).tolist()
            _write(results, _result("pilot-precision", f"grpo-{p}", s, [0.3] * 100, [scale] * 100,
                                    ratios={"token_log_ratio": d, "seq_mean_log_ratio": d[:100]}))


def test_blocks_unlock_in_the_plans_order(tmp_path):
    assert [b.name for b in study.blocks(tmp_path)] == ["pilot-lr"]
    assert len(study.pilot_lr_block().runs) == 12
    _pilot(tmp_path)
    choices = study.pilot_choices(tmp_path)
    assert choices["lr"] == 4e-4 and choices["precision"] == "fp8_emulated" and choices["steps"] == 100
    names = [b.name for b in study.blocks(tmp_path)]
    assert names == ["pilot-lr", "pilot-precision", "repeat", "main"]
    main = study.blocks(tmp_path)[-1]
    assert len(main.runs) == 80 and [r.setting for r in main.runs[:8]] == list(study.SETTINGS)
    assert all("optimizer.lr=0.0004" in r.overrides for r in main.runs)
    picked = study.select(study.blocks(tmp_path), "main", ["grpo-r3"], (11, 12))
    assert [(r.setting, r.seed) for r in picked[0].runs] == [("grpo-r3", 11), ("grpo-r3", 12)]
    with pytest.raises(SystemExit, match="not in block main"):
        study.select(study.blocks(tmp_path), "main", ["grpo-fp8"], None)
    with pytest.raises(SystemExit, match="not unlocked yet"):
        study.select(study.blocks(tmp_path), "stage2", None, None)


def test_stage2_takes_the_settings_whose_interval_straddles_delta(tmp_path):
    for n in study.SETTINGS:
        for s in study.MAIN_SEEDS:
            # the same spread everywhere (pooled SD 0.0606: Delta = 1.15 x 0.0606 = 0.0697);
            # R3 0.08 better, an interval [0.023, 0.137] that holds Delta; gspo-bypass 0.25
            # better, an interval wholly above it; the rest equal to GRPO, intervals +-0.057
            shift = {"grpo-r3": 0.08, "gspo-bypass": 0.25}.get(n, 0.0)
            noise = (s - 5.5) / 50
            _write(tmp_path, _result("main", n, s, [0.3 + shift + noise] * 100, [1e-3] * 100))
    assert study.stage2_settings(tmp_path) == [study.REFERENCE, "grpo-r3"]
    paths = write_reports(tmp_path)
    report = (tmp_path.parent / "MISMATCH.md").read_text()
    assert "Main block: 80 of 80 runs landed." in report and "Not yet" not in report
    assert "| R3 (the learner replays the sampler's routing) | final reward | 0.08 |" in report
    assert "| GSPO against the sampler | final reward | 0.25 |" in report
    assert "| the gap alone (grpo - grpo-fp32) | final reward | 0 |" in report
    assert {p.name for p in paths} >= {"mismatch_k3.png", "reward_mean.png", "collapses.png"}
    assert "## Both stages" not in report
    # Stage 2: R3 and grpo get seeds 11-20, R3 now only 0.02 better there (same spread): over
    # all 20 seeds R3's difference is (10 x 0.08 + 10 x 0.02) / 20 = 0.05; stage 1's row stays.
    for n, shift in ((study.REFERENCE, 0.0), ("grpo-r3", 0.02)):
        for s in study.STAGE2_SEEDS:
            _write(tmp_path, _result("stage2", n, s, [0.3 + shift + (s - 15.5) / 50] * 100, [1e-3] * 100))
    write_reports(tmp_path)
    report = (tmp_path.parent / "MISMATCH.md").read_text()
    stage1, both = report.split("## Both stages")
    assert "| R3 (the learner replays the sampler's routing) | final reward | 0.08 |" in stage1
    assert "Stage 2 (seeds 11-20) ran for `grpo` (10), `grpo-r3` (10)" in both
    assert "| R3 (the learner replays the sampler's routing) | final reward | 0.05 |" in both
    assert "| GSPO against the sampler | final reward | 0.25 |" in both  # (stage 1's seeds alone)


def test_two_warm_starts_balanced_over_settings(tmp_path):
    # Plan change 4: seeds 1-2 on warm start A, 3-10 on B in every setting. R3 is 0.08 better
    # on B's seeds and 0.02 worse on A's: over all 10 seeds (8 x 0.08 - 2 x 0.02) / 10 = 0.06,
    # and the fixed-effect fit weighs each warm start by n_a n_b / (n_a + n_b), 1 and 4:
    # (1 x -0.02 + 4 x 0.08) / 5 = 0.06 as well (balanced: the same answer).
    for n in study.SETTINGS:
        for s in study.MAIN_SEEDS:
            warm = "A" if s <= 2 else "B"
            shift = {"grpo-r3": -0.02 if warm == "A" else 0.08}.get(n, 0.0)
            _write(tmp_path, _result("main", n, s, [0.3 + shift + (s - 5.5) / 50] * 100, [1e-3] * 100,
                                     warm_start=warm))
    _write(tmp_path, _result(report.EXTRA, study.REFERENCE, 3, [0.3] * 100, [1e-3] * 100, warm_start="A"))
    _write(tmp_path, _result("repeat", study.REFERENCE, 1, [0.3] * 100, [1e-3] * 100, warm_start="A"))
    _write(tmp_path, _result("repeat", study.REFERENCE, 3, [0.3] * 100, [1e-3] * 100, warm_start="B",
                             metrics_sha256="9" * 64))
    _write(tmp_path, _result("repeat", study.REFERENCE, 2, [0.3] * 100, [1e-3] * 100, warm_start="B"))
    write_reports(tmp_path)
    text = (tmp_path.parent / "MISMATCH.md").read_text()
    assert "warm start(s): `A` seeds 1-2; `B` seeds 3-10, every seed on one warm start in every setting." in text
    assert "Kept outside every test (`mismatch/first-warm-start-extra/`" in text
    assert "`grpo` seed 3 on A (main's seed 3: B)" in text
    assert "`grpo` seed 1 (warm start A) run twice gives the same metrics digest" in text
    assert "`grpo` seed 3 (warm start B) run twice gives DIFFERENT metrics digest (999999999999 /" in text
    assert "`grpo` seed 2 (warm start B): not a repeat, main's ran on A." in text
    answer, factor = text.split("### Warm start as a factor (stage 1)")
    assert "| R3 (the learner replays the sampler's routing) | final reward | 0.06 |" in answer
    assert "| R3 (the learner replays the sampler's routing) | final reward | -0.02 (2/2) | 0.08 (8/8) | 0.06 |" in factor
    assert "| token TIS | final reward | 0 (2/2) | 0 (8/8) | 0 |" in factor and "2 warm starts" in text
    # a seed on two warm starts across settings is named, not hidden
    _write(tmp_path, _result("main", "grpo-tis", 4, [0.3] * 100, [1e-3] * 100, warm_start="A"))
    write_reports(tmp_path)
    assert "**Seed(s) 4 ran on more than one warm start across settings" in (tmp_path.parent / "MISMATCH.md").read_text()


def test_stage2_on_one_warm_start_is_answered_with_its_fixed_effect(tmp_path):
    # Warm start B lifts every setting by 0.1. R3 is 0.04 better in stage 1 (its interval holds
    # Delta ~0.05: sent to stage 2 with grpo) and equal in stage 2 (seeds 11-20, on B alone).
    # TIS keeps 2 A + 8 B seeds against grpo's 2 A + 18 B, so Welch over all seeds reads
    # 0.38 - 0.39 = -0.01 for it; the fixed-effect fit reads 0. R3 (2 A + 18 B like grpo):
    # A 0.04 (weight 2x2/4 = 1), B (8 x 0.04 + 10 x 0) / 18 (weight 18x18/36 = 9): 0.02 both ways.
    def reward(n: str, s: int, warm: str) -> float:
        shift = 0.1 if warm == "B" else 0.0
        better = 0.04 if n == "grpo-r3" and s <= 10 else 0.0
        return 0.3 + shift + better + (0.01 if s % 2 else -0.01)

    for n in study.SETTINGS:
        for s in study.MAIN_SEEDS:
            warm = "A" if s <= 2 else "B"
            _write(tmp_path, _result("main", n, s, [reward(n, s, warm)] * 100, [1e-3] * 100, warm_start=warm))
    assert study.stage2_settings(tmp_path) == [study.REFERENCE, "grpo-r3"]
    for n, seeds in ((study.REFERENCE, study.STAGE2_SEEDS), ("grpo-r3", study.STAGE2_SEEDS[:5])):
        for s in seeds:
            _write(tmp_path, _result("stage2", n, s, [reward(n, s, "B")] * 100, [1e-3] * 100, warm_start="B"))
    write_reports(tmp_path)
    both = (tmp_path.parent / "MISMATCH.md").read_text().split("## Both stages")[1]
    assert "ran for `grpo` (10), `grpo-r3` (5): 15 of 20 runs landed" in both
    assert "Partial: not to be read as a result until stage 2's 20 runs have landed." in both
    for s in study.STAGE2_SEEDS[5:]:
        _write(tmp_path, _result("stage2", "grpo-r3", s, [reward("grpo-r3", s, "B")] * 100, [1e-3] * 100,
                                 warm_start="B"))
    write_reports(tmp_path)
    both = (tmp_path.parent / "MISMATCH.md").read_text().split("## Both stages")[1]
    assert "20 of 20 runs landed" in both and "Partial" not in both
    assert "the answer here is the fixed-effect table below" in both
    welch_part, factor = both.split("### Warm start as a factor (both stages)")
    assert "| token TIS | final reward | -0.01 |" in welch_part
    assert "| R3 (the learner replays the sampler's routing) | final reward | 0.02 |" in welch_part
    assert "| token TIS | final reward | 0 (2/2) | 0 (8/18) | 0 | [" in factor
    assert "| R3 (the learner replays the sampler's routing) | final reward | 0.04 (2/2) | 0.0178 (18/18) | 0.02 |" in factor


def test_stratified_difference_by_hand():
    # one stratum: the pooled two-sample t-test
    a, b = [1.0, 2.0, 4.0], [0.0, 1.0, 1.5, 2.0]
    res = stratified_difference([(v, "x") for v in a], [(v, "x") for v in b])
    assert res["diff"] == pytest.approx(7 / 3 - 1.125) and res["df"] == 5
    assert res["p"] == pytest.approx(scipy_stats.ttest_ind(a, b).pvalue)
    # two strata, B shifted by 10: within A 1.5 - 0.5 = 1 (weight 2x2/4 = 1), within B 12 - 10 = 2
    # (weight 3x1/4 = 0.75): (1 + 1.5) / 1.75
    res = stratified_difference([(1, "A"), (2, "A"), (11, "B"), (12, "B"), (13, "B")],
                                [(0, "A"), (1, "A"), (10, "B")])
    assert res["diff"] == pytest.approx(2.5 / 1.75) and res["lo"] < res["diff"] < res["hi"]
    assert math.isnan(stratified_difference([(1.0, "A"), (2.0, "A")], [(0.0, "B"), (1.0, "B")])["diff"])


def test_seed_ranges():
    assert report.seed_ranges([8, 1, 2, 3, 5, 7]) == "1-3, 5, 7-8" and report.seed_ranges([]) == ""


def test_reports_are_regenerated_byte_for_byte(tmp_path):
    _pilot(tmp_path)
    for path in write_reports(tmp_path):
        assert path.is_file()
    first = [p.read_text() for p in (tmp_path / "PILOT.md", tmp_path.parent / "MISMATCH.md")]
    write_reports(tmp_path)
    assert first == [p.read_text() for p in (tmp_path / "PILOT.md", tmp_path.parent / "MISMATCH.md")]
    pilot = first[0]
    assert "**Rate: 0.0004**" in pilot and "**Precision: fp8_emulated.**" in pilot
    assert "**Horizon: 100 steps**" in pilot and "| TIS cap C |" in pilot
    assert "Main block: 0 of 80 runs landed." in first[1] and "Not yet" in first[1]


def test_dumped_ratios_read_the_learner_and_sampler_log_probs(tmp_path):
    dump = tmp_path / "rollouts" / "step_000010.jsonl"
    dump.parent.mkdir(parents=True)
    dump.write_text(json.dumps({"sampler_logprobs": [-1.0, -2.0], "learner_logprobs": [-0.9, -2.2]}) + "\n"
                    + json.dumps({"sampler_logprobs": [], "learner_logprobs": []}) + "\n")
    out = study.dumped_ratios(tmp_path)
    assert out["token_log_ratio"] == pytest.approx([0.1, -0.2]) and out["seq_mean_log_ratio"] == pytest.approx([-0.05])


def test_the_runner_goes_on_to_the_blocks_each_pass_unlocks(tmp_path, monkeypatch):
    """A pass that completes its blocks goes on to the ones their results unlock (here a
    second block of more runs than the first), and stops when a pass makes no progress."""
    from moe_rl.ablations.runner import Run

    monkeypatch.setattr(study, "ensure_base", lambda out, base, threads: tmp_path / "base")
    monkeypatch.setattr(study, "warm_start_id", lambda base: "w")
    monkeypatch.setattr(study, "code_commit", lambda: "c")
    trained: list[tuple[str, int]] = []

    def fake_run_all(runs, runs_dir, base, jobs, on_done):
        for r in runs:
            trained.append((r.setting, r.seed))
            path = study.mismatch_result_path(tmp_path, runs_dir.name, r)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}")
        return []

    monkeypatch.setattr(study, "run_all", fake_run_all)
    first = study.Block("first", (Run("a", 1, own=True),))
    second = study.Block("second", tuple(Run("b", s, own=True) for s in (1, 2, 3)))

    def make_blocks():
        done = study.mismatch_result_path(tmp_path, "first", first.runs[0]).is_file()
        return [first, second] if done else [first]

    assert study.run_study(tmp_path / "out", make_blocks, None, 2, tmp_path) == []
    assert trained == [("a", 1), ("b", 1), ("b", 2), ("b", 3)]

    def stuck_run_all(runs, runs_dir, base, jobs, on_done):
        return []  # trains nothing, fails nothing: no progress

    monkeypatch.setattr(study, "run_all", stuck_run_all)
    third = study.Block("third", (Run("c", 1, own=True),))
    assert study.run_study(tmp_path / "out", lambda: [third], None, 2, tmp_path) == []

    def no_base(out, base, threads):
        raise AssertionError("nothing is missing: no warm start to build")

    monkeypatch.setattr(study, "ensure_base", no_base)
    assert study.run_study(tmp_path / "out", make_blocks, None, 2, tmp_path) == []  # every run landed
