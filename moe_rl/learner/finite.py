"""Non-finite numbers in an update or a checkpoint: found on one rank, agreed on all.

    if not update_is_finite(ddp_model, loss):   # collective over the learner's ranks
        skip the optimizer step                  # counted in learner/update_skipped
    bad = nonfinite_parameter(gpt)              # collective: "decoder.layers.0...weight" or None

An update whose loss or gradient holds a NaN or an infinity would write it into every
weight it touches (Adam's moments keep it for good), so it is skipped instead of applied.
megatron's own check (`check_for_nan_in_grad`) ends the process with a traceback, and only
for NaN before the data-parallel reduction; this one runs after the reduction, on the whole
gradient buffers, and lets the caller decide. Each rank sees only its shard (tensor,
pipeline, expert parallel; the distributed optimizer's reduce-scatter), so the verdict is
a MAX over the data-parallel and the model-parallel groups: every learner rank skips the
same update, or none does.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_rl.learner.parallel import all_reduce_


def _any_rank(bad: bool) -> bool:
    """True on every learner rank when `bad` holds on any of them."""
    flag = torch.tensor([float(bad)])
    if dist.is_initialized() and ps.model_parallel_is_initialized():
        for group in (ps.get_data_parallel_group(with_context_parallel=True), ps.get_model_parallel_group()):
            if dist.get_world_size(group) > 1:
                all_reduce_(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


def _grad_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The contiguous gradient buffers of megatron's DDP (dense and expert ones), else each
    parameter's gradient."""
    buffers = getattr(model, "buffers", None)
    if isinstance(buffers, list):
        return [b.grad_data for b in buffers + list(getattr(model, "expert_parallel_buffers", []))]
    return [p.grad for p in model.parameters() if p.grad is not None]


def update_is_finite(model: torch.nn.Module, loss: float) -> bool:
    """Collective over the learner's ranks: the reduced loss and every gradient are finite.
    The max-abs norm (inf-norm) of a buffer is NaN or inf exactly when an element is, and
    cannot overflow as a 2-norm of large finite values would."""
    grads = _grad_buffers(model)
    local_bad = not math.isfinite(loss)
    if grads and not local_bad:
        norms = torch._foreach_norm(grads, float("inf"))
        local_bad = not bool(torch.isfinite(torch.stack(norms)).all())
    return not _any_rank(local_bad)


def nonfinite_parameter(model: torch.nn.Module) -> str | None:
    """Collective: the name of a parameter holding a NaN or inf on some rank (this rank's own
    first one when it has one, else another rank's marker), None when every weight is finite."""
    mine = next((name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if not _any_rank(mine is not None):
        return None
    return mine or "a parameter on another rank"
