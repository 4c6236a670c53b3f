"""CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.objectives.base import Context, Surrogate, register_objective, require


@dataclass(frozen=True)
class CISPOHParams:
    """Bounds of the clipped IS weight sg[clip(rho, 1 - clip_low, 1 + clip_high)]."""

    clip_high: float = 4.0
    """e_hi: the weight is capped at 1 + clip_high (our default 4.0: a cap of 5)."""
    clip_low: float | None = None
    """e_lo: the weight is floored at 1 - clip_low; None (default) means no lower bound."""

    def __post_init__(self) -> None:
        require(self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")
        require(
            self.clip_low is None or 0 <= self.clip_low < 1,
            f"clip_low must be None or in [0, 1), got {self.clip_low}",
        )


@register_objective(
    "cispo",
    hparams=CISPOHParams,
    aggregation="token-mean",
    paper="MiniMax 2025, MiniMax-M1 (arXiv:2506.13585)",
    fixes="Clipping that zeroes rare high-ratio tokens: it caps their weight and keeps their gradient.",
)
def cispo(ctx: Context, hp: CISPOHParams) -> Surrogate:
    """CISPO (MiniMax-M1, arXiv:2506.13585).

    Fixes PPO/GRPO clipping dropping rare "fork" tokens (their ratios leave the band after
    the first update and their gradient is zero from then on): u = sg[min(rho, 1+e_hi)] *
    A * logprobs, so every token keeps the REINFORCE gradient A * grad logprobs, scaled by a
    capped, detached weight. Token-mean aggregation."""
    with torch.no_grad():
        ratio_BT = torch.exp(ctx.log_ratio_BT)
        low = None if hp.clip_low is None else 1.0 - hp.clip_low
        weight_BT = ratio_BT.clamp(min=low, max=1.0 + hp.clip_high)
        clipped_BT = ratio_BT > 1.0 + hp.clip_high
        if low is not None:
            clipped_BT |= ratio_BT < low
    return Surrogate(weight_BT * ctx.adv_BT * ctx.logprobs_BT, ratio_BT, clipped_BT)
