"""Token-level PPO-clip surrogates: grpo, dr_grpo, dapo.

The three share one surrogate, `min(rho*A, clip(rho, 1-e_lo, 1+e_hi)*A)` per token with
rho = exp(logprobs - old_logprobs), and differ in how tokens are aggregated (registered with
each name) and in their default clip band.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.objectives.base import Context, Surrogate, register_objective, require
from moe_rl.objectives.common import clipped_surrogate


def check_ratio_band(clip_low: float, clip_high: float) -> None:
    """A ratio band [1 - clip_low, 1 + clip_high] must contain 1 and stay positive."""
    require(0 <= clip_low < 1, f"clip_low must be in [0, 1), got {clip_low}")
    require(clip_high >= 0, f"clip_high must be >= 0, got {clip_high}")


@dataclass(frozen=True)
class PPOClipHParams:
    """Token ratio clip band [1 - clip_low, 1 + clip_high] (grpo, dr_grpo)."""

    clip_low: float = 0.2
    """e_lo: with A < 0, a token whose ratio fell below 1 - clip_low stops getting gradient."""
    clip_high: float = 0.2
    """e_hi: with A > 0, a token whose ratio rose above 1 + clip_high stops getting gradient."""

    def __post_init__(self) -> None:
        check_ratio_band(self.clip_low, self.clip_high)


@dataclass(frozen=True)
class DAPOHParams:
    """DAPO's decoupled ("clip-higher") band [1 - clip_low, 1 + clip_high]."""

    clip_low: float = 0.2
    """e_lo: with A < 0, a token whose ratio fell below 1 - clip_low stops getting gradient."""
    clip_high: float = 0.28
    """e_hi, raised above e_lo so that low-probability tokens can still grow (clip-higher)."""

    def __post_init__(self) -> None:
        check_ratio_band(self.clip_low, self.clip_high)


def token_clip_surrogate(ctx: Context, clip_low: float, clip_high: float) -> Surrogate:
    ratio_BT = torch.exp(ctx.log_ratio_BT)
    u_BT, clipped_BT = clipped_surrogate(ratio_BT, ctx.adv_BT, clip_low, clip_high)
    return Surrogate(u_BT, ratio_BT.detach(), clipped_BT)


@register_objective(
    "grpo",
    hparams=PPOClipHParams,
    aggregation="seq-mean-token-mean",
    paper="Shao et al. 2024, DeepSeekMath (arXiv:2402.03300)",
    fixes="PPO's learned critic: the baseline is the group's mean reward, no value model.",
)
def grpo(ctx: Context, hp: PPOClipHParams) -> Surrogate:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    Fixes PPO's critic: the advantage comes from the group (moe_rl.advantages), the loss is
    PPO's token clip averaged per sequence, then over the B' non-empty sequences."""
    return token_clip_surrogate(ctx, hp.clip_low, hp.clip_high)


@register_objective(
    "dr_grpo",
    hparams=PPOClipHParams,
    aggregation="seq-mean-token-sum-norm",
    paper="Liu et al. 2025, Understanding R1-Zero-Like Training (arXiv:2503.20783)",
    fixes="GRPO's length bias: token sums are divided by a constant L_max, not by |o_i|.",
)
def dr_grpo(ctx: Context, hp: PPOClipHParams) -> Surrogate:
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783).

    Fixes GRPO's 1/|o_i| length bias (short correct answers pushed harder, long wrong ones
    punished less): `(1/B) sum_i sum_t m u / L_max` with B all sequences and L_max a
    constant (`max_response_length`). Pair it with the `dr_grpo` advantage (no /std)."""
    return token_clip_surrogate(ctx, hp.clip_low, hp.clip_high)


@register_objective(
    "dapo",
    hparams=DAPOHParams,
    aggregation="token-mean",
    paper="Yu et al. 2025, DAPO (arXiv:2503.14476)",
    fixes="Entropy collapse under symmetric clipping: a higher upper bound (clip-higher).",
)
def dapo(ctx: Context, hp: DAPOHParams) -> Surrogate:
    """DAPO's policy loss (Yu et al. 2025, arXiv:2503.14476).

    Fixes entropy collapse: the symmetric band lets already-likely tokens grow more than
    rare ones, so the upper bound is raised (clip-higher, e_hi = 0.28); tokens are averaged
    over the whole batch (token-mean) so long responses are not diluted. Dynamic sampling
    and overlong shaping live in moe_rl.advantages."""
    return token_clip_surrogate(ctx, hp.clip_low, hp.clip_high)
