"""The learner's DPO loss: a per-row linear surrogate with the exact DPO gradient.

A pair's loss couples two rows (chosen and rejected) that the learner may put in different
micro-batches, pipeline passes or data-parallel ranks. Its gradient does not: with g_p =
dL_p/dh_p at the current weights (`loss.margin_grad`), the gradient of the mean pair loss is

    (1/P) sum_p g_p (grad log pi(y_w,p) - grad log pi(y_l,p))

which is the gradient of  sum_rows c_row * log pi(row)  with c = g_p/P on chosen rows and
-g_p/P on rejected ones, held constant. So each step scores the pairs without gradients
(the policy's sequence log-probs, hence g), then runs one ordinary update whose loss
callback is that sum: row-local, so it is exact under any micro-batching, token budget or
TP/PP/EP/DP layout (`tests/integration/test_dpo.py` compares its gradient with the direct loss's).
"""

from __future__ import annotations

import torch

from moe_rl.programs.dpo.loss import margin_grad

COEF_KEY = "dpo_coef"
"""`StepBatch.extras` key of the per-row surrogate coefficients."""


def surrogate_coefficients(h_P: torch.Tensor, beta: float, loss: str, label_smoothing: float = 0.0) -> torch.Tensor:
    """[2P] c: g_p/P for the chosen rows (0..P-1), -g_p/P for the rejected rows (P..2P-1)."""
    g = margin_grad(h_P, beta, loss, label_smoothing) / h_P.shape[0]
    return torch.cat([g, -g]).to(torch.float64)


def surrogate_loss(logp_BT: torch.Tensor, mb):
    """Loss callback: this micro-batch's sum_rows c_row * sum_t log pi(token) (padding rows
    carry c = 0 and no response tokens)."""
    from moe_rl.learner import MicroBatchLoss

    seq_B = (logp_BT * mb.batch.response_mask().to(logp_BT.device)).sum(-1)
    coef_B = mb.extras[COEF_KEY].to(device=seq_B.device, dtype=seq_B.dtype)
    return MicroBatchLoss((coef_B * seq_B).sum(), {}, weight=float(mb.batch.response_lens_B.sum()))
