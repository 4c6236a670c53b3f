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


def _padded(x_NHD: torch.Tensor, token_N: torch.Tensor, slot_N: torch.Tensor, longest: int, g: int) -> torch.Tensor:
    """A group's tokens of packed [t, heads, dim] at their slots of a right-padded [L, g, heads, dim]."""
    out = x_NHD.new_zeros(longest * g, *x_NHD.shape[1:]).index_copy(0, slot_N, x_NHD[token_N])
    return out.view(longest, g, *x_NHD.shape[1:])


class PackedDotProductAttention(DotProductAttention):
    """`DotProductAttention` that also accepts megatron's THD packed layout."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        bounds = cu.tolist()
        lengths = [end - start for start, end in itertools.pairwise(bounds)]
        tokens, contexts = [], []
        for group in length_groups(lengths):
            longest, g = lengths[group[0]], len(group)
            # each token of the group: its packed index, and its slot (position * g + member) in [L, g]
            token_N = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in group]).to(query.device)
            slot_N = torch.cat([torch.arange(lengths[i]) * g + m for m, i in enumerate(group)]).to(query.device)
            qkv = (_padded(x, token_N, slot_N, longest, g) for x in (query, key, value))
            context = super().forward(*qkv, None, attn_mask_type, attention_bias)
            tokens.append(token_N)
            contexts.append(context.reshape(longest * g, -1)[slot_N])
        # (the groups' tokens, concatenated, back into packed order: index_copy, whose
        # backward is a gather rather than a scatter-add)
        context_NH = torch.cat(contexts)
        return context_NH.new_zeros(context_NH.shape).index_copy(0, torch.cat(tokens), context_NH).unsqueeze(1)
