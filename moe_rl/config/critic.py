"""The `critic` section: PPO's learned value function (read when `rl.advantage: gae`).

The critic is the actor's architecture at the actor's parallel layout with a scalar value
head in place of the output layer (`moe_rl.learner.critic`). Its optimizer is a section of
the actor's type, `critic.optimizer` (its own Adam, learning rate and schedule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_rl.config.errors import require_all
from moe_rl.config.optimizer import OptimizerConfig


def _critic_optimizer() -> OptimizerConfig:
    return OptimizerConfig(lr=1e-5)


@dataclass(frozen=True)
class CriticConfig:
    """PPO's value model: its optimizer, warm-up, starting weights and value clip."""

    optimizer: OptimizerConfig = field(default_factory=_critic_optimizer)
    """The critic's own Adam and schedule, the actor's section type (lr 1e-5 by default:
    critic.optimizer.lr; its warm-up critic.optimizer.lr_warmup_steps counts critic updates)."""
    warmup_steps: int = 0
    """Critic warm-up: the first N RL steps train the critic only (the actor is not
    updated, so its rollouts stay on-policy while the values catch up). N = run.steps is
    value pretraining: a run of the critic alone, whose checkpoints start another run's
    critic (critic.init_checkpoint)."""
    init_checkpoint: str = ""
    """The critic's starting weights; empty: the actor's starting checkpoint
    (run.init_checkpoint). A PPO run's checkpoint (a value-pretraining run's) gives the
    critic saved in it, value head included. Any other (a policy, a reward model's from
    `python -m moe_rl.reward_model`, a Hugging Face directory) gives its transformer, with
    the value head at zero, so the first values are 0 and the first advantages the returns."""
    value_clip: float = 0.2
    """c of the clipped value loss 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)."""
    epochs: int = 1
    """Passes of the critic over each step's batch, each in critic.num_minibatches reshuffled
    mini-batches (verl's critic ppo_epochs): a value function fits more slowly than the
    policy moves. The actor makes rl.epochs passes."""
    num_minibatches: int = 0
    """Mini-batches per critic pass (verl's critic ppo_mini_batch_size, as a count); 0: the
    actor's rl.num_minibatches. Smaller mini-batches give the critic more, noisier updates on
    the same rollouts."""
    value_loss_coef: float = 1.0
    """Scale of the value loss (the critic has its own optimizer, so this scales its
    gradient before Adam normalises it: it matters with gradient clipping)."""


    def validate(self) -> None:
        """The section's own ranges and its optimizer (`critic.optimizer`); what it means for
        the RL section and the run's length is the cross-section rules'."""
        c = self
        require_all({
            "critic.value_clip": (c.value_clip > 0, f"> 0, got {c.value_clip}"),
            "critic.value_loss_coef": (c.value_loss_coef > 0, f"> 0, got {c.value_loss_coef}"),
            "critic.epochs": (c.epochs >= 1, f">= 1, got {c.epochs}"),
            "critic.num_minibatches": (c.num_minibatches >= 0,
                                       f">= 0 (0: rl.num_minibatches), got {c.num_minibatches}"),
            "critic.warmup_steps": (c.warmup_steps >= 0, f">= 0, got {c.warmup_steps}"),
        })
        c.optimizer.validate("critic.optimizer")


def critic_warmup_steps(critic: CriticConfig, uses_critic: bool) -> int:
    """The run's first steps that train the critic alone, the actor waiting (0 without one:
    `uses_critic` is rl.uses_critic)."""
    return critic.warmup_steps if uses_critic else 0
