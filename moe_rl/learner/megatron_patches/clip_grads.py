"""Gradient clipping without megatron's CUDA type-string assertion (CPU grads)."""

from __future__ import annotations

import torch

UPSTREAM = ("megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
            "megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32")
SIGNATURES = {"megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32": ("parameters", "max_norm", "total_norm", "use_decoupled_grad")}


def apply() -> None:
    """megatron's `clip_grad_by_total_norm_fp32` asserts every grad's type string is
    'torch.cuda.FloatTensor' before scaling. On CPU the fp32 grads are 'torch.FloatTensor'.
    Same clipping (grads scaled in place by max_norm / (total_norm + 1e-6) when that is < 1),
    with the dtype checked instead of the CUDA type string."""
    from megatron.core.optimizer import clip_grads, optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
        for g in grads:
            if g.dtype != torch.float32:
                raise TypeError(f"expected fp32 main grads, got {g.dtype}")
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            torch._foreach_mul_(grads, clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
