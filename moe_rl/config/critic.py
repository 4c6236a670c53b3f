"""The `critic` section: PPO's learned value function (read when `rl.advantage: gae`).

The critic is the actor's architecture at the actor's parallel layout with a scalar value
head in place of the output layer (`moe_rl.learner.critic`). Its optimizer is a section of
the actor's type, `critic.optimizer` (its own Adam, learning rate and schedule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_rl.config.errors import ConfigError
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


def critic_minibatches(cfg: Any) -> int:
    """Mini-batches per critic pass: critic.num_minibatches, or the actor's rl.num_minibatches."""
    return cfg.critic.num_minibatches or cfg.rl.num_minibatches


def critic_warmup_steps(cfg: Any) -> int:
    """The run's first steps that train the critic alone, the actor waiting (0 without one)."""
    return cfg.critic.warmup_steps if cfg.rl.uses_critic else 0


def validate_critic(cfg: Any) -> None:
    """The critic section's ranges, and the PPO settings of the rl section (`Any`: sections.py
    imports this module, so it cannot import `Config`)."""
    c, rl = cfg.critic, cfg.rl
    if c.value_clip <= 0:
        raise ConfigError(f"critic.value_clip must be > 0, got {c.value_clip}")
    if c.value_loss_coef <= 0:
        raise ConfigError(f"critic.value_loss_coef must be > 0, got {c.value_loss_coef}")
    if c.epochs < 1:
        raise ConfigError(f"critic.epochs must be >= 1, got {c.epochs}")
    if c.num_minibatches < 0:
        raise ConfigError(f"critic.num_minibatches must be >= 0 (0: rl.num_minibatches), got {c.num_minibatches}")
    if c.warmup_steps < 0:
        raise ConfigError(f"critic.warmup_steps must be >= 0, got {c.warmup_steps}")
    if not 0 <= rl.gae_gamma <= 1 or not 0 <= rl.gae_lambda <= 1:
        raise ConfigError(f"rl.gae_gamma and rl.gae_lambda must be in [0, 1], got {rl.gae_gamma} and {rl.gae_lambda}")
    if rl.kl_target < 0 or rl.kl_horizon < 1:
        raise ConfigError(f"rl.kl_target must be >= 0 and rl.kl_horizon >= 1, got {rl.kl_target} and {rl.kl_horizon}")
    if rl.kl_target > 0 and not rl.kl_in_reward:
        raise ConfigError("rl.kl_target adapts the weight of the KL in GAE's per-token reward: it needs "
                          "rl.kl_in_reward=true (the KL penalty in the loss keeps rl.kl_coef)")
    if not rl.uses_critic:
        if rl.kl_in_reward:
            raise ConfigError("rl.kl_in_reward puts the KL penalty in GAE's per-token reward: it needs "
                              "rl.advantage=gae (with group advantages the penalty goes in the loss: rl.kl_coef)")
        return
    if rl.kl_in_reward and rl.kl_coef <= 0:
        raise ConfigError("rl.kl_in_reward=true needs rl.kl_coef > 0 (the weight of the per-token k1 in the reward)")
    if rl.dynamic_sampling:
        raise ConfigError("rl.dynamic_sampling drops groups with equal rewards, a GRPO-family fix for zero group "
                          "advantages; with rl.advantage=gae every row has a signal: set rl.dynamic_sampling=false")
    if c.warmup_steps > cfg.run.steps:
        raise ConfigError(f"critic.warmup_steps={c.warmup_steps} is more than run.steps={cfg.run.steps} (equal: "
                          "a value-pretraining run, the critic alone on the starting policy's rollouts)")
