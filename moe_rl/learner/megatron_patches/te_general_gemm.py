"""megatron-core's router gating linear without Transformer Engine (an undefined name)."""

from __future__ import annotations

UPSTREAM = ("megatron.core.transformer.moe.moe_utils",)


def apply() -> None:
    """megatron-core 0.16 imports `te_general_gemm` inside a try block and never defines the
    name when Transformer Engine is absent, so the router's gating linear raises NameError.
    Its own fallback (plain torch.mm) runs once the name exists and is None."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
