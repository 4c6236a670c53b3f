"""Collapse rates across seeds (the stress study's primary outcome, docs/ablations/STRESS_PLAN.md):
what a collapse is, Fisher's exact test between two settings' rates, the interval of their
difference, and the power that a number of seeds has, computed before the runs.

    stress_collapsed(rewards)                       # the pre-registered per-run definition
    fisher(7, 10, 0, 10)                            # two-sided p of 7/10 vs 0/10 collapses
    rate_difference_interval(7, 10, 0, 10)          # Newcombe's hybrid score 95% interval
    fisher_power(10, 10, 0.8, 0.0, 0.05 / 16)       # chance to detect it at Holm's first step
    min_detectable_rate(10, 0.05 / 16)              # smallest rate detectable against 0 at 80%
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from functools import cache

from scipy import stats as sps

LAST = 5
"""Steps whose mean reward is a run's final reward for the collapse rule."""
FLOOR = 0.05
"""A final reward below this is a collapse."""
DROP = 0.3
"""A final reward more than this below the first step's is a collapse."""


def stress_collapsed(rewards: Sequence[float]) -> bool:
    """The run collapsed: the mean reward of its last `LAST` steps is below `FLOOR`, or more
    than `DROP` below its first step's reward (an empty run did not)."""
    if not rewards:
        return False
    final = statistics.fmean(rewards[-LAST:])
    return final < FLOOR or final < rewards[0] - DROP


@cache
def fisher(a: int, n_a: int, b: int, n_b: int) -> float:
    """Two-sided p-value of Fisher's exact test for equal rates: a of n_a against b of n_b."""
    if not (0 <= a <= n_a and 0 <= b <= n_b) or n_a < 1 or n_b < 1:
        raise ValueError(f"fisher: need 0 <= events <= runs and runs >= 1, got {a}/{n_a} and {b}/{n_b}")
    return float(sps.fisher_exact([[a, n_a - a], [b, n_b - b]])[1])


def wilson(x: int, n: int, z: float) -> tuple[float, float]:
    """Wilson's score interval for a rate of x in n (z: the normal quantile of the level)."""
    p = x / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def rate_difference_interval(a: int, n_a: int, b: int, n_b: int, level: float = 0.95) -> tuple[float, float]:
    """Newcombe's hybrid score interval (his method 10, 1998) for a/n_a - b/n_b: good coverage
    at the small counts and 0 or n events that seed counts give, where the Wald interval fails."""
    if n_a < 1 or n_b < 1:
        raise ValueError("rate_difference_interval: each side needs at least one run")
    z = sps.norm.ppf(0.5 + level / 2)
    p_a, p_b = a / n_a, b / n_b
    l_a, u_a = wilson(a, n_a, z)
    l_b, u_b = wilson(b, n_b, z)
    d = p_a - p_b
    lo = d - math.sqrt((p_a - l_a) ** 2 + (u_b - p_b) ** 2)
    hi = d + math.sqrt((u_a - p_a) ** 2 + (p_b - l_b) ** 2)
    return lo, hi


def fisher_power(n_a: int, n_b: int, p_a: float, p_b: float, alpha: float) -> float:
    """The chance that Fisher's test rejects at `alpha` when the true rates are p_a and p_b:
    exact, summing the two binomials over every outcome whose p-value is at most alpha."""
    pa = sps.binom.pmf(range(n_a + 1), n_a, p_a)
    pb = sps.binom.pmf(range(n_b + 1), n_b, p_b)
    return float(sum(pa[a] * pb[b] for a in range(n_a + 1) for b in range(n_b + 1) if fisher(a, n_a, b, n_b) <= alpha))


def min_detectable_rate(n: int, alpha: float, power: float = 0.8, other: float = 0.0, step: float = 0.05) -> float:
    """The smallest rate (on a `step` grid) that `n` runs per side detect against `other` with
    at least `power` at `alpha`; nan when even a rate of 1 is not detectable."""
    for i in range(1, round(1 / step) + 1):
        if fisher_power(n, n, i * step, other, alpha) >= power:
            return round(i * step, 10)
    return float("nan")
