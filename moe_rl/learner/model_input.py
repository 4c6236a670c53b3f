"""How a micro-batch's rows enter the model: padded (one row per batch entry, right-padded
to a shared length) or packed (every row's tokens one after another in a single sequence,
megatron's THD layout), and the maps that tie the model's token slots back to the rows.

    inp = packed_input(mb.batch, multiple=tp)       # or padded_input(mb.batch, seq_len)
    logits = model(inp.tokens, inp.positions, packed_seq_params=...)
    logp_BT = logits.reshape(-1, V)[inp.logit_index_BT]    # response tokens, either layout

Rows keep their [B, S] grid everywhere else (logprobs [B, T], routing records [R, S, L, K]);
only the model's input differs. In the router's token order (megatron's [s, b] flattened
s-major), slot n holds position `pos_N[n]` of micro-batch row `rows_N[n]`; `real_N` marks
the slots that hold a real token (not right padding, not alignment padding, not a padding
row).

Everything here is built on the host, once per step, from data the host holds: the head, the
loss and the routing taps index the device's tensors with these maps (`ScoredTokens`)
instead of building masks on the device and selecting with them, which would make a GPU's
host wait for its queue in every micro-batch.

Packed: each row's tokens are followed by alignment padding up to a multiple of
`multiple` (sequence parallel splits the packed sequence evenly over TP ranks, so every
segment boundary falls on a multiple of TP), rotary positions restart at 0 in every
segment, and attention stays inside each segment (causal). Padding rows (no tokens of a
rank's own, added so every data-parallel rank runs as many micro-batches) take one
segment of `multiple` slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from moe_rl.batch import TokenBatch

if TYPE_CHECKING:
    from moe_rl.learner.parallel import Layout


@dataclass(frozen=True)
class ScoredTokens:
    """Where a micro-batch's response tokens are, located on the host."""

    mask_BT: torch.Tensor
    """[B, T] bool: a response token exists."""
    at_N: tuple[torch.Tensor, torch.Tensor]
    """([n] row, [n] response position) of each response token, row-major (the mask's order)."""
    index_N: torch.Tensor
    """[n] int64 index into the flattened [b_in * s_in] model output of the slot that scores
    each response token (`ModelInput.logit_index_BT` at the mask)."""
    targets_N: torch.Tensor
    """[n] int64 the response tokens."""
    slot_BT: torch.Tensor
    """[B, T] int64 the router-order (s-major) slot of each response token's scoring
    position (meaningless where there is no token)."""
    target_range: tuple[int, int]
    """(smallest, largest) target id ((0, -1): none), for the head's check against the vocabulary."""

    def to(self, device: torch.device) -> ScoredTokens:
        """The same maps on `device` (copies that need not wait for the device)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return ScoredTokens(move(self.mask_BT), (move(self.at_N[0]), move(self.at_N[1])), move(self.index_N),
                            move(self.targets_N), move(self.slot_BT), self.target_range)


def scored_tokens(batch: TokenBatch, logit_index_BT: torch.Tensor, b_in: int, s_in: int) -> ScoredTokens:
    """`ScoredTokens` of a micro-batch whose model input is [b_in, s_in]."""
    mask_BT = batch.response_mask()
    rows_N, cols_N = mask_BT.nonzero(as_tuple=True)
    at_N = (rows_N, cols_N)
    index_N = logit_index_BT[at_N]
    targets_N = batch.response_tokens()[at_N]
    slot_BT = (logit_index_BT % s_in) * b_in + logit_index_BT // s_in  # b-major output -> s-major router order
    span = (int(targets_N.min()), int(targets_N.max())) if targets_N.numel() else (0, -1)
    return ScoredTokens(mask_BT, at_N, index_N, targets_N, slot_BT, span)


@dataclass(frozen=True)
class ModelInput:
    """One micro-batch as the model sees it."""

    tokens: torch.Tensor
    """[b_in, s_in] token ids (padded: [B, S]; packed: [1, sum of segment lengths])."""
    positions: torch.Tensor
    """[b_in, s_in] rotary positions (packed: restarting at 0 in every segment)."""
    cu_seqlens: torch.Tensor | None
    """[segments + 1] int32 segment boundaries in the packed sequence (None: padded)."""
    max_seqlen: int
    """Longest segment (packed) or S (padded)."""
    rows_N: torch.Tensor
    """[b_in * s_in] micro-batch row of each slot in the router's order (s-major); -1: none."""
    pos_N: torch.Tensor
    """[b_in * s_in] position of each slot within its row."""
    real_N: torch.Tensor
    """[b_in * s_in] bool: the slot holds one of its row's real tokens."""
    logit_index_BT: torch.Tensor
    """[B, T] index into the flattened [b_in * s_in] logits of the slot that scores each
    response token (b-major, as GPTModel returns [b, s, V])."""
    scored: ScoredTokens
    """The response tokens located in these maps."""
    all_real: bool = False
    """Every slot holds a real token (no padding anywhere)."""
    cu_seqlens_real: torch.Tensor | None = None
    """[segments + 1] int32 boundaries of the real tokens (each segment's at least 1), for
    Transformer Engine's THD attention (None: padded)."""

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def slots(self) -> int:
        return self.tokens.numel()

    @property
    def real_tokens(self) -> int:
        return int(self.real_N.sum())


