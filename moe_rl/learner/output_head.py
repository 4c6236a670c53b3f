"""The learner's output head: response-token log-probs (and entropy) from the model's last
stage, either chunked from the output layer's input (`parallel.logprob_chunk_tokens`, the
default) or from megatron's full vocabulary-parallel logits (0: the reference path).

Chunked: the output layer's forward is switched to a pass-through, so GPTModel returns the
hidden states ([b, s, H], all-gathered over sequence parallel with a backward that only
splits the gradient: the chunked function already sums it over TP); the slots that score
response tokens are selected and `chunked_token_logprobs` computes log-probs and entropy
chunk by chunk with this rank's vocabulary shard of the output weight, recomputing each
chunk in the backward. The layer's weight stays where it is (checkpoints, DDP hooks and the
weight sync see the same parameter).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from moe_rl.learner.chunked_logprobs import chunked_token_logprobs, vocab_shard_start
from moe_rl.learner.logprobs import response_logprobs
from moe_rl.learner.microbatch import MicroBatch
from moe_rl.learner.model_input import ScoredTokens


class OutputHead:
    """Owns how the last stage turns the model's output into [B, T] log-probs."""

    def __init__(self, gpt: GPTModel, chunk_tokens: int, sequence_parallel: bool) -> None:
        self.gpt = gpt
        self.chunk_tokens = chunk_tokens
        """Tokens per chunk; 0: full logits. May be switched between passes."""
        self.sequence_parallel = sequence_parallel
        self._in_pass = False
        layer = getattr(gpt, "output_layer", None)
        if layer is not None:  # (the last pipeline stage)
            full = layer.forward
            layer.forward = lambda h, weight=None, **kw: (self._hidden(h) if self._in_pass and self.chunk_tokens
                                                         else full(h, weight, **kw))

    @contextlib.contextmanager
    def learner_pass(self) -> Iterator[None]:
        """Inside the learner's own passes the chunked head takes the hidden states; anyone
        else calling the model (a test, a tool) gets its logits as usual."""
        self._in_pass = True
        try:
            yield
        finally:
            self._in_pass = False

    def _hidden(self, hidden_SBH: torch.Tensor) -> tuple[torch.Tensor, None]:
        return whole_sequence(hidden_SBH, self.sequence_parallel), None

    def _weight(self) -> torch.Tensor:
        if self.gpt.share_embeddings_and_output_weights:
            return self.gpt.shared_embedding_or_output_weight()
        return self.gpt.output_layer.weight

    def logprobs(self, output: torch.Tensor, mb: MicroBatch, temperature: float,
                 entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, T] log-probs, [B, T] entropy or None) of the micro-batch's response tokens;
        `output` is GPTModel's output (logits, or hidden states when chunked), [b_in, s_in, *].
        `entropy`: also the entropy (chunked head only; None otherwise)."""
        flat, inp = output.reshape(-1, output.shape[-1]), mb.inp
        assert inp is not None  # (set by the learner before the forward)
        if not self.chunk_tokens:
            return response_logprobs(flat, inp.logit_index_BT, mb.batch, temperature), None
        scored = mb.scored if mb.scored is not None else inp.scored  # (on the device, indices built on the host)
        weight = self._weight()
        tp = ps.get_tensor_model_parallel_world_size()
        _check_targets(inp.scored, weight.shape[0] * tp)
        group = ps.get_tensor_model_parallel_group() if tp > 1 else None
        logp_N, entropy_N = chunked_token_logprobs(
            flat[scored.index_N], weight, scored.targets_N, temperature=temperature,
            chunk_tokens=self.chunk_tokens, tp_group=group, vocab_start=vocab_shard_start(weight, group),
            with_entropy=entropy, check_owners=False)
        shape = scored.mask_BT.shape
        return (scatter_at(logp_N, scored.at_N, shape),
                scatter_at(entropy_N, scored.at_N, shape) if entropy_N is not None else None)


def _check_targets(scored: ScoredTokens, vocab: int) -> None:
    """Every target is a token id of the (padded) vocabulary, checked on the host: then
    exactly one vocabulary shard holds each (the chunked head's own per-token check would
    read a device value back)."""
    low, high = scored.target_range
    if high >= vocab or low < 0:
        bad = high if high >= vocab else low
        raise ValueError(f"target id {bad} is outside the vocabulary [0, {vocab}): targets must be global ids "
                         "below the vocabulary size")


def whole_sequence(hidden_SBH: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """The final hidden states of every position on every TP rank: all-gathered over
    sequence parallel, with a backward that only splits the gradient (what follows computes
    the whole gradient, or sums its TP parts itself)."""
    if sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
        return gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=False)
    return hidden_SBH


def scatter_at(values_N: torch.Tensor, at_N: tuple[torch.Tensor, torch.Tensor], shape_BT: torch.Size) -> torch.Tensor:
    """[B, T] with `values_N` at (row, position) `at_N`, 0 elsewhere; differentiable (its
    backward an index: no mask selection, which would wait for a GPU's queue)."""
    return values_N.new_zeros(shape_BT).index_put_(at_N, values_N)


def scatter_masked(values_N: Any, mask_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] with `values_N` at the mask's True entries (row-major), 0 elsewhere; differentiable."""
    out = torch.zeros(mask_BT.shape, dtype=values_N.dtype, device=values_N.device)
    return out.masked_scatter(mask_BT, values_N)
