"""LoRA adapters in the global megatron layout: their names, the merged weight
W + (alpha / rank) B A, and the PEFT adapter export of attention adapters.

A checkpoint of a LoRA run holds, beside every frozen base weight `<linear>.weight`, the
adapter factors `<linear>.lora_A` [r, in] and `<linear>.lora_B` [out, r] (stacked over
experts as the expert weights are: [E, r, in], [E, out, r]); `moe_rl.learner.lora` makes
them. The merged weight is what every engine and every Hugging Face export gets."""

from __future__ import annotations

import torch

LORA_SUFFIXES = (".lora_A", ".lora_B")
"""The adapter factors' names after their linear's (`...linear_fc1.lora_A`)."""


def is_lora_name(name: str) -> bool:
    """A LoRA factor's parameter (or checkpoint) name."""
    return name.endswith(LORA_SUFFIXES)


def adapter_keys(weight_key: str) -> tuple[str, str]:
    """(A key, B key) of the linear whose weight is `weight_key`."""
    stem = weight_key.removesuffix("weight")
    return stem + "lora_A", stem + "lora_B"


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale B A for full (gathered) tensors: [out, in] with A [r, in], B [out, r], or
    stacked over experts ([E, out, in], [E, r, in], [E, out, r]); computed in fp32 and cast
    back to W's dtype."""
    delta = torch.matmul(lora_b.float(), lora_a.float()) * scale
    return (weight.float() + delta).to(weight.dtype)
