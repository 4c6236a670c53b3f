"""The live learner's weights as a Hugging Face stream (Qwen3-MoE; Glm4-MoE for a sigmoid
router / shared expert; DeepseekV3 for multi-latent attention, its MTP layers left out:
`moe_rl.convert.layout_for`), for weight sync.

    for name, tensor in hf_named_tensors(learner):   # collective: every rank iterates
        ...                                            # rank 0 gets the pairs
    for name, tensor in hf_named_tensors(learner, dst=None):
        ...                                            # every rank gets every pair

The stream's collectives run while it is iterated, so iterate it in the trainer's
process-group context, to the end, on every rank; hand an engine what it yields (the
rollout package pulls it in layer-aligned buckets and gives each bucket to its engine).

Built on `gather.iter_full_tensors` (each global megatron tensor assembled on rank 0 from
its TP/EP/PP shards) and the converter's name map, so the stream names and values are
exactly those `tools/convert_checkpoint.py` writes for a checkpoint of the same weights.
The HF tensors are views of each gathered tensor (only q/k/v, casts and the zeros a layout
requires are new memory); a consumer that keeps them keeps the gathered tensor alive.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from moe_rl.convert.layouts import layout_for
from moe_rl.convert.lora_merge import is_lora_name, merged_weight
from moe_rl.convert.megatron_keys import ConvertError, canonical_key, megatron_specs
from moe_rl.learner.gather import SyncTraffic, iter_full_tensors, iter_full_tensors_everywhere
from moe_rl.learner.protocols import PolicyLearner


def hf_named_tensors(
    learner: PolicyLearner, dtype: torch.dtype | None = None, dst: int | None = 0, traffic: SyncTraffic | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(HF name, full tensor)` for the learner's whole model on rank `dst` (None: on
    every rank, with `traffic` counting this rank's bytes); collective.
    `dtype` casts on the way out (None keeps the parameter dtype; tensors whose HF dtype is
    fixed, the float32 expert bias, are never cast). Every tensor the model config implies
    is yielded exactly once; anything else is a ConvertError naming the key. LoRA-adapted
    weights are yielded merged, W + (alpha / rank) B A, one linear at a time (its adapters
    arrive just before its weight: no extra copy of the model)."""
    m = learner.model_cfg
    layout = layout_for(m)
    layout.check_supported(m)
    expected = megatron_specs(m)
    rank = dist.get_rank() if dist.is_initialized() else 0
    seen: set[str] = set()
    full_tensors = (iter_full_tensors_everywhere(learner.gpt, traffic) if dst is None
                    else iter_full_tensors(learner.gpt, dst=dst))
    adapters: dict[str, torch.Tensor] = {}  # this linear's (A, B): keys sort just before its weight
    for key, full in full_tensors:
        key = canonical_key(key)
        if is_lora_name(key):
            adapters[key] = full
            continue
        if key.endswith(".weight") and key.removesuffix("weight") + "lora_A" in adapters:
            stem = key.removesuffix("weight")
            full = merged_weight(full, adapters.pop(stem + "lora_A"), adapters.pop(stem + "lora_B"), m.lora.scale)
        if key not in expected:
            raise ConvertError(f"learner tensor {key!r} has no {layout.name} counterpart")
        seen.add(key)
        yield from layout.to_hf(key, full, m, dtype)
    if adapters:
        raise ConvertError(f"adapter {next(iter(adapters))!r} has no weight to merge into")
    if dst is None or rank == dst:
        missing = [k for k in expected if k not in seen]
        if missing:
            raise ConvertError(f"the learner did not produce tensor {missing[0]!r} ({len(missing)} missing)")
