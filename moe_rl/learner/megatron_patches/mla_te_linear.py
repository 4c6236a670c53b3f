"""megatron-core's multi-latent attention without Transformer Engine (its `TELinear` check)."""

from __future__ import annotations

UPSTREAM = ("megatron.core.transformer.multi_latent_attention:TELinear",)


class _NoTELinear:
    """Stands in for Transformer Engine's TELinear where TE is absent: nothing is one."""


def apply() -> None:
    """megatron-core 0.16's MLA module tests `isinstance(linear_proj, TELinear)` when its
    import of the TE extension succeeded, which it does without TE too, with TELinear a
    MagicMock stand-in that isinstance rejects (TypeError). Point the name at a class no
    module is an instance of (only when it is not a real class)."""
    import megatron.core.transformer.multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):
        mla.TELinear = _NoTELinear
