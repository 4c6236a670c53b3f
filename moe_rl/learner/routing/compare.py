"""The routing a learner pass used, compared with the sampler's (R3's check and the
`routing/sampler_*disagree*` metrics): collective over data-parallel ranks and stages."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_rl.learner.parallel import Layout, all_reduce_, comm_device
from moe_rl.routing.record import ReplayIds, RoutingRecord, row_positions
from moe_rl.routing.stats import topk_set_changed


def sampler_disagreement(
    record: RoutingRecord, sampler: ReplayIds, scored_RS: torch.Tensor, layout: Layout
) -> dict[str, float]:
    """Per-layer fraction of scored positions where the sampler's top-k set differs from
    the learner's own routing (the router's choice, even under replay), the fraction
    differing in at least one layer, and that fraction for the routing the pass used
    (`sampler_used_disagree_any`: exactly 0 under R3). `scored_RS` marks the positions to count, per row of
    the record. Collective: sums over data-parallel ranks, layers gathered over stages."""
    pos = row_positions(sampler.rows, record.rows)
    S = record.ids_RSLK.shape[1]
    theirs = sampler.ids_RSLK[pos][:, :S]
    valid = scored_RS[:, :S] & (sampler.valid_RS[pos][:, :S] if sampler.valid_RS is not None else True)
    diff_RSL = topk_set_changed(
        record.own_ids_RSLK.reshape(-1, *record.ids_RSLK.shape[2:]), theirs.reshape(-1, *theirs.shape[2:])
    ).reshape(*record.ids_RSLK.shape[:3])
    any_RS = _any_stage(diff_RSL.any(-1), layout)
    # The routing the pass *used* against the sampler's: 0 under R3 replay (the check that
    # replay took effect), the same as the router's own choice without replay.
    used_RSL = topk_set_changed(
        record.ids_RSLK.reshape(-1, *record.ids_RSLK.shape[2:]), theirs.reshape(-1, *theirs.shape[2:])
    ).reshape(*record.ids_RSLK.shape[:3])
    used_any_RS = _any_stage(used_RSL.any(-1), layout)
    w = valid.double()
    sums = torch.cat([(diff_RSL.double() * w[..., None]).sum((0, 1)), (used_any_RS.double() * w).sum()[None],
                      (any_RS.double() * w).sum()[None], w.sum()[None]])
    if layout.dp > 1:
        all_reduce_(sums, group=ps.get_data_parallel_group())
    n = float(sums[-1].clamp(min=1))
    per_layer = {f"routing/sampler_disagree_layer{layer}": float(sums[i]) / n for i, layer in enumerate(record.layers)}
    if layout.pp > 1:
        parts: list[Any] = [None] * layout.pp
        dist.all_gather_object(parts, per_layer, group=ps.get_pipeline_model_parallel_group())
        per_layer = {k: v for p in parts for k, v in p.items()}
    per_layer["routing/sampler_disagree_any"] = float(sums[-2]) / n
    per_layer["routing/sampler_used_disagree_any"] = float(sums[-3]) / n
    return per_layer


def _any_stage(any_RS: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A token differs "in at least one layer" if any pipeline stage's layers differ for it;
    the stages of one pipeline hold the same rows, so OR their [R, S] maps."""
    if layout.pp == 1:
        return any_RS
    mine = any_RS.to(torch.uint8).to(comm_device()).contiguous()  # gloo has no bool collectives
    maps = [torch.zeros_like(mine) for _ in range(layout.pp)]
    dist.all_gather(maps, mine, group=ps.get_pipeline_model_parallel_group())
    return torch.stack(maps).bool().any(0).cpu()
