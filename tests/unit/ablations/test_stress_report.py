"""The stress report from synthetic result files: the pre-registered tests against
hand-derived Fisher and Holm values, the collapse onset, the mechanism window, the plain-language
answer the numbers write, and the reproducibility line from digests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moe_rl.ablations.settings import settings
from moe_rl.ablations.stress_report import (
    collapse_onset,
    mechanism_reading,
    window,
    write_stress_report,
)
from moe_rl.ablations.stress_tables import against_baseline, merged

LAYERS = 2


def _run(setting: str, seed: int, collapsed: bool, block: str = "main", digest: str = "d",
         ratio_max: float = 1.0, warm: str | None = None) -> dict:
    rewards = [0.35] * 20 + ([0.0] * 20 if collapsed else [0.4] * 20)
    flips = [0.9 if collapsed else 0.1] * 40
    per_step = {"reward/mean": rewards, "routing/flip_rate_mean": flips, "routing/dlogr_mean": flips,
                "policy/clip_frac": [0.0] * 40, "policy/ratio_max": [ratio_max] * 40, **{f"routing/dlogr_layer{i}": flips for i in range(LAYERS)},
                **{f"routing/flip_rate_layer{i}": flips for i in range(LAYERS)}}
    return {"block": block, "setting": setting, "seed": seed, "commit": "abc1234", "steps": 40, "collapsed": collapsed,
            "first_reward": 0.35, "final_reward": sum(rewards[-5:]) / 5, "reward_auc": sum(rewards) / 40,
            "metrics_sha256": digest, "per_step": per_step, **({"warm_start": warm} if warm else {})}


def _write(results: Path, run: dict) -> None:
    p = results / run["block"] / run["setting"] / f"seed{run['seed']}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(run))


@pytest.fixture
def results(tmp_path) -> Path:
    r = tmp_path / "stress"
    for seed in range(1, 5):  # the sweep: 4/4 collapses at 3e-4 -> the plan's step 3 picks it
        p = r / "sweep" / "lr0.0003" / f"seed{seed}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({**_run("grpo-off", seed, True), "block": "sweep"}))
    for name in settings():
        for seed in range(1, 11):
            # grpo-off collapses 9/10, gspo-off 0/10, every other setting 5/10
            c = seed <= 9 if name == "grpo-off" else False if name == "gspo-off" else seed <= 5
            _write(r, _run(name, seed, c))
    _write(r, _run("grpo-off", 1, True, block="repeat"))
    return r


def test_fisher_and_holm_by_hand(results):
    rows = {r["setting"]: r for r in against_baseline(merged(results))}
    assert len(rows) == 16
    # 0/10 vs 9/10: the two tables as extreme as the observed one each have C(11,10)/C(20,10)
    p = 2 * math.comb(11, 10) / math.comb(20, 10)
    assert rows["gspo-off"]["fisher_p"] == pytest.approx(p, rel=1e-9)
    assert rows["gspo-off"]["fisher_holm"] == pytest.approx(16 * p, rel=1e-9)  # the smallest of 16
    # 5/10 vs 9/10: P = sum of hypergeometric terms <= P(observed), 14 collapses of 20, 10 drawn
    hyper = [math.comb(14, k) * math.comb(6, 10 - k) / math.comb(20, 10) for k in range(4, 11)]
    obs = hyper[5 - 4]
    assert rows["gmpo-off"]["fisher_p"] == pytest.approx(sum(h for h in hyper if h <= obs * (1 + 1e-7)), rel=1e-9)
    assert rows["gmpo-off"]["fisher_holm"] == pytest.approx(min(1.0, 15 * rows["gmpo-off"]["fisher_p"]), rel=1e-9)
    assert rows["gspo-off"]["rate_diff"] == pytest.approx(-0.9)
    lo, hi = rows["gspo-off"]["rate_ci"]
    assert -1 < lo < -0.9 < hi < 0  # Newcombe: inside [-1, 1], excludes 0 here
    # final reward: gspo 0.4 in every seed vs grpo 0.0 in 9 and 0.4 in 1
    assert rows["gspo-off"]["final_reward"]["diff"] == pytest.approx(0.4 - 0.04)


def test_collapse_onset_and_the_mechanism_window():
    assert collapse_onset([0.35] * 20 + [0.0] * 20) == 21  # every 5-step window from step 21 on is 0
    assert collapse_onset([0.3, 0.1, 0.0, 0.05, 0.0, 0.0] + [0.0] * 10) == 2  # (0.1 + 0.05) / 5 < 0.05
    assert collapse_onset([0.35] * 40) is None
    assert collapse_onset([0.35] * 10 + [0.0] * 10 + [0.35] * 20) is None  # recovered: no lasting onset
    assert window(_run("grpo-off", 1, True)) == list(range(10, 20))  # steps 11-20, before step 21
    assert window(_run("grpo-off", 1, False)) == list(range(30, 40))


def test_the_report_says_what_the_numbers_say(results):
    for name in ("grpo-off", "rspo-post-off", "gspo-off", "grpo-r3-off", "sapo-off"):
        for seed in (1, 2, 3):
            _write(results, _run(name, seed, name == "sapo-off", block="contrast"))
    text = write_stress_report(results).read_text()
    assert "lr 0.0003, 4 mini-batch updates per rollout" in text and "Main runs finished: 170 of 170." in text
    answer = text.split("## The answer")[1].split("##")[0]
    assert "collapsed in 9 of 10 seeds" in answer
    assert "gspo-off (0/10, Holm p 0.0019)" in answer  # 16 x 2 x 11 / 184756
    assert "**GSPO**: fewer collapses than GRPO (Holm): gspo-off" in text
    assert "**RSPO**: not separable" in text
    assert "identical" in text.split("## Reproducibility")[1]
    assert ("at the contrast's lr 0.0002: grpo-off 3/3, rspo-post-off 3/3, gspo-off 3/3, grpo-r3-off 3/3" in text
            and "collapses came only in sapo-off (3/3)" in text)
    for png in ("collapse_rates", "mechanism", "layers", "mechanism_contrast"):
        assert (results / "plots" / f"{png}.png").stat().st_size > 10_000


def test_a_differing_repeat_is_reported_loudly(results):
    _write(results, _run("grpo-off", 1, True, block="repeat", digest="other"))
    assert "**DIFFERS**" in write_stress_report(results, plots=False).read_text()


def test_a_regime_where_every_method_collapses_is_called_what_it_is(results):
    for name in settings():
        if name.endswith("-off"):
            for seed in range(1, 11):
                _write(results, _run(name, seed, seed <= 9))
    answer = write_stress_report(results, plots=False).read_text().split("## The answer")[1].split("##")[0]
    assert "Every off-policy setting collapsed in at least 90% of its seeds" in answer
    for seed in (4, 5, 6, 7):  # 4/4 and 0/4 of 4 seeds: Wilson's bounds meet the rate (the plot's error bars)
        _write(results, _run("grpo-on", seed, True))
        _write(results, _run("gmpo-off", seed, False))
    for name in settings():
        if name not in ("grpo-on", "gmpo-off"):
            for seed in range(1, 11):
                _write(results, _run(name, seed, True))
    for p in (results / "main" / "grpo-on").glob("seed*.json"):
        if int(p.stem[4:]) not in (4, 5, 6, 7):
            p.unlink()
    for p in (results / "main" / "gmpo-off").glob("seed*.json"):
        if int(p.stem[4:]) not in (4, 5, 6, 7):
            p.unlink()
    assert "collapsed in 10 of 10 seeds" in write_stress_report(results, plots=False).read_text()


def test_the_mechanism_reading_weighs_bounded_ratios_against_grpos():
    """GRPO's token ratios reach 30 before it falls; the sequence-level objectives (GSPO, GMPO,
    RSPO: 8 settings) keep theirs at 1.4. Falling as often, they show the ratio is not what
    decides the collapse; never falling, the sentence says so and draws no such conclusion."""
    def res(seq_collapses: bool) -> dict:
        out = {n: [_run(n, s, s <= 9, ratio_max=30.0 if n.startswith(("grpo", "sapo")) else 1.4)
                   for s in range(1, 11)] for n in settings()}
        for n in ("gspo-off", "gspo-tis-off", "gmpo-off", "gmpo-tis-off", "rspo-post-off", "rspo-post-tis-off",
                  "rspo-pre-off", "rspo-pre-tis-off"):
            out[n] = [_run(n, s, seq_collapses and s <= 9, ratio_max=1.4) for s in range(1, 11)]
        return out

    fell = mechanism_reading(res(True))
    assert "largest token ratio averaged 30.0" in fell and "kept theirs at 1.40 and collapsed in 72 of 80 runs" in fell
    assert "Bounding the ratio did not prevent the collapse" in fell
    assert "On-policy GRPO" in fell and "collapsed in 9 of 10" in fell
    gentle = {"grpo-off": [_run("grpo-off", s, False, block="contrast", ratio_max=8.0) for s in (1, 2, 3)]}
    assert "kept training at lr 0.0002 saw a largest token ratio of 8.0 (8.0-8.0 per run)" in mechanism_reading(
        res(True), gentle)
    # a GRPO seed whose reward is below the line from step 1 has no steps before its onset: left
    # out of the mean and counted, not a nan in the sentence
    from_start = res(True)
    from_start["grpo-off"][0]["per_step"]["reward/mean"] = [0.0] * 40
    text = mechanism_reading(from_start, gentle)
    assert "against 30.0 (30.0-30.0 per run; 1 collapsing from step 1 left out) before the collapses" in text
    assert "nan" not in text
    kept = mechanism_reading(res(False))
    assert "kept theirs at 1.40 and never collapsed (80 runs)" in kept and "did not prevent" not in kept


def test_the_exploratory_section_checks_the_code_then_tests_at_the_chosen_rate(results):
    """Change 6 of the plan: the code check against main's digest, GRPO's sweep between the
    two rates and the rule's pick, then the tests at that rate over its 3 comparisons alone."""
    section = lambda: write_stress_report(results, plots=False).read_text().split("## Exploratory: between the two rates")[1]  # noqa: E731
    assert "Not run yet" in section()
    _write(results, _run("grpo-off", 1, True, block="explore-repeat"))  # main's seed 1 digest: "d"
    for seed in (1, 2, 3, 4):
        _write(results, _run("grpo-off", seed, seed <= 2, block="explore-sweep-0.00025"))
    text = section()
    assert "**identical**" in text and "lr 0.00025: 2 of 4 seeds collapsed" in text and "The rule: lr 0.00025." in text
    _write(results, _run("grpo-off", 1, True, block="explore-0.00025"))
    assert "**Provisional**: 1 of the block's 40 runs have finished" in section()
    assert "The gentler step" not in write_stress_report(results, plots=False).read_text()  # (the answer waits for all 40)
    for name in ("grpo-off", "gspo-off", "grpo-r3-off", "rspo-post-off"):
        for seed in range(1, 11):  # GRPO 5/10, GSPO 0/10, the other two 5/10
            _write(results, _run(name, seed, name != "gspo-off" and seed <= 5, block="explore-0.00025"))
    text = section()
    assert "Provisional" not in text
    assert "Holm over the 3 comparisons" in text and "off-policy GRPO collapsed in 5 of 10 seeds" in text
    # 0/10 vs 5/10: the two tables as extreme, C(15,10)/C(20,10) each; Holm x3 (the smallest p)
    p = 2 * math.comb(15, 10) / math.comb(20, 10)
    assert "| gspo-off | 0/10 | -0.50" in text and f"{3 * p:.2g}" in text
    the_answer = write_stress_report(results, plots=False).read_text().split("## The answer")[1].split("## Per setting")[0]
    assert ("The gentler step, explored after these results were read" in the_answer
            and "at lr 0.00025 off-policy GRPO collapsed in 5 of 10 seeds; grpo-r3-off 5/10, gspo-off 0/10, "
                "rspo-post-off 5/10." in the_answer and "Per claim there: **GSPO**:" in the_answer)
    mechanism = text.split("The mechanism there (descriptive")[1]
    assert "| grpo-off | 5 collapsed |" in mechanism and "| grpo-off | 5 survived |" in mechanism
    _write(results, _run("grpo-off", 1, True, block="explore-repeat", digest="moved"))
    assert "**DIFFERS**" in section()


