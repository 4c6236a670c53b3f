"""Per-token log-probabilities of response tokens from (vocab-parallel) logits.

The logits at position p predict the token at p+1, so response token j of sequence b
(absolute position prompt_len + j) is scored by the logits at prompt_len + j - 1. We gather
those positions first and run the cross entropy only on them: [B, T, V/tp] instead of
[B, S, V/tp]. megatron's vocab-parallel cross entropy reduces the softmax normaliser over
the TP group, so the result is exact under any TP size (and it is the same call at TP=1).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from moe_rl.batch import TokenBatch


def response_positions(batch: TokenBatch) -> torch.Tensor:
    """[B, T] int64: the position whose logits score each response token (clamped in range)."""
    j = torch.arange(batch.response_width, device=batch.prompt_lens_B.device)
    return (batch.prompt_lens_B[:, None] - 1 + j[None, :]).clamp(min=0, max=batch.seq_len - 1)


def response_logprobs(
    logits_BSV: torch.Tensor, batch: TokenBatch, temperature: float = 1.0
) -> torch.Tensor:
    """[B, T] fp32 log pi(response token) under softmax(logits / temperature).

    `logits_BSV` is this rank's vocabulary shard ([B, S, V/tp]); positions beyond a
    response hold 0. Differentiable with respect to the logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    B, T = batch.batch_size, batch.response_width
    if T == 0:
        return logits_BSV.new_zeros((B, 0), dtype=torch.float32)
    pos_BT = response_positions(batch).to(logits_BSV.device)
    V = logits_BSV.shape[-1]
    logits_BTV = logits_BSV.gather(1, pos_BT[:, :, None].expand(B, T, V)).float()
    if temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    target_BT = batch.response_tokens().to(logits_BSV.device)
    # megatron's kernel wants [S, B, V]; it returns the negative log-likelihood.
    nll_TB = vocab_parallel_cross_entropy(
        logits_BTV.transpose(0, 1).contiguous(), target_BT.t().contiguous()
    )
    mask_BT = batch.response_mask().to(logits_BSV.device)
    return torch.where(mask_BT, -nll_TB.t(), 0.0)
