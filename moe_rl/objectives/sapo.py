"""SAPO: a smooth sigmoid gate on the token ratio instead of a hard clip."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_rl.objectives.base import Context, Surrogate, register_objective, require

SOFT_CLIP_GATE = 0.5
"""`clip_frac` for SAPO counts tokens whose gradient gate 4 p (1 - p) is below this: the
soft analogue of "clipped" (the gate has at least halved the token's gradient)."""
_SOFT_CLIP_Z = 2 * math.asinh(1.0)
"""|tau (rho - 1)| above which 4 p (1 - p) < 1/2: p = (1 + 1/sqrt(2)) / 2, logit 2 ln(1 + sqrt 2)."""


@dataclass(frozen=True)
class SAPOHParams:
    """Temperatures of the soft gate, one per advantage sign."""

    tau_pos: float = 1.0
    """Gate temperature for A > 0 (larger: the gate closes faster as rho leaves 1)."""
    tau_neg: float = 1.05
    """Gate temperature for A <= 0; above tau_pos because negative updates spread over the
    whole vocabulary and destabilise more (our default 1.05; the paper asks tau_neg > tau_pos)."""

    def __post_init__(self) -> None:
        require(self.tau_pos > 0, f"tau_pos must be > 0, got {self.tau_pos}")
        require(self.tau_neg > 0, f"tau_neg must be > 0, got {self.tau_neg}")


@register_objective(
    "sapo",
    hparams=SAPOHParams,
    aggregation="seq-mean-token-mean",
    paper="Gao et al. 2025, Soft Adaptive Policy Optimization (arXiv:2511.20347)",
    fixes="Hard clipping's cliff: a smooth gate attenuates off-policy tokens instead of zeroing them.",
)
def sapo(ctx: Context, hp: SAPOHParams) -> Surrogate:
    """SAPO (Gao et al. 2025, arXiv:2511.20347).

    Fixes hard clipping's all-or-nothing gate: u = (4/tau) sigmoid(tau (rho - 1)) A, whose
    gradient is 4 p (1 - p) rho A grad logprobs with p = sigmoid(tau (rho - 1)): exactly
    REINFORCE at rho = 1, decaying smoothly as rho drifts. tau = tau_pos if A > 0 else tau_neg."""
    ratio_BT = torch.exp(ctx.log_ratio_BT)
    tau = torch.full_like(ctx.adv_BT, hp.tau_neg).masked_fill_(ctx.adv_BT > 0, hp.tau_pos)
    z_BT = torch.addcmul(-tau, tau, ratio_BT)  # tau (rho - 1)
    u_BT = torch.sigmoid(z_BT) * ((4.0 / tau) * ctx.adv_BT)
    with torch.no_grad():
        clipped_BT = z_BT.abs() > _SOFT_CLIP_Z  # 4 p (1 - p) < SOFT_CLIP_GATE
    return Surrogate(u_BT, ratio_BT.detach(), clipped_BT)
