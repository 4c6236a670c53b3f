"""gloo's all-to-all wants split sizes as Python ints; megatron's alltoall dispatcher passes numpy."""

from __future__ import annotations

UPSTREAM = ("megatron.core.tensor_parallel.mappings:_AllToAll.forward",)
SIGNATURES = {"megatron.core.tensor_parallel.mappings:_AllToAll.forward": ("ctx", "group", "input", "output_split_sizes", "input_split_sizes")}


def apply() -> None:
    """gloo's all_to_all_single wants split sizes as Python ints. megatron's alltoall
    dispatcher computes them as numpy int64 arrays on the host (`.numpy()`), which the
    gloo binding rejects; convert them. NCCL accepts either, so GPU runs never see this."""
    from megatron.core.tensor_parallel import mappings

    original = mappings._AllToAll.forward

    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        as_list = lambda s: None if s is None else [int(x) for x in s]  # noqa: E731
        return original(ctx, group, input, as_list(output_split_sizes), as_list(input_split_sizes))

    mappings._AllToAll.forward = staticmethod(forward)
