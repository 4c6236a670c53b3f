"""The mismatch study's pre-registered rules (docs/ablations/MISMATCH_PLAN.md), as functions
of its result files alone: a run's outcomes, the pilot's choices of learning rate, precision,
horizon and correction thresholds, and the stage-2 rule.

    run_outcomes(rows)                         # final reward, AUC, collapse, the mechanism
    chosen_lr({2e-4: [False, True, ...]})  # the largest rate surviving 3 of 4 seeds
    thresholds(token_log_ratios, seq_mean_log_ratios)   # C, h, tau, delta from measured ratios

Every number the plan fixes is a constant here, named as the plan names it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

import numpy as np
from scipy import stats as sps

from moe_rl.ablations.stats import mean_or_nan

PILOT_LRS = (2e-4, 4e-4, 8e-4)
"""The learning-rate pilot's grid."""
PILOT_SURVIVORS = 3
"""Seeds of 4 that must not collapse for a rate to qualify."""
PRECISIONS = ("bf16", "fp8_emulated")
"""The samplers the precision pilot compares; fp8_emulated is the default choice."""
PILOT_STEPS = 100
LONG_HORIZON = 200
GROWTH = 1.2
"""The horizon rule: end-of-pilot k3 above this times its steps-26-50 mean (and a positive slope)."""
FINAL_WINDOW = 25
"""Steps whose mean reward is a run's final reward (and whose means are the mechanism's ends)."""
START_WINDOW = 5
COLLAPSE_LAST = 10
COLLAPSE_FLOOR = 0.05
COLLAPSE_DROP = 0.3
TIS_QUANTILE = 0.99
GEO_QUANTILE = 0.99
VETO_QUANTILE = 0.001
OPSM_QUANTILE = 0.95
K3 = "mismatch/k3"
EXTREME = "mismatch/frac_dlogp_gt_ln2"
DISAGREE = "routing/sampler_disagree_any"


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]


def _fit(values: Sequence[float]) -> Any:
    return sps.linregress(np.arange(len(values), dtype=np.float64), np.asarray(values, dtype=np.float64))


def slope(values: Sequence[float]) -> float:
    """Least-squares slope per step of `values` (one per step; nan below 2)."""
    return float(_fit(values).slope) if len(values) >= 2 else float("nan")


def slope_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(slope, lo, hi): the least-squares slope per step and its Student-t interval (nan below 3)."""
    if len(values) < 3:
        return float("nan"), float("nan"), float("nan")
    fit = _fit(values)
    half = sps.t.ppf(0.5 + level / 2, len(values) - 2) * fit.stderr
    return float(fit.slope), float(fit.slope - half), float(fit.slope + half)


def run_collapsed(rewards: Sequence[float]) -> bool:
    """The plan's collapse: the last COLLAPSE_LAST steps' mean reward is below COLLAPSE_FLOOR or
    more than COLLAPSE_DROP below the first START_WINDOW steps' mean (an empty run did not)."""
    if not rewards:
        return False
    final = mean_or_nan(rewards[-COLLAPSE_LAST:])
    return final < COLLAPSE_FLOOR or final < mean_or_nan(rewards[:START_WINDOW]) - COLLAPSE_DROP


