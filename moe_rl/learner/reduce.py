"""Per-micro-batch metrics of a pass combined on the last pipeline stage, then across
data-parallel ranks, each by the reduction its name asks for (`moe_rl.runtime.metrics.reduction`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_rl.learner.parallel import Layout, all_reduce_
from moe_rl.runtime.metrics import reduction


def _on_host(store: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items' loss, weight and metrics as float64 host tensors, in one copy from the
    device (one wait for a GPU per pass, not one per number)."""
    parts = [t for item in store for t in (item["loss"], *item["metrics"].values())]
    parts += [item["weight"] for item in store if isinstance(item["weight"], torch.Tensor)]
    flat: Iterator[torch.Tensor] = iter(torch.stack([t.reshape(()).double() for t in parts]).cpu() if parts else [])
    out = [{"loss": next(flat), "metrics": {k: next(flat) for k in item["metrics"]}} for item in store]
    for item, host in zip(store, out):
        w = item["weight"]
        host["weight"] = next(flat) if isinstance(w, torch.Tensor) else torch.tensor(float(w), dtype=torch.float64)
    return out


def reduce_metrics(store: list[dict[str, Any]], layout: Layout) -> dict[str, float]:
    """`loss` summed; mean-type metrics weighted by each micro-batch's `weight`; `_max` /
    `_min` ones by max / min. Collective over the data-parallel group (one all-reduce per
    kind), so every rank of the last stage returns the same numbers."""
    store = _on_host(store)
    names = sorted({k for item in store for k in item["metrics"]})
    by_kind = {kind: [n for n in names if reduction(n) == kind] for kind in ("mean", "max", "min")}
    loss = torch.stack([item["loss"].double() for item in store]).sum().reshape(1)
    sums, weights = [], []
    for n in by_kind["mean"]:
        vals = [(item["metrics"][n].double(), item["weight"]) for item in store if n in item["metrics"]]
        sums.append(sum(v * w for v, w in vals))
        weights.append(sum(w for _, w in vals))
    values = {n: torch.stack([item["metrics"][n].double() for item in store if n in item["metrics"]])
              for n in by_kind["max"] + by_kind["min"]}
    extreme = {"max": [values[n].max() for n in by_kind["max"]], "min": [values[n].min() for n in by_kind["min"]]}
    packed_sum = torch.cat([loss, torch.stack(sums) if sums else loss.new_zeros(0),
                            torch.stack(weights) if weights else loss.new_zeros(0)])
    packed = {kind: torch.stack(v) if v else loss.new_zeros(0) for kind, v in extreme.items()}
    if layout.dp > 1:
        group = ps.get_data_parallel_group()
        all_reduce_(packed_sum, group=group)
        for kind, op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
            if by_kind[kind]:
                all_reduce_(packed[kind], op=op, group=group)
    out = {"loss": float(packed_sum[0])}
    n_mean = len(sums)
    for i, n in enumerate(by_kind["mean"]):
        w = float(packed_sum[1 + n_mean + i])
        out[n] = float(packed_sum[1 + i]) / w if w > 0 else 0.0
    for kind in ("max", "min"):
        out.update(zip(by_kind[kind], packed[kind].tolist()))
    return out


def reduce_sums(store: list[dict[str, Any]], layout: Layout) -> dict[str, float]:
    """The micro-batches' additive tallies (`MicroBatchLoss.sums`) summed over the pass and
    the data-parallel ranks (one all-reduce); {} when the loss reports none."""
    names = sorted({k for item in store for k in item.get("sums") or {}})
    if not names:
        return {}
    totals = torch.stack([sum((item["sums"][n].double().reshape(()).cpu() for item in store
                               if n in (item.get("sums") or {})), torch.zeros((), dtype=torch.float64))
                          for n in names])
    if layout.dp > 1:
        all_reduce_(totals, group=ps.get_data_parallel_group())
    return dict(zip(names, totals.tolist()))