def test_a_remade_warm_start_is_named_per_block_and_tested_apart(results):
    """Change 7 of the plan: stage-2 seeds on a remade warm start are listed as such and the
    stage-2 tests are given again on the first warm start's seeds alone (here GRPO 11-18 all
    collapse, GSPO's none; seeds 19-20 on the remade one: both collapse)."""
    for name in ("grpo-off", "gspo-off", "grpo-r3-off", "rspo-post-off"):
        for seed in range(11, 21):
            remade = seed >= 19
            c = True if remade else name != "gspo-off"
            _write(results, _run(name, seed, c, block="stage2", warm="feedfacecafebeef" if remade else None))
    text = write_stress_report(results, plots=False).read_text()
    assert ("- `stage2`: feedfacecafebeef: seeds 19-20; first (not recorded): seeds 11-18 (**two warm starts**)"
            in text)
    assert "- `main`: first (not recorded): seeds 1-10\n" in text
    first = text.split("The same tests on the first warm start's seeds alone:")[1].split("## The mechanism")[0]
    # GRPO 17/18 (9/10 + 8/8), GSPO 0/18: Fisher two-sided = P(the table) + P(the mirror), both C(18,17)C(18,0)/C(36,17)
    assert "off-policy GRPO collapsed in 17 of 18 seeds" in first and "| gspo-off | 0/18 |" in first
    p = 2 * 18 / math.comb(36, 17)
    assert f"{16 * p:.2g}" in first  # Holm's first step over the 16 comparisons against GRPO
    everything = text.split("## Stage 2")[1].split("The same tests on")[0]
    assert "off-policy GRPO collapsed in 19 of 20 seeds" in everything and "| gspo-off | 2/20 |" in everything


def test_the_warm_start_check_separates_code_from_warm_start(results):
    """The repeat on a later commit differs from main's; the check on main's commit and the
    remade warm start says the warm start moved the numbers, not the code."""
    _write(results, _run("grpo-off", 1, True, block="explore-repeat", digest="e" * 64, warm="feedfacecafebeef"))
    _write(results, _run("grpo-off", 1, True, block="warm-start-check", digest="e" * 64, warm="feedfacecafebeef"))
    text = write_stress_report(results, plots=False).read_text().split("## Exploratory: between the two rates")[1]
    assert "warm start feedfacecafebeef) and main's (commit abc1234, warm start first (not recorded)): **DIFFERS**" in text
    assert ("against main's run (same code, the other warm start) **DIFFERS** (eeeeeeeeeeee vs d); against the repeat "
            "above (commit abc1234, the same warm start) **identical**") in text
