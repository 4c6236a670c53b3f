"""The local spec's torch norms under sequence parallel (any device)."""

from __future__ import annotations

import torch

UPSTREAM = ("megatron.core.transformer.torch_norm:WrappedTorchNorm",)
SIGNATURES = {"megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__": ("cls", "config", "hidden_size", "eps", "persist_layer_norm", "zero_centered_gamma", "normalization")}


def apply() -> None:
    """The local layer spec builds norms with `WrappedTorchNorm`, which refuses sequence
    parallel: under SP each TP rank normalises different tokens, so the norm weights' grads
    must be summed over TP, and megatron only does that for params tagged
    `sequence_parallel=True` (its fused/TE norms tag themselves). We build the same torch norm
    and add the tag, which makes `finalize_model_grads` sum those grads across TP. (The
    shared q/k norms are tagged too: their per-rank grads come from disjoint heads, and the
    sum is again the full gradient.)"""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,  # noqa: N807
                zero_centered_gamma=False, normalization="LayerNorm"):
        if config.normalization != "RMSNorm":
            raise ValueError(f"moe_rl builds RMSNorm models, got {config.normalization}")
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]  # (megatron's tag on a parameter)
        return norm

    WrappedTorchNorm.__new__ = staticmethod(__new__)
