"""GSPO: one importance ratio per sequence (and its token-level form, GSPO-token)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.objectives.base import Context, Surrogate, register_objective
from moe_rl.objectives.common import clipped_surrogate
from moe_rl.objectives.ppo_clip import check_ratio_band

GSPO_PAPER = "Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071)"


@dataclass(frozen=True)
class GSPOHParams:
    """Clip band on the sequence ratio s_i (tiny: s_i is a length-normalised geometric mean)."""

    clip_low: float = 3e-4
    """e_lo: with A < 0, a sequence whose s_i fell below 1 - clip_low stops getting gradient."""
    clip_high: float = 4e-4
    """e_hi: with A > 0, a sequence whose s_i rose above 1 + clip_high stops getting gradient."""

    def __post_init__(self) -> None:
        check_ratio_band(self.clip_low, self.clip_high)


def sequence_log_ratio(ctx: Context) -> torch.Tensor:
    """log s_i = (1/n_i) sum_t m (logprobs - old_logprobs); 0 for an empty sequence."""
    return ctx.log_ratio_BT.sum(1) * ctx.inv_len_B


@register_objective(
    "gspo",
    hparams=GSPOHParams,
    aggregation="seq-mean",
    paper=GSPO_PAPER,
    fixes="Unit mismatch: a sequence-level reward corrected by per-token ratios (noise grows with length).",
)
def gspo(ctx: Context, hp: GSPOHParams) -> Surrogate:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071).

    Fixes the unit mismatch of GRPO (a sequence reward, token importance ratios whose noise
    accumulates with length; on MoE, routing jitter): the ratio is the sequence's
    length-normalised likelihood ratio s_i = exp(mean_t lr), clipped as a whole,
    `min(s_i A_i, clip(s_i, 1-e_lo, 1+e_hi) A_i)`, averaged over the B' non-empty sequences.
    Needs per-sequence advantages [B]."""
    assert ctx.adv_B is not None  # policy_loss refuses [B,T] advantages for seq-mean objectives
    s_B = torch.exp(sequence_log_ratio(ctx))
    u_B, clipped_B = clipped_surrogate(s_B, ctx.adv_B, hp.clip_low, hp.clip_high)
    return Surrogate(u_B, s_B.detach(), clipped_B)


@register_objective(
    "gspo_token",
    hparams=GSPOHParams,
    aggregation="seq-mean-token-mean",
    paper=GSPO_PAPER + ", GSPO-token",
    fixes="GSPO with per-token advantages: the sequence ratio's value, each token's own gradient path.",
)
def gspo_token(ctx: Context, hp: GSPOHParams) -> Surrogate:
    """GSPO-token (Zheng et al. 2025, arXiv:2507.18071).

    Fixes GSPO's restriction to one advantage per sequence: s_it = sg[s_i] * pi/sg[pi]
    equals s_i in value, but its gradient flows through token t alone, so A_it may vary
    along the sequence. With constant advantages it equals gspo in value and gradient."""
    s_B1 = torch.exp(sequence_log_ratio(ctx).detach()).unsqueeze(1)
    logp_BT = ctx.logprobs_BT
    # exp(x - sg[x]) is 1 with derivative 1; written as 1 + (x - sg[x]) it is the same in
    # value and gradient and needs no [B,T] exp: s_it = s_i + s_i (logp - sg[logp]).
    s_BT = torch.addcmul(s_B1, s_B1, logp_BT - logp_BT.detach())
    u_BT, clipped_BT = clipped_surrogate(s_BT, ctx.adv_BT, hp.clip_low, hp.clip_high)
    return Surrogate(u_BT, s_BT.detach(), clipped_BT)
