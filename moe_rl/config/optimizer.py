"""The `optimizer` section type: megatron's distributed Adam(W) and its schedule. One type
serves every trained model: the actor's is `optimizer`, PPO's critic's `critic.optimizer`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moe_rl.config.errors import ConfigError, require_all


@dataclass(frozen=True)
class OptimizerConfig:
    """Megatron's distributed Adam(W)."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the learning-rate schedule."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps (optimizer steps, not RL steps)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, over the run's total optimizer steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    distributed: bool = False
    """megatron's distributed optimizer: Adam states and fp32 main weights sharded over
    data-parallel ranks (dense parameters over DP, experts over expert DP). Needs CUDA."""
    offload_fraction: float = 0.0
    """Fraction of the distributed optimizer's states kept in host memory (megatron's
    optimizer_cpu_offload); needs optimizer.distributed."""
    offload_during_rollout: bool = False
    """Colocated, synchronous runs: move the learner's gradient buffers and optimizer states
    to (pinned) host memory while the engines sample and back before the update, so the
    engines' KV cache can use that device memory (`moe_rl/learner/offload.py`)."""


    def validate(self, key: str = "optimizer") -> None:
        """The section's values, errors naming `<key>.<field>` (the actor's `optimizer` and
        PPO's `critic.optimizer` are this one type)."""
        o = self
        require_all({
            f"{key}.weight_decay": (o.weight_decay >= 0, f">= 0, got {o.weight_decay}"),
            f"{key}.adam_beta1": (0 <= o.adam_beta1 < 1, f"in [0, 1), got {o.adam_beta1}"),
            f"{key}.adam_beta2": (0 <= o.adam_beta2 < 1, f"in [0, 1), got {o.adam_beta2}"),
            f"{key}.adam_eps": (o.adam_eps > 0, f"> 0, got {o.adam_eps}"),
            f"{key}.clip_grad": (o.clip_grad >= 0, f">= 0 (0 disables clipping), got {o.clip_grad}"),
            f"{key}.lr_warmup_steps": (o.lr_warmup_steps >= 0, f">= 0, got {o.lr_warmup_steps}"),
            f"{key}.offload_fraction": (0 <= o.offload_fraction <= 1, f"in [0, 1], got {o.offload_fraction}"),
            f"{key}.lr": (o.lr > 0, f"> 0, got {o.lr}"),
            f"{key}.min_lr": (o.min_lr >= 0, f">= 0, got {o.min_lr}"),
        })
        if o.min_lr > o.lr:
            raise ConfigError(f"{key}.min_lr={o.min_lr:g} is above {key}.lr={o.lr:g} (the schedule decays from lr "
                              f"to min_lr): lower {key}.min_lr with it, e.g. {key}.min_lr={o.lr / 10:g}, or 0")
        if o.offload_fraction and not o.distributed:
            raise ConfigError(f"{key}.offload_fraction needs {key}.distributed=true (megatron offloads "
                              "the distributed optimizer's shards)")
