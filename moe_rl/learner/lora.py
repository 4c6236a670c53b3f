"""LoRA adapters on megatron's linear layers, and frozen parameter groups (`model.lora`,
`model.freeze`; docs/lora.md).

An adapted linear keeps its frozen weight W and gains two parameters, `lora_A` [r, in] and
`lora_B` [out, r], registered on the linear itself (so every name, checkpoint key and
expert-parallel rule of the linear covers them); a forward hook adds

    y = W x + (alpha / r) B A dropout(x)

B starts at zero (the adapted model starts as the base), A is drawn from a generator seeded
by the layer's global name, so the full A is the same at every layout. Sharding follows the
base weight:
- column-parallel (q/k/v, an MLP's fused gate+up `linear_fc1`): A replicated, B split on
  its output rows as W is (fc1's B keeps megatron's [gate shard; up shard] layout, saved
  through the same swiglu factory as W). The low-rank activation A x is gathered over the
  sequence (megatron's MoE runs sequence parallel under TP), as the base's input is;
- row-parallel (the attention output, an MLP's `linear_fc2`): A split on its input columns
  as W is, B replicated; the rank-r partial sums A x are reduce-scattered over TP as the
  base's output is;
- experts (`explicit_expert_comm`: the token dispatcher moves the tokens and reduces the
  outputs): no communication in the forward; under expert-TP the replicated factor's
  gradient is all-reduced over the expert-TP group. Expert adapters are expert parameters:
  reduced over the expert-data-parallel group (`allreduce=False`) and stored with their
  expert's global index under EP.
Replicated factors whose gradient is a per-sequence-shard partial sum carry megatron's
`sequence_parallel` flag, so `finalize_model_grads` all-reduces them over TP.

Frozen parameters have `requires_grad=False`: megatron's DDP gives them no gradient buffer
and its optimizer no state.
"""

from __future__ import annotations

import math
import types
import zlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLP, apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from moe_rl.config import ConfigError, ModelConfig
from moe_rl.convert.lora_merge import is_lora_name

FREEZE_PATTERNS = {
    "router": (".mlp.router.",),
    "embeddings": ("embedding.",),
    "output_head": ("output_layer.",),
    "attention": (".self_attention.",),
    "experts": (".mlp.experts.",),
}
"""`model.freeze` group -> substrings of the parameter names it covers."""


def _targets(layer: torch.nn.Module, modules: tuple[str, ...]) -> Iterator[tuple[str, str, torch.nn.Module]]:
    """(module group, name inside the layer, linear) of each linear of one transformer layer
    that `model.lora.modules` adapts."""
    for name, mod in layer.named_modules():
        if not isinstance(mod, ColumnParallelLinear | RowParallelLinear):
            continue
        if name.startswith("self_attention."):
            group = "attention"
        elif name.startswith("mlp.experts."):
            group = "experts"
        elif name.startswith("mlp.shared_experts."):
            group = "shared_experts"
        elif name in ("mlp.linear_fc1", "mlp.linear_fc2"):
            group = "dense_mlp"
        else:
            continue
        if group in modules:
            yield group, name, mod


def _global_name(layer: torch.nn.Module, name: str, experts_offset: int) -> str:
    """The adapter's layout-independent name: global layer number, global expert index."""
    parts = name.split(".")
    if "local_experts" in parts:
        i = parts.index("local_experts") + 1
        parts[i] = str(int(parts[i]) + experts_offset)
    return f"layer{layer.layer_number}." + ".".join(parts)


def _initial_a(rank: int, fan_in: int, seed_name: str, seed: int) -> torch.Tensor:
    """The full A [rank, fan_in]: PEFT's kaiming-uniform (a=sqrt(5)), bound 1/sqrt(fan_in),
    from a generator seeded by the adapter's global name."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(seed_name.encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1) * bound


def _tp(linear: torch.nn.Module) -> tuple[int, int]:
    g = cast(dist.ProcessGroup, linear.tp_group)  # (the TP group megatron's linears keep)
    return g.size(), g.rank()


def _tag(param: torch.nn.Parameter, **attrs: object) -> None:
    """Set megatron's attributes on a parameter (`sequence_parallel`, `tensor_model_parallel`,
    `partition_dim`, ...), which torch's `Parameter` type does not declare."""
    for name, value in attrs.items():
        setattr(param, name, value)


def _bind(module: torch.nn.Module, name: str, fn: Callable[..., Any]) -> None:
    """Replace the method `name` of this one `module` by `fn` bound to it."""
    setattr(module, name, types.MethodType(fn, module))


def _add_adapter(linear: torch.nn.Module, rank: int, seed_name: str, seed: int, expert: bool) -> None:
    """Register lora_A / lora_B on `linear`, sharded as its weight is."""
    w = linear.weight
    assert isinstance(w, torch.Tensor)
    tp, tp_rank = _tp(linear)
    column = isinstance(linear, ColumnParallelLinear)
    if column and getattr(linear, "gather_output", False) and tp > 1:
        raise ConfigError(f"model.lora: {seed_name} gathers its output over TP, which the adapters do not "
                          "support; leave its module out of model.lora.modules")
    fan_in = cast(int, linear.input_size)  # (megatron's linears: the full input size, an int)
    full_a = _initial_a(rank, fan_in, seed_name, seed)
    if column:
        a = full_a
        b = torch.zeros(w.shape[0], rank, dtype=torch.float64)
    else:
        per = fan_in // tp
        a = full_a[:, tp_rank * per:(tp_rank + 1) * per]
        b = torch.zeros(w.shape[0], rank, dtype=torch.float64)
    lora_a = linear.lora_A = torch.nn.Parameter(a.to(dtype=w.dtype, device=w.device).contiguous())
    lora_b = linear.lora_B = torch.nn.Parameter(b.to(dtype=w.dtype, device=w.device))
    sp = bool(linear.sequence_parallel) and not linear.explicit_expert_comm and tp > 1
    replicated = lora_a if column else lora_b
    _tag(replicated, sequence_parallel=sp)  # its gradient: a partial sum over this rank's sequence shard
    for p in (lora_a, lora_b):
        _tag(p, tensor_model_parallel=p is not replicated, partition_dim=0 if column else 1, partition_stride=1)
        if expert:
            _tag(p, allreduce=False)  # expert parameters: reduced over expert-DP (model._reduce_expert_grads_over_expert_dp)


