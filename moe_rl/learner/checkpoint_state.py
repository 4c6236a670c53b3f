"""What a learner checkpoint holds: the sharded state of the actor (weights, optimizer, each
rank's RNG states) and of the components saved beside it (PPO's critic), addressed so that
megatron-core's `dist_checkpointing` can load it at any other TP/EP/PP layout, and the
layout tag that says where it was saved. `checkpoint` saves and loads it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

if TYPE_CHECKING:
    from moe_rl.learner.engine import Learner

RESERVED_NAMES = frozenset({"model", "optimizer", "rng_state"})
"""The actor's own parts of a checkpoint: no component may take these names."""


def has_optimizer_state(learner: Learner) -> bool:
    """Adam's moments exist only after the first step; before it there is nothing to save."""
    if learner.optimizer is None:
        return False
    parts = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
    return any(len(p.optimizer.state) > 0 for p in parts)


def layout_tag(learner: Learner) -> dict[str, int]:
    lay = learner.layout
    return {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "etp": lay.etp, "dp": lay.dp}


def _rng_object(learner: Learner) -> ShardedObject:
    """This rank's RNG states, addressed by (pp, tp, dp) rank so each rank gets its own."""
    lay = learner.layout
    state = {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject(
        "rng_state",
        state,
        (lay.pp, lay.tp, lay.dp),
        (lay.pp_rank, lay.tp_rank, lay.dp_rank),
        replica_id=0,
    )


def sharded_state(learner: Learner, *, with_optimizer: bool, with_rng: bool, loading: bool,
                   components: Mapping[str, Any] | None = None, optimizers: frozenset[str] = frozenset()) -> dict:
    model_sd = learner.gpt.sharded_state_dict()
    sd: dict[str, Any] = {"model": model_sd}
    if with_optimizer and learner.optimizer is not None:
        sd["optimizer"] = learner.optimizer.sharded_state_dict(model_sd, is_loading=loading)
    if with_rng:
        sd["rng_state"] = _rng_object(learner)
    for name, model in (components or {}).items():  # (`<name>.` keys of its own: the converters skip them)
        if name in RESERVED_NAMES:
            raise ValueError(f"a checkpoint component may not be named {name!r} (the actor's own part)")
        part_sd = model.gpt.sharded_state_dict(prefix=f"{name}.")
        sd[name] = part_sd
        if name in optimizers:
            sd[f"{name}_optimizer"] = model.optimizer.sharded_state_dict(part_sd, is_loading=loading)
    return sd


def component_meta(model: Any, with_optimizer: bool) -> dict[str, Any]:
    return {"step": model.step, "has_optimizer": with_optimizer,
            "scheduler": model.scheduler.state_dict() if with_optimizer else None}
