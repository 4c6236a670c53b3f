"""The collapse-rate statistics of the stress ablations (issue #47) against hand-derived and
published values: Fisher's exact p from the hypergeometric, Newcombe's (1998) worked intervals,
an exactly enumerable power, and the pre-registered collapse rule at its edges."""

from __future__ import annotations

import math

import pytest

from moe_rl.ablations.collapse_stats import (
    fisher,
    fisher_power,
    min_detectable_rate,
    rate_difference_interval,
    stress_collapsed,
)


def test_fisher_is_the_doubled_hypergeometric_tail_of_a_one_sided_extreme():
    # 5 of 20 collapses all in the first 10: P = C(10,5) / C(20,5); the table is symmetric
    assert fisher(5, 10, 0, 10) == pytest.approx(2 * math.comb(10, 5) / math.comb(20, 5), rel=1e-12)
    assert fisher(7, 10, 0, 10) == pytest.approx(2 * math.comb(10, 7) / math.comb(20, 7), rel=1e-12)
    assert fisher(3, 10, 3, 10) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="events <= runs"):
        fisher(11, 10, 0, 10)


def test_newcombe_hybrid_score_interval_matches_the_papers_worked_examples():
    # Newcombe (1998), Statistics in Medicine 17:873, Table II, method 10
    lo, hi = rate_difference_interval(56, 70, 48, 80)
    assert (round(lo, 4), round(hi, 4)) == (0.0524, 0.3339)
    lo, hi = rate_difference_interval(9, 10, 3, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.1705, 0.8090)
    lo, hi = rate_difference_interval(0, 10, 0, 10)  # no events either side: symmetric about 0
    assert lo == pytest.approx(-hi) and 0 < hi < 0.35


def test_power_enumerates_every_outcome():
    # 2 runs a side, rates 1 and 0: the only outcome is 2/2 vs 0/2, p = 2 / C(4, 2) = 1/3
    assert fisher_power(2, 2, 1.0, 0.0, alpha=0.34) == pytest.approx(1.0)
    assert fisher_power(2, 2, 1.0, 0.0, alpha=0.33) == 0.0
    # rates 0.5 and 0: only 2/2 vs 0/2 (probability 1/4) reaches p <= 1/3
    assert fisher_power(2, 2, 0.5, 0.0, alpha=0.34) == pytest.approx(0.25)
    # the pre-registration's numbers (docs/ablations/STRESS_PLAN.md)
    assert round(fisher_power(10, 10, 0.5, 0.0, 0.05 / 16), 2) == 0.17
    assert min_detectable_rate(10, 0.05 / 16) == 0.8 and min_detectable_rate(20, 0.05 / 16) == 0.55


def test_the_collapse_rule_at_its_edges():
    assert stress_collapsed([0.5] * 35 + [0.04] * 5)          # final below the floor
    assert not stress_collapsed([0.5] * 35 + [0.21] * 5)      # 0.29 below the first step
    assert stress_collapsed([0.5] * 35 + [0.19] * 5)          # 0.31 below it
    assert stress_collapsed([0.02] * 40)                      # never rose: below the floor all along
    assert not stress_collapsed([0.3] + [0.6] * 39) and not stress_collapsed([])


def test_the_stress_sweep_picks_the_plans_regime_from_committed_result_files(tmp_path):
    """The regime rule, and SWEEP.md regenerated from result files alone (no run directory)."""
    import json

    from moe_rl.ablations.stress import pick_regime, result, write_stress_sweep

    assert pick_regime({2e-4: (0, 4), 3e-4: (1, 4), 4e-4: (2, 4), 6e-4: (4, 4)}) == 4e-4
    assert pick_regime({2e-4: (0, 4), 6e-4: (4, 4)}) is None
    for lr, finals in {2e-4: [0.6, 0.6, 0.5, 0.6], 4e-4: [0.01, 0.6, 0.02, 0.5]}.items():
        for seed, final in enumerate(finals, 1):
            rows = [{"reward/mean": 0.4, "step": 1}] + [{"reward/mean": final, "step": s} for s in range(2, 41)]
            doc = result(rows, {"setting": "grpo-off", "lr": lr, "seed": seed, "commit": "abc1234"})
            assert doc["collapsed"] == (final < 0.05) and doc["per_step"]["reward/mean"][0] == 0.4
            d = tmp_path / "sweep" / f"lr{lr:g}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"seed{seed}.json").write_text(json.dumps(doc))
    text = write_stress_sweep(tmp_path).read_text()
    assert "| 0.0004 | 4 | 2/4 |" in text and "picks **lr = 0.0004 at 4 updates per rollout**" in text and "abc1234" in text