def run_outcomes(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A run's outcomes under the plan's definitions, from its logged steps."""
    rewards = _series(rows, "reward/mean")
    k3, extreme, disagree = _series(rows, K3), _series(rows, EXTREME), _series(rows, DISAGREE)
    return {"steps": len(rewards), "final_reward": mean_or_nan(rewards[-FINAL_WINDOW:]), "reward_auc": mean_or_nan(rewards),
            "collapsed": run_collapsed(rewards), "k3_end": mean_or_nan(k3[-FINAL_WINDOW:]), "k3_slope": slope(k3),
            "extreme_end": mean_or_nan(extreme[-FINAL_WINDOW:]), "extreme_slope": slope(extreme),
            "disagree_end": mean_or_nan(disagree[-FINAL_WINDOW:])}


def chosen_lr(collapses: Mapping[float, Sequence[bool]]) -> tuple[float, bool]:
    """(rate, qualified): the largest pilot rate at which at least PILOT_SURVIVORS seeds did not
    collapse; failing every rate, the smallest, with qualified False (the report says so)."""
    ok = [lr for lr, c in collapses.items() if sum(not x for x in c) >= PILOT_SURVIVORS]
    return (max(ok), True) if ok else (min(collapses), False)


def pooled_per_step(runs: Sequence[Sequence[float]]) -> list[float]:
    """The per-step mean over runs (each a per-step series; the shortest decides the length)."""
    n = min((len(r) for r in runs), default=0)
    return [mean_or_nan([r[i] for r in runs]) for i in range(n)]


def steps_mean(values: Sequence[float], first: int, last: int) -> float:
    """The mean of steps first..last (1-based, inclusive)."""
    return mean_or_nan(list(values[first - 1:last]))


def chosen_precision(end_k3: Mapping[str, float]) -> str:
    """fp8_emulated, unless bf16's end-of-horizon k3 is at least fp8_emulated's."""
    return "bf16" if end_k3["bf16"] >= end_k3["fp8_emulated"] else "fp8_emulated"


def horizon(k3_per_step: Sequence[float]) -> tuple[int, dict[str, float]]:
    """(steps, the rule's numbers): LONG_HORIZON when the pooled k3 is still growing at the
    pilot's end (steps 76-100 above GROWTH x steps 26-50, and the slope over 51-100 positive
    with its 95% interval above 0), else PILOT_STEPS."""
    early, late = steps_mean(k3_per_step, 26, 50), steps_mean(k3_per_step, 76, 100)
    s, lo, hi = slope_interval(list(k3_per_step[50:100]))
    growing = late > GROWTH * early and lo > 0
    return (LONG_HORIZON if growing else PILOT_STEPS), {"k3_26_50": early, "k3_76_100": late, "slope_51_100": s,
                                                        "slope_lo": lo, "slope_hi": hi}


def round_sig(x: float, digits: int, up: bool) -> float:
    """`x` rounded up (or down) to `digits` significant digits, exactly in decimal."""
    if x == 0 or not math.isfinite(x):
        return x
    d = Decimal(repr(x))
    quantum = Decimal(1).scaleb(d.adjusted() - digits + 1)
    return float(d.quantize(quantum, rounding=ROUND_CEILING if up else ROUND_FLOOR))


def thresholds(token_log_ratio: Sequence[float], seq_mean_log_ratio: Sequence[float]) -> dict[str, float]:
    """The corrections' thresholds from the pilot's measured ratios (pooled; `d = learner -
    sampler` log-probs per response token, and each response's mean d): TIS cap C, the
    geometric band's h, the veto tau and OPSM's delta, by the plan's quantiles and roundings."""
    if not token_log_ratio or not seq_mean_log_ratio:
        raise ValueError("thresholds: the precision pilot's dumps hold no response token")
    d = np.asarray(token_log_ratio, dtype=np.float64)
    m = np.asarray(seq_mean_log_ratio, dtype=np.float64)
    return {"tis_cap": round_sig(float(np.quantile(np.exp(d), TIS_QUANTILE)), 3, up=True),
            "geo_high": round_sig(float(np.quantile(np.exp(np.abs(m)), GEO_QUANTILE)), 3, up=True),
            "veto_below": round_sig(float(np.quantile(np.exp(d), VETO_QUANTILE)), 2, up=False),
            "opsm_delta": round_sig(float(np.quantile(-m, OPSM_QUANTILE)), 3, up=True)}


def pooled_sd(groups: Sequence[Sequence[float]]) -> float:
    """The pooled within-group SD (nan without two values in some group)."""
    usable = [g for g in groups if len(g) >= 2]
    dof = sum(len(g) - 1 for g in usable)
    if not dof:
        return float("nan")
    return math.sqrt(sum(statistics.variance(g) * (len(g) - 1) for g in usable) / dof)


DELTA_PER_SD = 1.15
"""The difference that matters, in pooled SDs: what 20 seeds per arm detect at 80% power and
Holm's first threshold over the 6 comparisons (the plan's power table)."""


def needs_stage2(interval: tuple[float, float], delta: float) -> bool:
    """A stage-1 interval for the final-reward difference that contains +delta or -delta."""
    lo, hi = interval
    return any(lo <= x <= hi for x in (delta, -delta))
