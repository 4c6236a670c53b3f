"""Core attention for packed sequences on the local (non-Transformer-Engine) layer spec.

megatron-core's local `DotProductAttention` refuses `packed_seq_params`; Transformer
Engine's attention (the GPU spec) takes the THD layout natively. This subclass keeps the
local path for padded batches and, for a packed one ([t, heads, dim] with segment
boundaries `cu_seqlens`), runs the very same local attention on each segment as its own
causal sequence, so a token attends to the earlier tokens of its own sequence only and the
numbers are those of the padded path.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


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
        outs = []
        for start, end in itertools.pairwise(bounds):  # [L, heads, dim] -> [L, 1, heads, dim]
            seg = slice(start, end)
            outs.append(super().forward(query[seg, None], key[seg, None], value[seg, None], None,
                                        attn_mask_type, attention_bias))
        return torch.cat(outs, dim=0)  # [t, 1, heads * dim]
