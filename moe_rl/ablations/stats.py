"""Per-run summaries and what holds across seeds: means with 95% intervals, collapses,
and which differences between settings exceed the seed spread.

A run's metrics come from its metrics.jsonl (one row per step). Across seeds, a metric's
interval is the Student-t 95% interval of the mean (n - 1 degrees of freedom; none for one
seed). Two settings differ when Welch's t-test on their per-seed values rejects equal means
at 5%; with many pairs some such rejections are chance, so the report also says which
survive Holm's correction for the number of pairs compared.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from scipy import stats as sps

SMOOTH = 5
"""Steps in the moving average used to find a run's peak reward."""
FINAL = 10
"""Final reward: the mean of the last FINAL steps."""


def _finite(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if key in r and r[key] is not None and math.isfinite(r[key])]


def mean_or_nan(xs: Sequence[float]) -> float:
    """The mean, nan for no values (an outcome of a run that logged none)."""
    return statistics.fmean(xs) if xs else float("nan")


def smoothed(xs: Sequence[float], width: int = SMOOTH) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    return [statistics.fmean(xs[max(0, i - width + 1): i + 1]) for i in range(len(xs))]


def collapsed(rewards: Sequence[float]) -> bool:
    """The run ends below half of its peak: final reward < 0.5 x max of the smoothed curve.
    A run that never rose above 0 has no peak to fall from (not a collapse)."""
    if not rewards:
        return False
    peak = max(smoothed(rewards))
    return peak > 0 and mean_or_nan(rewards[-FINAL:]) < 0.5 * peak


def summarize_run(rows: list[dict[str, Any]]) -> dict[str, float]:
    """One run's numbers for the report (means over steps unless named otherwise)."""
    rewards = _finite(rows, "reward/mean")
    layers = sorted({k for r in rows for k in r if k.startswith("routing/sampler_disagree_layer")})
    per_layer = [mean_or_nan(_finite(rows, k)) for k in layers]
    return {
        "steps": float(len(rows)),
        "final_reward": mean_or_nan(rewards[-FINAL:]),
        "reward_auc": mean_or_nan(rewards),
        "peak_reward": max(smoothed(rewards)) if rewards else float("nan"),
        "collapsed": float(collapsed(rewards)),
        "clip_frac": mean_or_nan(_finite(rows, "policy/clip_frac")),
        "token_ratio_std": mean_or_nan(_finite(rows, "policy/token_ratio_std")),
        "gamma_mean": mean_or_nan(_finite(rows, "routing/gamma_mean")),
        "gamma_p05": mean_or_nan(_finite(rows, "routing/gamma_p05")),
        "gamma_min": min(_finite(rows, "routing/gamma_min"), default=float("nan")),
        "flip_rate": mean_or_nan(_finite(rows, "routing/flip_rate_mean")),
        "flip_rate_max_layer": max((mean_or_nan(_finite(rows, k)) for k in
                                    sorted({k for r in rows for k in r if k.startswith("routing/flip_rate_layer")})),
                                   default=float("nan")),
        "sampler_learner_k3": mean_or_nan(_finite(rows, "mismatch/k3")),
        "sampler_disagree_any": mean_or_nan(_finite(rows, "routing/sampler_disagree_any")),
        "sampler_disagree_max_layer": max(per_layer, default=float("nan")),
        "sampler_disagree_worst_step": max((max(r[k] for k in layers if k in r) for r in rows
                                            if any(k in r for k in layers)), default=float("nan")),
        "sampler_used_disagree_any": mean_or_nan(_finite(rows, "routing/sampler_used_disagree_any")),
        "seconds_per_step": mean_or_nan(_finite(rows, "time/step")),
    }


