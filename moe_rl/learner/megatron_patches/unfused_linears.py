"""megatron's own linears built without apex when gradient-accumulation fusion is on (GPU)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

UPSTREAM = ("megatron.core.tensor_parallel.layers:_grad_accum_fusion_available",
            "megatron.core.tensor_parallel.layers:ColumnParallelLinear.__init__",
            "megatron.core.tensor_parallel.layers:RowParallelLinear.__init__")


@contextlib.contextmanager
def allowed(tcfg: Any) -> Iterator[None]:
    """With `gradient_accumulation_fusion`, Transformer Engine's linears accumulate their
    weight gradients into `main_grad` themselves; megatron's own linears (the output layer)
    need apex's `fused_weight_gradient_mlp_cuda` for it and refuse to build without it.
    Without apex they are built anyway and keep the unfused path (the chunked head computes
    its own logits from the output weight, so its gradient takes that path regardless)."""
    from megatron.core.tensor_parallel import layers

    if not tcfg.gradient_accumulation_fusion or layers._grad_accum_fusion_available:
        yield
        return
    classes = (layers.ColumnParallelLinear, layers.RowParallelLinear)
    real_inits = [cls.__init__ for cls in classes]
    built: list[Any] = []

    def recorded(real_init: Any) -> Any:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            real_init(self, *args, **kwargs)
            built.append(self)
        return init

    layers._grad_accum_fusion_available = True
    for cls, real_init in zip(classes, real_inits):
        cls.__init__ = recorded(real_init)
    try:
        yield
    finally:
        layers._grad_accum_fusion_available = False
        for cls, real_init in zip(classes, real_inits):
            cls.__init__ = real_init
        for linear in built:
            linear.gradient_accumulation_fusion = False
