"""Group advantage estimators, DAPO's dynamic-sampling filter and overlong reward shaping.

    adv_NG = compute_advantages("grpo", rewards_NG)        # [n_groups, G] -> [n_groups, G]
    keep_N = filter_groups(rewards_NG)                      # groups with any reward spread
    rewards_NG = rewards_NG + overlong_penalty(lengths_NG, max_len=4096, cache_len=512)

Rows are prompts (groups), columns the G responses to each. Formulas: docs/objectives.md
"Advantages". A group whose rewards are all exactly equal carries no signal: every
estimator gives it exact zeros (never NaN or inf), and `filter_groups` drops exactly
those groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moe_rl.config.advantage_kinds import register_advantage_kind
from moe_rl.runtime.registry import Registry, build_hparams


@dataclass(frozen=True)
class AdvantageSpec:
    """A registry entry of ADVANTAGES."""

    name: str
    """Registry name (what RLConfig.advantage holds)."""
    fn: Callable[[Tensor, Any], Tensor] | None
    """rewards [n_groups, G] (float, validated) and hparams -> advantages [n_groups, G];
    None for an estimator that needs a critic (its advantages are computed on the learner)."""
    hparams: type
    """Frozen dataclass type of its hyperparameters (defaults + attribute docstrings)."""
    min_group_size: int
    """Smallest G the estimator is defined for."""
    needs_critic: bool = False
    """Per-token advantages from a learned value model, once the step is scored (PPO's GAE,
    `moe_rl.programs.ppo.critic_stage`): the rollout leaves every row's advantage at 0."""


ADVANTAGES: Registry[AdvantageSpec] = Registry("advantage estimator")


def _register(name: str, hparams: type, min_group_size: int = 1) -> Callable:
    def deco(fn: Callable[[Tensor, Any], Tensor]) -> Callable[[Tensor, Any], Tensor]:
        ADVANTAGES.register(name, AdvantageSpec(name, fn, hparams, min_group_size))
        register_advantage_kind(name)
        return fn

    return deco


def group_estimators() -> list[str]:
    """The estimators computed from a step's group rewards (every one without a critic)."""
    return [name for name, spec in ADVANTAGES.items() if not spec.needs_critic]


@dataclass(frozen=True)
class NoHParams:
    """This estimator has no hyperparameters."""


def _all_equal(rewards_NG: Tensor) -> Tensor:
    """[n_groups] True where every reward of the group equals its first (always for G = 1)."""
    return (rewards_NG == rewards_NG[:, :1]).all(dim=1)


def _centered(rewards_NG: Tensor) -> Tensor:
    """r - mean_g r, exactly 0 on all-equal groups (the mean of equal floats can be 1 ulp off)."""
    centered = rewards_NG - rewards_NG.mean(dim=1, keepdim=True)
    return torch.where(_all_equal(rewards_NG).unsqueeze(1), 0.0, centered)


def _std(x: Tensor, unbiased: bool, dim: int | None = None) -> Tensor:
    """Standard deviation that is 0 (not NaN) where the unbiased form has a single sample."""
    n = x.numel() if dim is None else x.shape[dim]
    if unbiased and n < 2:
        return torch.zeros_like(x.sum() if dim is None else x.sum(dim=dim, keepdim=True))
    if dim is None:
        return x.std(correction=int(unbiased))
    return x.std(dim=dim, keepdim=True, correction=int(unbiased))


@dataclass(frozen=True)
class StdNormHParams:
    """Scale normalisation by a reward standard deviation."""

    eps: float = 1e-6
    """Added to the std in the denominator."""
    unbiased: bool = True
    """Unbiased (1/(n-1), torch's default, docs/objectives.md) or population (1/n) std."""

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


@_register("grpo", StdNormHParams)
def grpo(rewards_NG: Tensor, hp: StdNormHParams) -> Tensor:
    """GRPO (Shao et al. 2024): (r - mean_g r) / (std_g r + eps), std over the group."""
    return _centered(rewards_NG) / (_std(rewards_NG, hp.unbiased, dim=1) + hp.eps)


@_register("dr_grpo", NoHParams)
def dr_grpo(rewards_NG: Tensor, hp: NoHParams) -> Tensor:
    """Dr. GRPO (Liu et al. 2025): r - mean_g r; no /std, which overweights groups whose
    rewards barely vary (too easy or too hard prompts)."""
    return _centered(rewards_NG)


