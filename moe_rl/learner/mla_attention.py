"""Core attention for multi-latent attention (MLA) on the local (non-Transformer-Engine) spec.

megatron-core's MLASelfAttention builds its core attention with `k_channels` (the query /
key head size, qk_head_dim + qk_pos_emb_head_dim) and `v_channels` (v_head_dim), which only
Transformer Engine's attention accepts: the local `DotProductAttention` takes neither and
sizes its output as kv_channels per head. This subclass takes both and sizes the output by
the value heads; the scores use MLA's own softmax scale (1/sqrt(k_channels), times YaRN's
mscale^2), passed in by MLASelfAttention. Built on the packed-sequence attention so packed
micro-batches work alike.
"""

from __future__ import annotations

from typing import Any

from moe_rl.learner.packed_attention import PackedDotProductAttention


class MLADotProductAttention(PackedDotProductAttention):
    """megatron's local `DotProductAttention` (packed-sequence aware) with query/key heads of `k_channels` and value heads of `v_channels`."""

    def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs: Any) -> None:
        # (the base Attention builds a throwaway instance without them; MLA then rebuilds it)
        super().__init__(*args, **kwargs)
        if v_channels is not None:  # the context is [s, b, heads_per_partition * v_channels]
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
