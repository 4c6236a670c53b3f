"""Per-token log-probabilities of response tokens from (vocab-parallel) logits.

The logits at position p predict the token at p+1, so response token j of sequence b
(absolute position prompt_len + j) is scored by the logits at prompt_len + j - 1 of its
row (`TokenBatch.scoring_positions`), wherever that row sits in the model's input (padded
or packed: `ModelInput.logit_index_BT`). We gather those slots first and run the cross
entropy only on them: [B, T, V/tp] instead of every slot's logits. megatron's
vocab-parallel cross entropy reduces the softmax normaliser over the TP group, so the
result is exact under any TP size (and it is the same call at TP=1).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from moe_rl.batch import TokenBatch


def response_logprobs(
    logits_NV: torch.Tensor, logit_index_BT: torch.Tensor, batch: TokenBatch, temperature: float = 1.0
) -> torch.Tensor:
    """[B, T] fp32 log pi(response token) under softmax(logits / temperature).

    `logits_NV` is this rank's vocabulary shard of the micro-batch's logits, flattened over
    its slots ([b_in * s_in, V/tp], padded or packed); `logit_index_BT` the slot that scores
    each response token (`ModelInput.logit_index_BT`). Positions beyond a response hold 0.
    Differentiable with respect to the logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    B, T = batch.batch_size, batch.response_width
    if T == 0:
        return logits_NV.new_zeros((B, 0), dtype=torch.float32)
    logits_BTV = logits_NV[logit_index_BT.to(logits_NV.device, non_blocking=True)].float()
    if temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    target_BT = batch.response_tokens().to(logits_NV.device)
    # megatron's kernel wants [S, B, V]; it returns the negative log-likelihood.
    nll_TB = vocab_parallel_cross_entropy(
        logits_BTV.transpose(0, 1).contiguous(), target_BT.t().contiguous()
    )
    mask_BT = batch.response_mask().to(logits_NV.device)
    return torch.where(mask_BT, -nll_TB.t(), 0.0)
