"""RSPO: GMPO's geometric mean with each token reweighted by its router shift gamma."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from moe_rl.objectives.base import Context, Surrogate, register_objective, require
from moe_rl.objectives.common import sign_log_clip
from moe_rl.objectives.gmpo import check_log_band, geometric_mean_ratio


@dataclass(frozen=True)
class RSPOHParams:
    """GMPO's log-space token clip plus where and how much the router shift counts."""

    log_clip_low: float = 0.4
    """d_lo: with A < 0, token log ratios below -d_lo are clipped."""
    log_clip_high: float = 0.4
    """d_hi: with A > 0, token log ratios above d_hi are clipped."""
    gamma_min: float = 0.1
    """Floor g_min on gamma (our choice; the paper's v1 states none): g = max(sg[gamma], g_min),
    so one drifted token cannot zero a whole sequence's geometric mean."""
    gamma_placement: Literal["post_clip", "pre_clip"] = "post_clip"
    """post_clip (paper v1): log S_i = mean_t(c + sgn(A_i) log g), gamma after the
    token clip, inside the sgn(A) exponent. pre_clip (paper v2): the clip acts on lr + log g,
    i.e. on rho * g."""

    def __post_init__(self) -> None:
        check_log_band(self.log_clip_low, self.log_clip_high)
        require(0 < self.gamma_min <= 1, f"gamma_min must be in (0, 1], got {self.gamma_min}")
        require(
            self.gamma_placement in ("post_clip", "pre_clip"),
            f"gamma_placement={self.gamma_placement!r}; valid: post_clip, pre_clip",
        )


@register_objective(
    "rspo",
    hparams=RSPOHParams,
    aggregation="seq-mean",
    paper="Zhang et al. 2025, Towards Stable and Effective RL for Mixture-of-Experts (arXiv:2510.23027)",
    fixes="Router drift in off-policy MoE updates: tokens whose routing moved are trusted less.",
    needs_router_shift=True,
)
def rspo(ctx: Context, hp: RSPOHParams) -> Surrogate:
    """RSPO (Zhang et al. 2025, arXiv:2510.23027).

    Fixes router-induced importance-ratio volatility in MoE RL: after an update the router
    may pick or weigh experts differently, so a token's ratio reflects routing drift as much
    as policy change. Each token is reweighted by its router shift gamma in (0, 1]
    (moe_rl.routing.router_shift), floored and stop-gradient: g = max(sg[gamma], g_min).

    post_clip (default, v1): S_i = [prod_t W_it g_it]^(sgn(A_i)/n_i) with W the GMPO token
    clip, i.e. log S_i = mean_t(c_it + sgn(A_i) log g_it); a drifted router shrinks the
    objective for both signs of A. pre_clip (v2, "rescale before clipping"): c is the GMPO
    clip of lr + log g (the ratio rho*g, no sgn), log S_i = mean_t c_it. u_i = S_i A_i.
    As docs/objectives.md defines pre_clip (no sgn), gamma < 1 lowers S for both signs, so on a
    negative-advantage sequence it raises the objective, and for A < 0 a small gamma can
    trigger the lower clip even on-policy. Requires PolicyBatch.router_shift: rspo without it is an error, never GMPO in disguise."""
    assert ctx.adv_B is not None and ctx.router_shift_BT is not None
    sign_B = torch.sign(ctx.adv_B)
    g_BT = ctx.router_shift_BT.clamp(min=hp.gamma_min)
    log_g_BT = torch.where(ctx.mask_BT, torch.log(g_BT), 0.0)
    if hp.gamma_placement == "post_clip":
        c_BT, clipped_BT = sign_log_clip(ctx.log_ratio_BT, sign_B, hp.log_clip_low, hp.log_clip_high)
        c_BT = torch.addcmul(c_BT, sign_B.unsqueeze(1), log_g_BT)  # c + sgn(A) log g
    else:
        c_BT, clipped_BT = sign_log_clip(
            ctx.log_ratio_BT + log_g_BT, sign_B, hp.log_clip_low, hp.log_clip_high
        )
    S_B = geometric_mean_ratio(c_BT, ctx)
    with torch.no_grad():
        ratio_B = torch.exp(ctx.log_ratio_BT.sum(1) * ctx.inv_len_B)
    return Surrogate(S_B * ctx.adv_B, ratio_B, clipped_BT)
