"""GMPO: a geometric mean of token-clipped ratios per sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.objectives.base import Context, Surrogate, register_objective, require
from moe_rl.objectives.common import LOG_RATIO_BOUND, sign_log_clip


def check_log_band(log_clip_low: float, log_clip_high: float) -> None:
    require(log_clip_low >= 0, f"log_clip_low must be >= 0, got {log_clip_low}")
    require(log_clip_high >= 0, f"log_clip_high must be >= 0, got {log_clip_high}")


@dataclass(frozen=True)
class GMPOHParams:
    """Token clip in log space, one bound per advantage sign."""

    log_clip_low: float = 0.4
    """d_lo: with A < 0, token log ratios below -d_lo are clipped (ratio e^-0.4 ~ 0.67)."""
    log_clip_high: float = 0.4
    """d_hi: with A > 0, token log ratios above d_hi are clipped (ratio e^0.4 ~ 1.49)."""

    def __post_init__(self) -> None:
        check_log_band(self.log_clip_low, self.log_clip_high)


def geometric_mean_ratio(c_BT: torch.Tensor, ctx: Context) -> torch.Tensor:
    """S_i = exp((1/n_i) sum_t m c) for masked log terms c (0 on padding)."""
    log_S_B = (c_BT.sum(1) * ctx.inv_len_B).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(log_S_B)


@register_objective(
    "gmpo",
    hparams=GMPOHParams,
    aggregation="seq-mean",
    paper="Zhao et al. 2025, Geometric-Mean Policy Optimization (arXiv:2507.20673)",
    fixes="Outlier token ratios dominating GRPO's arithmetic mean: a geometric mean damps them.",
)
def gmpo(ctx: Context, hp: GMPOHParams) -> Surrogate:
    """GMPO (Zhao et al. 2025, arXiv:2507.20673).

    Fixes GRPO's sensitivity to outlier token ratios (an arithmetic mean lets one extreme
    token drive the update): u_i = S_i A_i with S_i the geometric mean of token ratios,
    each clipped in log space on the side that matters (c = min(lr, d_hi) if A > 0,
    max(lr, -d_lo) if A < 0). The seeds' `min(rho^sgnA, clip(rho^sgnA, e1, e2))` reduces to
    the same one-sided clip; at the symmetric default the two readings coincide."""
    assert ctx.adv_B is not None
    c_BT, clipped_BT = sign_log_clip(
        ctx.log_ratio_BT, torch.sign(ctx.adv_B), hp.log_clip_low, hp.log_clip_high
    )
    S_B = geometric_mean_ratio(c_BT, ctx)
    with torch.no_grad():
        ratio_B = torch.exp(ctx.log_ratio_BT.sum(1) * ctx.inv_len_B)
    return Surrogate(S_B * ctx.adv_B, ratio_B, clipped_BT)