@_register("rloo", NoHParams, min_group_size=2)
def rloo(rewards_NG: Tensor, hp: NoHParams) -> Tensor:
    """RLOO: r_i - (sum_{j != i} r_j) / (G - 1), the leave-one-out baseline (unbiased: a
    response is never its own baseline). Equals G/(G-1) (r_i - mean_g r). Needs G >= 2."""
    G = rewards_NG.shape[1]
    return _centered(rewards_NG) * (G / (G - 1))


@_register("batch_std", StdNormHParams)
def batch_std(rewards_NG: Tensor, hp: StdNormHParams) -> Tensor:
    """Group mean, batch std (Lite PPO): (r - mean_g r) / (std of all rewards + eps). The std
    is over every reward of the batch, as docs/objectives.md reads; groups keep their own
    baseline but share one scale, so a low-variance group is not blown up."""
    return _centered(rewards_NG) / (_std(rewards_NG, hp.unbiased) + hp.eps)


def _check_rewards(rewards_NG: Tensor) -> Tensor:
    if not isinstance(rewards_NG, Tensor) or rewards_NG.ndim != 2:
        shape = list(rewards_NG.shape) if isinstance(rewards_NG, Tensor) else type(rewards_NG).__name__
        raise ValueError(f"rewards must be a [n_groups, G] tensor, got {shape}")
    if rewards_NG.dtype == torch.bool or rewards_NG.is_complex():
        raise ValueError(f"rewards must be real numbers, got {rewards_NG.dtype}")
    rewards_NG = rewards_NG.to(torch.promote_types(rewards_NG.dtype, torch.float32))
    if not torch.isfinite(rewards_NG).all():
        raise ValueError("rewards contain NaN or inf")
    return rewards_NG


def compute_advantages(name: str, rewards_NG: Tensor, **hparams: Any) -> Tensor:
    """Advantages [n_groups, G] (fp32, or fp64 for fp64 rewards) of estimator `name`.

    An unknown name or hyperparameter, rewards that are not a finite [n_groups, G] tensor,
    or a G the estimator is not defined for (rloo with G = 1) raise ValueError."""
    spec = ADVANTAGES[name]
    if spec.fn is None:
        raise ValueError(f"advantage {name!r} comes from a critic on the learner once the step is scored "
                         "(moe_rl.programs.ppo.critic_stage), not from group rewards")
    hp = build_hparams(spec.hparams, hparams, f"advantage {name!r}")
    rewards_NG = _check_rewards(rewards_NG)
    G = rewards_NG.shape[1]
    if G < spec.min_group_size:
        raise ValueError(
            f"advantage {name!r} needs group size G >= {spec.min_group_size}, got G={G}"
        )
    return spec.fn(rewards_NG, hp)


# PPO's GAE: token advantages from the critic (moe_rl.programs.ppo.critic_stage), computed after the step is scored.
ADVANTAGES.register("gae", AdvantageSpec("gae", None, NoHParams, 1, needs_critic=True))
register_advantage_kind("gae", needs_critic=True)


def filter_groups(rewards_NG: Tensor) -> Tensor:
    """DAPO dynamic sampling: bool [n_groups], True for groups to keep, i.e. those whose
    rewards are not all exactly equal (all-equal groups have zero advantage under every
    estimator here, hence zero gradient). G = 1 keeps nothing."""
    return ~_all_equal(_check_rewards(rewards_NG))


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward (same shape as `lengths`):
    0 if len <= L_max - L_c; ((L_max - L_c) - len) / L_c if L_max - L_c < len <= L_max
    (linear from 0 down to -1); -1 if len > L_max. With L_c = 0 the ramp is empty."""
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
    if not isinstance(cache_len, int) or not 0 <= cache_len <= max_len:
        raise ValueError(f"cache_len must be an int in [0, max_len={max_len}], got {cache_len!r}")
    if not isinstance(lengths, Tensor) or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be a numeric tensor, got {lengths!r}")
    length = lengths.to(torch.promote_types(lengths.dtype, torch.float32))
    start = max_len - cache_len
    ramp = (start - length) / max(cache_len, 1)
    return torch.where(length <= start, 0.0, torch.where(length <= max_len, ramp, -1.0))