def padded_input(batch: TokenBatch, seq_len: int, row_valid_B: torch.Tensor) -> ModelInput:
    """The rows as they are, right-padded to `seq_len` (>= the batch's S)."""
    B, S = batch.batch_size, batch.seq_len
    tokens = batch.tokens_BS.new_zeros((B, seq_len))
    tokens[:, :S] = batch.tokens_BS
    positions = torch.arange(seq_len).expand(B, seq_len)
    s_N = torch.arange(seq_len).repeat_interleave(B)
    rows_N = torch.arange(B).repeat(seq_len)
    real_N = (s_N < batch.total_lens_B[rows_N]) & row_valid_B[rows_N]
    logit_index_BT = torch.arange(B)[:, None] * seq_len + batch.scoring_positions()
    return ModelInput(tokens, positions, None, seq_len, rows_N, s_N, real_N, logit_index_BT,
                      scored_tokens(batch, logit_index_BT, B, seq_len), bool(real_N.all()))


def packed_input(batch: TokenBatch, multiple: int, row_valid_B: torch.Tensor) -> ModelInput:
    """The rows' real tokens one segment each, every segment padded to `multiple`."""
    lens_B = torch.where(row_valid_B, batch.total_lens_B, 0)
    seg_B = torch.clamp(-(-lens_B // multiple) * multiple, min=multiple)
    starts_B = torch.cumsum(seg_B, 0) - seg_B
    total = int(seg_B.sum())
    rows_N = torch.repeat_interleave(torch.arange(batch.batch_size), seg_B)
    pos_N = torch.arange(total) - starts_B[rows_N]
    real_N = pos_N < lens_B[rows_N]
    tokens = batch.tokens_BS.new_zeros(total)
    tokens[real_N] = batch.tokens_BS[rows_N[real_N], pos_N[real_N]]
    cu = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seg_B, 0)
    logit_index_BT = (starts_B[:, None] + batch.scoring_positions()).clamp(max=total - 1)
    cu_real = torch.zeros_like(cu)
    cu_real[1:] = torch.cumsum(lens_B.clamp(min=1), 0)  # (real lengths, at least 1)
    return ModelInput(tokens[None], pos_N[None], cu, int(seg_B.max()), rows_N, pos_N, real_N, logit_index_BT,
                      scored_tokens(batch, logit_index_BT, 1, total), bool(real_N.all()), cu_real)


def packed_seq_params(inp: ModelInput, device: torch.device) -> Any:
    """megatron's PackedSeqParams for a packed input: the segments (with their alignment
    padding) as `*_padded` (what rotary positions and the CPU attention use), the real
    lengths (at least 1) as `cu_seqlens_*` for Transformer Engine's THD attention."""
    from megatron.core.packed_seq_params import PackedSeqParams

    assert inp.cu_seqlens is not None and inp.cu_seqlens_real is not None  # (a packed input has both)
    cu_padded = inp.cu_seqlens.to(device, non_blocking=True)
    cu_real = inp.cu_seqlens_real.to(device, non_blocking=True)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real,
                           cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                           max_seqlen_q=inp.max_seqlen, max_seqlen_kv=inp.max_seqlen)


def padding_mask(inp: ModelInput, layout: Layout) -> torch.Tensor:
    """[b, s] True on the slots without a real token (right and alignment padding, padding
    rows), in the model input's shape: megatron-core's MoE layers then leave them out of the
    load-balancing and z losses. megatron shards it over sequence-parallel ranks on the
    first pipeline stage only, so a later stage gets its own shard of the sequence here."""
    b, s = inp.tokens.shape
    pad_BS = ~inp.real_N.reshape(s, b).T  # (router order is s-major)
    if layout.sequence_parallel and layout.pp_rank > 0:
        shard = s // layout.tp
        pad_BS = pad_BS[:, layout.tp_rank * shard:(layout.tp_rank + 1) * shard]
    return pad_BS.contiguous()