def _lora_delta(linear: torch.nn.Module, x: torch.Tensor, scale: float, dropout: float) -> torch.Tensor:
    """(alpha / r) B A dropout(x), in the layout of the linear's output (before its bias)."""
    tp, _ = _tp(linear)
    column = isinstance(linear, ColumnParallelLinear)
    a, b = linear.lora_A, linear.lora_B
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if dropout:
        x = F.dropout(x, dropout, training=linear.training)
    if linear.explicit_expert_comm or tp == 1:
        if tp > 1:  # expert-TP: the replicated factor's gradient is a partial sum over the expert-TP group
            if column:
                a = copy_to_tensor_model_parallel_region(a, group=linear.tp_group)
            else:
                b = copy_to_tensor_model_parallel_region(b, group=linear.tp_group)
        return F.linear(F.linear(x, a), b) * scale
    if not linear.sequence_parallel:  # (megatron's MoE needs sequence parallelism under TP)
        raise ConfigError("model.lora under tensor parallelism needs sequence parallelism "
                          "(parallel.sequence_parallel=true)")
    h = F.linear(x, a)
    if column:  # the rank-r activation gathered over the sequence, as the base's input is
        return F.linear(gather_from_sequence_parallel_region(h, group=linear.tp_group), b) * scale
    # partial sums over this rank's input columns, reduce-scattered as the base's output is
    return F.linear(reduce_scatter_to_sequence_parallel_region(h, group=linear.tp_group), b) * scale


def _hook(scale: float, dropout: float):
    def hook(linear: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        out, bias = output
        return out + _lora_delta(linear, args[0], scale, dropout).to(out.dtype), bias
    return hook


def _linear_sharded_state_dict(self: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (),
                               metadata: dict | None = None) -> dict:
    """The linear's own sharded state dict with its adapters sharded as its weight is."""
    column = isinstance(self, ColumnParallelLinear)
    axes = {"weight": 0, "bias": 0, "lora_B": 0} if column else {"weight": 1, "lora_A": 1}
    return make_sharded_tensors_for_checkpoint(
        self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
        tp_group=self.tp_group, dp_cp_group=(metadata or {})["dp_cp_group"])


def _mlp_sharded_state_dict(original):
    """An MLP's sharded state dict with fc1's B split into gate and up halves as fc1's weight
    is (megatron's swiglu factory), so it reloads and exports at any TP."""
    def sharded_state_dict(self: MLP, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        sd = original(prefix, sharded_offsets, metadata)
        key = f"{prefix}linear_fc1.lora_B"
        if key in sd and self.config.gated_linear_unit:
            singleton = (metadata or {}).get("singleton_local_shards", False)
            sd[key] = apply_swiglu_sharded_factory(sd[key], sharded_offsets, singleton)
        return sd
    return sharded_state_dict


def apply_lora(gpt: torch.nn.Module, model: ModelConfig, seed: int) -> int:
    """Add the adapters `model.lora` asks for to this rank's stage of `gpt` (before DDP);
    returns how many linears were adapted on this rank."""
    lora = model.lora
    if not lora.enabled:
        return 0
    n = 0
    decoder = getattr(gpt, "decoder", None)
    for layer in (decoder.layers if decoder is not None else []):
        experts = getattr(layer.mlp, "experts", None)
        offset = 0
        if experts is not None and hasattr(experts, "ep_group"):
            offset = experts.ep_group.rank() * experts.num_local_experts
        for group, name, linear in list(_targets(layer, lora.modules)):
            if linear.weight is None:
                continue
            _add_adapter(linear, lora.rank, _global_name(layer, name, offset), seed, group == "experts")
            linear.register_forward_hook(_hook(lora.scale, lora.dropout))
            _bind(linear, "sharded_state_dict", _linear_sharded_state_dict)
            parent = layer.get_submodule(name.rsplit(".", 1)[0])
            if name.endswith("linear_fc1") and not getattr(parent, "_lora_fc1_factory", False):
                _bind(parent, "sharded_state_dict", _mlp_sharded_state_dict(parent.sharded_state_dict))
                parent._lora_fc1_factory = True
            n += 1
    return n


def freeze(gpt: torch.nn.Module, model: ModelConfig) -> None:
    """Turn off the gradient of every frozen parameter: with LoRA every base weight, and the
    parameters of each `model.freeze` group (adapters in a frozen group included)."""
    patterns = [p for g in model.freeze for p in FREEZE_PATTERNS[g]]
    for name, param in gpt.named_parameters():
        if (model.lora.enabled and not is_lora_name(name)) or any(p in name for p in patterns):
            param.requires_grad_(False)


def trainable_parameters(gpt: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of what trains on this rank."""
    return [(n, p) for n, p in gpt.named_parameters() if p.requires_grad]
