"""The one rule of metric names: how a metric combines across micro-batches, mini-batches
and ranks is read off its name.

    `*_max` -> max, `*_min` -> min, anything else -> a (weighted) mean.

Objectives, the learner's reductions over micro-batches and data-parallel ranks, and the
trainer's combination of several updates all follow it through `reduction`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

Reduction = Literal["max", "min", "mean"]


def reduction(name: str) -> Reduction:
    """How the metric `name` combines."""
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "mean"


def combine(items: Sequence[Mapping[str, float]], weights: Sequence[float] | None = None) -> dict[str, float]:
    """Combine plain-number metric dicts by `reduction`; a metric missing from some items is
    combined over the items that have it (weights renormalised over those)."""
    w_all = list(weights) if weights is not None else [1.0] * len(items)
    out: dict[str, float] = {}
    for k in sorted({k for m in items for k in m}):
        pairs = [(m[k], w) for m, w in zip(items, w_all) if k in m]
        kind = reduction(k)
        if kind == "max":
            out[k] = max(v for v, _ in pairs)
        elif kind == "min":
            out[k] = min(v for v, _ in pairs)
        else:
            total = sum(w for _, w in pairs)
            out[k] = sum(v * w for v, w in pairs) / total if total > 0 else 0.0
    return out
