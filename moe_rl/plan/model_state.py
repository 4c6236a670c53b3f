"""Bytes of a model's parameters, gradients and optimizer states on one rank, from
megatron's own buffers (`moe_rl.learner.meta`).

Parameters as built, the DDP gradient buffers (fp32: the learner reduces gradients in fp32),
and the optimizer: Adam's two fp32 moments per parameter element plus an fp32 main copy of
every non-fp32 (bf16) parameter (megatron's Float16Optimizer / DistributedOptimizer; an fp32
model is its own main copy). Under the distributed optimizer each rank keeps only its
data-parallel shard of those (dense weights over the DP group, experts over the expert-DP
group), and parameters and gradients sit in megatron's padded buffers. Frozen parameters
(LoRA's base weights, `model.freeze`) are counted as parameters only: megatron gives them no
gradient buffer and no optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the meta-device build imports megatron; this module needs only its type
    from moe_rl.learner.meta import MetaRank

ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MAIN_BYTES = 4  # fp32 main copy of a bf16 parameter


@dataclass(frozen=True)
class ModelState:
    params: int
    grads: int
    optimizer: int
    """Optimizer bytes before any offload."""


def optimizer_bytes_per_element(param_bytes: int) -> int:
    """Adam's moments, and the fp32 main copy unless the parameter is fp32 already."""
    return ADAM_BYTES + (MAIN_BYTES if param_bytes != 4 else 0)


def model_state(rank: MetaRank, distributed: bool) -> ModelState:
    """Bytes of parameters, gradients and optimizer states on `rank` (exact from megatron's
    buffers; the meta build lays them out for the distributed optimizer, and without it
    megatron's buffers are unpadded, so both variants are exact)."""
    if distributed:
        return ModelState(
            params=sum(b.param_buffer_bytes for b in rank.buffers) + rank.frozen_param_bytes,
            grads=sum(b.grad_bytes for b in rank.buffers),
            optimizer=sum(MAIN_BYTES * b.shard_low_precision_numel + ADAM_BYTES * b.shard_numel
                          for b in rank.buffers),
        )
    return ModelState(
        params=rank.param_bytes,
        grads=sum(b.params_numel * b.grad_elem_bytes for b in rank.buffers),
        optimizer=sum(MAIN_BYTES * b.low_precision_numel + ADAM_BYTES * b.params_numel for b in rank.buffers),
    )
