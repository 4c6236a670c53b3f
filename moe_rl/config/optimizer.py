"""The `optimizer` section type: megatron's distributed Adam(W) and its schedule. One type
serves every trained model: the actor's is `optimizer`, PPO's critic's `critic.optimizer`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