def interval(values: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """Mean and the Student-t interval of the mean over seeds (lo = hi = nan for one seed)."""
    xs = [v for v in values if math.isfinite(v)]
    n = len(xs)
    mean = mean_or_nan(xs)
    if n < 2:
        return {"mean": mean, "lo": float("nan"), "hi": float("nan"), "n": float(n)}
    half = sps.t.ppf(0.5 + level / 2, n - 1) * statistics.stdev(xs) / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": float(n)}


def welch(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of Welch's t-test for equal means (nan below 2 seeds each; 0 or 1
    when both sides have no spread and differ or not)."""
    a, b = [x for x in a if math.isfinite(x)], [x for x in b if math.isfinite(x)]
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    if statistics.pvariance(a) == 0 and statistics.pvariance(b) == 0:
        return 0.0 if mean_or_nan(a) != mean_or_nan(b) else 1.0
    return float(sps.ttest_ind(a, b, equal_var=False).pvalue)


def holm(pvalues: dict[Any, float], alpha: float = 0.05) -> set[Any]:
    """Keys whose hypotheses Holm's step-down procedure rejects at family-wise `alpha`."""
    ranked = sorted((p, k) for k, p in pvalues.items() if math.isfinite(p))
    rejected, m = set(), len(ranked)
    for i, (p, k) in enumerate(ranked):
        if p > alpha / (m - i):
            break
        rejected.add(k)
    return rejected


def holm_adjusted(pvalues: dict[Any, float]) -> dict[Any, float]:
    """Holm's adjusted p-values: p_(i) x (m - i + 1), made monotone over the ranks and capped at
    1 (a key is rejected at family-wise alpha exactly when its adjusted p <= alpha). nan stays nan
    and does not count towards m."""
    ranked = sorted((p, k) for k, p in pvalues.items() if math.isfinite(p))
    out: dict[Any, float] = {k: float("nan") for k, p in pvalues.items() if not math.isfinite(p)}
    running, m = 0.0, len(ranked)
    for i, (p, k) in enumerate(ranked):
        running = max(running, min(1.0, (m - i) * p))
        out[k] = running
    return out


def welch_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Welch's interval for mean(a) - mean(b) (Welch-Satterthwaite degrees of freedom); nan
    below 2 values a side, a point when neither side has spread."""
    a, b = [x for x in a if math.isfinite(x)], [x for x in b if math.isfinite(x)]
    if len(a) < 2 or len(b) < 2:
        return float("nan"), float("nan")
    d = mean_or_nan(a) - mean_or_nan(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return d, d
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = sps.t.ppf(0.5 + level / 2, df) * math.sqrt(va + vb)
    return d - half, d + half


def compare(per_seed: dict[str, list[float]], alpha: float = 0.05) -> list[dict[str, Any]]:
    """Every pair of settings: difference of means, Welch p, and whether it is significant
    alone and after Holm's correction over all pairs. Sorted by p."""
    names = list(per_seed)
    pairs = {(a, b): welch(per_seed[a], per_seed[b]) for i, a in enumerate(names) for b in names[i + 1:]}
    survive = holm(pairs, alpha)
    out = [{"a": a, "b": b, "diff": mean_or_nan(per_seed[a]) - mean_or_nan(per_seed[b]), "p": p,
            "significant": math.isfinite(p) and p < alpha, "holm": (a, b) in survive}
           for (a, b), p in pairs.items()]
    return sorted(out, key=lambda d: (not math.isfinite(d["p"]), d["p"]))


def stratified_difference(a: Sequence[tuple[float, str]], b: Sequence[tuple[float, str]],
                          level: float = 0.95) -> dict[str, float]:
    """mean(a) - mean(b) with a fixed effect per stratum (a warm start, say): the least-squares
    fit of y = d * [in a] + c_stratum, residual variance pooled over every run (df = n - 1 -
    strata), so a shift of one stratum's runs moves no estimate even when the strata hold the
    arms in different proportions. Values are (y, stratum); non-finite ys are left out.
    {"diff", "lo", "hi", "p", "df"}: nan when no stratum holds both arms or df < 1; p is 0 or 1
    when the fit leaves no residual and d differs from 0 or not."""
    import numpy as np

    rows = [(y, s, 1.0) for y, s in a if math.isfinite(y)] + [(y, s, 0.0) for y, s in b if math.isfinite(y)]
    strata = sorted({s for _, s, _ in rows})
    both = {s for s in strata if {arm for _, t, arm in rows if t == s} == {0.0, 1.0}}
    df = len(rows) - 1 - len(strata)
    nan = {"diff": math.nan, "lo": math.nan, "hi": math.nan, "p": math.nan, "df": float(df)}
    if not both or df < 1:
        return nan
    x = np.array([[arm] + [float(s == t) for t in strata] for _, s, arm in rows])
    y = np.array([v for v, _, _ in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    scale = max(1.0, float(np.max(np.abs(y))))
    d = float(coef[0]) if abs(coef[0]) > 1e-12 * scale else 0.0  # lstsq's round-off is no difference
    rss = float(np.sum((y - x @ coef) ** 2))
    if rss <= 1e-24 * scale**2 * len(y):
        return {"diff": d, "lo": d, "hi": d, "p": 0.0 if d else 1.0, "df": float(df)}
    se = math.sqrt(rss / df * float(np.linalg.inv(x.T @ x)[0, 0]))
    half = float(sps.t.ppf(0.5 + level / 2, df)) * se
    return {"diff": d, "lo": d - half, "hi": d + half, "p": float(2 * sps.t.sf(abs(d) / se, df)), "df": float(df)}
