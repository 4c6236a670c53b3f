"""Sampler precisions: fp32, bf16, fp8_emulated and (vLLM on a GPU) fp8, as one weight transform.

    fp32          weights and compute in float32 (the reference; matches the CPU learner)
    bf16          weights and compute in bfloat16
    fp8_emulated  bf16 compute; the weight *matrices* of linear layers and experts are
                  rounded to float8_e4m3fn with a per-tensor scale and dequantized back
    fp8           vLLM's own fp8 execution (`quantization="fp8"`: weights quantized by the
                  engine at load and after each weight sync, fp8 GEMMs); GPU only. The
                  weights are handed over in bf16 and vLLM does the rounding.

fp8_emulated is an emulation, not fp8 execution: no fp8 kernels run and activations stay in
bf16. It reproduces the weight-rounding part of an fp8 sampler (per-tensor scale
`amax / 448`, round-to-nearest-even in e4m3, so values keep 3 mantissa bits) so that the
effect of quantized rollouts on the sampler-learner mismatch can be studied on CPU.

Which tensors are quantized follows what fp8 serving stacks (vLLM's fp8 schemes, DeepSeek-V3)
quantize: the GEMM weights of attention (q/k/v/o_proj) and of MLPs and experts
(gate/up/down_proj), each checkpoint tensor with its own scale, so every expert matrix has
its own. Kept in the compute dtype: embeddings, the output head (lm_head), norms (including
QK-norm), biases, and the router (`mlp.gate`), whose small logit differences decide routing.

Names are Hugging Face (Qwen3-MoE layout) checkpoint names. Both backends and their
`update_weights` apply `transform_weights` to the stream they load, so a tensor gets the same
rounding whichever backend samples with it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Literal

import torch

Precision = Literal["fp32", "bf16", "fp8_emulated", "fp8"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp8_emulated", "fp8")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn

# `...self_attn.q_proj.weight`, `...mlp.experts.3.down_proj.weight`,
# `...mlp.shared_expert.up_proj.weight`, `...mlp.gate_proj.weight` (dense layers).
# Not `...mlp.gate.weight` (router) nor `...shared_expert_gate.weight`.
_QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown sampler precision {precision!r}; choose one of {list(PRECISIONS)}")


def resolve_precision(precision: str, on_gpu: bool) -> str:
    """`sampler.precision: auto` is bf16 on a GPU and fp32 on CPU (where the learner's
    reference precision is fp32); fp8 (vLLM's fp8 kernels) exists only on a GPU."""
    if precision == "auto":
        return "bf16" if on_gpu else "fp32"
    check_precision(precision)
    if precision == "fp8" and not on_gpu:
        raise ValueError("sampler.precision=fp8 runs vLLM's fp8 kernels, which need a GPU; on CPU use "
                         "fp8_emulated (the same weight rounding, bf16 compute)")
    return precision


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype a backend runs (and stores weights) in for `precision`."""
    check_precision(precision)
    return torch.float32 if precision == "fp32" else torch.bfloat16


def is_quantized(name: str) -> bool:
    """Whether fp8_emulated rounds this (HF-named) tensor."""
    return _QUANTIZED.search(name) is not None


def fp8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """Per-tensor scaled round trip through float8_e4m3fn, computed in float32.

    Returns float32 values `q * scale`, `q = fp8(w / scale)`, `scale = amax(|w|) / 448`.
    """
    w32 = w.detach().to(torch.float32)
    amax = w32.abs().max()
    if amax == 0 or not torch.isfinite(amax):
        return w32.clone()
    scale = amax / FP8_MAX
    return (w32 / scale).to(FP8_DTYPE).to(torch.float32) * scale


def transform_weight(name: str, w: torch.Tensor, precision: str) -> torch.Tensor:
    """One checkpoint tensor as the sampler should hold it (dtype and, for fp8, values).
    Router expert biases stay fp32 at every precision, as the learner and the serving
    engines keep them: rounded, they would move routing decisions."""
    if name.endswith("e_score_correction_bias"):
        return w.float()
    dtype = precision_dtype(precision)
    if precision == "fp8_emulated" and is_quantized(name):
        return fp8_round_trip(w).to(dtype)
    return w.to(dtype)


def transform_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]], precision: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Lazily apply `transform_weight` to a (name, tensor) stream."""
    check_precision(precision)
    for name, w in named_tensors:
        yield name, transform_weight(name, w, precision)
