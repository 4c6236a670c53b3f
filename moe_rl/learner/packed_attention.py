"""Core attention for packed sequences on the local (non-Transformer-Engine) layer spec.

megatron-core's local `DotProductAttention` refuses `packed_seq_params`; Transformer
Engine's attention (the GPU spec) takes the THD layout natively. This subclass keeps the
local path for padded batches and, for a packed one ([t, heads, dim] with segment
boundaries `cu_seqlens`), runs the very same local causal attention on right-padded
[L, g, heads, dim] batches of segments of similar length: a token attends to the earlier
tokens of its own sequence only (padding comes after every real token, so the causal mask
already hides it), and the numbers are those of the padded path.

Why groups: one call per sequence pays the local attention's per-call overhead (a dozen
small ops forward and backward, per sequence and layer), which dominated a CPU update of
short rollouts (tiny_ppo: 1.31 -> 0.65 s per update); one call for all pads every segment
to the longest, quadratic waste when lengths vary (bench_learner_packing's 24-768-token
sequences). A segment joins the group of the next longer ones when padding it to their
length adds at most `MERGE_WASTE` score positions: about one call's overhead on a CPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

MERGE_WASTE = 1024
"""Score positions (longest^2 - length^2) a segment may waste to share a call."""


def length_groups(lengths: list[int], waste: int = MERGE_WASTE) -> list[list[int]]:
    """Segment indices in groups, longest first; each member pads to its group's first
    (longest) segment at a cost of at most `waste` score positions."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        if groups and lengths[groups[-1][0]] ** 2 - lengths[i] ** 2 <= waste:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass(frozen=True)
class SegmentGroup:
    """Segments that share one attention call: every token's packed index (`token_N`) and
    its slot (position * g + member) in the right-padded [longest, g] batch (`slot_N`)."""

    longest: int
    g: int
    token_N: torch.Tensor
    slot_N: torch.Tensor


def segment_groups(bounds: list[int], device: torch.device) -> list[SegmentGroup]:
    """The length groups of the packed segments between `bounds` (cu_seqlens), with their
    index tensors built on the host in one go (one small copy per group and tensor)."""
    lengths = [end - start for start, end in itertools.pairwise(bounds)]
    out = []
    for group in length_groups(lengths):
        g = len(group)
        token = [t for i in group for t in range(bounds[i], bounds[i + 1])]
        slot = [p * g + m for m, i in enumerate(group) for p in range(lengths[i])]
        out.append(SegmentGroup(lengths[group[0]], g, torch.tensor(token).to(device, non_blocking=True),
                                torch.tensor(slot).to(device, non_blocking=True)))
    return out


def _padded(x_NHD: torch.Tensor, group: SegmentGroup) -> torch.Tensor:
    """A group's tokens of packed [t, heads, dim] at their slots of a right-padded [L, g, heads, dim]."""
    out = x_NHD.new_zeros(group.longest * group.g, *x_NHD.shape[1:]).index_copy(0, group.slot_N, x_NHD[group.token_N])
    return out.view(group.longest, group.g, *x_NHD.shape[1:])


class PackedDotProductAttention(DotProductAttention):
    """`DotProductAttention` that also accepts megatron's THD packed layout."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        groups = _groups_of(packed_seq_params, query.device)
        contexts = []
        for group in groups:
            qkv = (_padded(x, group) for x in (query, key, value))
            context = super().forward(*qkv, None, attn_mask_type, attention_bias)
            contexts.append(context.reshape(group.longest * group.g, -1)[group.slot_N])
        # (the groups' tokens, concatenated, back into packed order: index_copy, whose
        # backward is a gather rather than a scatter-add)
        context_NH = torch.cat(contexts) if len(contexts) > 1 else contexts[0]
        token_N = torch.cat([g.token_N for g in groups]) if len(groups) > 1 else groups[0].token_N
        return context_NH.new_zeros(context_NH.shape).index_copy(0, token_N, context_NH).unsqueeze(1)


def _groups_of(packed_seq_params: Any, device: torch.device) -> list[SegmentGroup]:
    """The micro-batch's segment groups, built by its first attention layer and kept on its
    `packed_seq_params` (one object per micro-batch, passed to every layer): the index
    tensors and the read of the boundaries happen once per micro-batch, not per layer."""
    groups = getattr(packed_seq_params, "moe_rl_segment_groups", None)
    if groups is None:
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        groups = segment_groups(cu.tolist(), device)
        packed_seq_params.moe_rl_segment_groups = groups
    return groups
