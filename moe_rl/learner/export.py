"""The live learner's weights as a Hugging Face (Qwen3-MoE) stream, for weight sync.

    for name, tensor in hf_named_tensors(learner):   # collective: every rank iterates
        ...                                            # rank 0 gets the pairs
    sampler.update_weights(hf_named_tensors(learner))  # on rank 0; others drain it

Built on `gather.iter_full_tensors` (each global megatron tensor assembled on rank 0 from
its TP/EP/PP shards) and the converter's name map, so the stream names and values are
exactly those `tools/convert_checkpoint.py` writes for a checkpoint of the same weights.
The HF tensors are views of each gathered tensor (only q/k/v need a copy); a consumer that
keeps them keeps the gathered tensor alive, nothing more.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from moe_rl.convert.qwen3_moe import (
    ConvertError,
    canonical_key,
    check_supported,
    megatron_specs,
    to_hf,
)
from moe_rl.learner.gather import iter_full_tensors


def hf_named_tensors(
    learner, dtype: torch.dtype | None = None, dst: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(HF name, full tensor)` for the learner's whole model on rank `dst`; collective.
    `dtype` casts on the way out (None keeps the parameter dtype). Every tensor the model
    config implies is yielded exactly once; anything else is a ConvertError naming the key."""
    m = learner.cfg.model
    check_supported(m)
    expected = megatron_specs(m)
    rank = dist.get_rank() if dist.is_initialized() else 0
    seen: set[str] = set()
    for key, full in iter_full_tensors(learner.gpt, dst=dst):
        key = canonical_key(key)
        if key not in expected:
            raise ConvertError(f"learner tensor {key!r} has no Qwen3-MoE counterpart")
        seen.add(key)
        for name, t in to_hf(key, full, m):
            yield name, (t if dtype is None else t.to(dtype))
    if rank == dst:
        missing = [k for k in expected if k not in seen]
        if missing:
            raise ConvertError(f"the learner did not produce tensor {missing[0]!r} ({len(missing)} missing)")
