"""Shared by the learner tests and their torchrun workers: a fixed batch and a loss."""

from __future__ import annotations

import torch

from moe_rl.batch import TokenBatch


def fixed_batch() -> tuple[TokenBatch, torch.Tensor]:
    """12 sequences with varied prompt/response lengths (one empty response), advantages."""
    g = torch.Generator().manual_seed(7)
    prompts, responses = [], []
    for i in range(12):
        plen = int(torch.randint(1, 6, (1,), generator=g))
        rlen = 0 if i == 5 else int(torch.randint(1, 9, (1,), generator=g))
        prompts.append(torch.randint(1, 128, (plen,), generator=g).tolist())
        responses.append(torch.randint(1, 128, (rlen,), generator=g).tolist())
    adv_B = torch.randn(12, generator=g)
    return TokenBatch.from_lists(prompts, responses, response_width=10), adv_B


def reinforce_loss(batch: TokenBatch):
    """-sum_i A_i sum_t logp_it / (total tokens): contributions with a global normaliser."""
    from moe_rl.learner import MicroBatchLoss

    total_tokens = batch.response_lens_B.sum()

    def loss_fn(logp_BT, mb):
        mask = mb.batch.response_mask()
        adv = mb.extras["adv_B"][:, None]
        contrib = -(adv * logp_BT * mask).sum() / total_tokens
        logp_mean = (logp_BT * mask).sum() / mask.sum().clamp(min=1)
        return MicroBatchLoss(contrib, {"logp_mean": logp_mean}, weight=mask.sum())

    return loss_fn
