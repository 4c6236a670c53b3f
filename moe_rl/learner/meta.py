"""The learner's model at any rank of any layout, built on the meta device in one process.

The planner (`moe_rl.plan`) asks how many parameters, gradient-buffer elements and
optimizer-state elements each rank of a layout holds. Rather than a formula, it gets them
from the learner's own code: megatron's parallel state is initialised as rank r of N on
torch's `fake` process-group backend (collectives do nothing, group memberships are real),
`transformer_config` / `build_gpt` / `wrap_ddp` build that rank's shard and megatron's DDP
grad buffers, and every tensor lands on the meta device (shapes, no memory). One build per
pipeline stage is enough: within a stage every rank holds the same shapes (TP and EP shards
are equal by construction; megatron requires the divisibility), so "distinct ranks" are
the stages.

    ranks = build_meta_ranks(cfg.model, cfg.parallel, world=16)   # one MetaRank per stage
    totals = model_param_counts(cfg.model, cfg.parallel)          # whole model, by kind

Shapes are the local layer spec's; the Transformer Engine spec (GPU) holds the same tensors
(its fused norm+linear keeps the norm weight as `layer_norm_weight`), so counts are the
same, while dtypes of norm weights may differ (fp32 here, a few hundred thousand elements).
Needs a process without a process group (the fake world is the default group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch.overrides import TorchFunctionMode

from moe_rl.config import ModelConfig, ParallelConfig
from moe_rl.config.model import GPU_ONLY_DEFAULTS
from moe_rl.convert.lora_merge import is_lora_name
from moe_rl.learner import megatron_patches
from moe_rl.learner.lora import apply_lora, freeze
from moe_rl.learner.model import build_gpt, transformer_config, wrap_ddp
from moe_rl.learner.parallel import parallel_layout

META = torch.device("meta")

# Parameter kinds, by megatron name; `active` counts all but the unrouted experts.
KINDS = ("embedding", "output", "attention", "norms", "router", "shared_experts", "dense_mlp",
         "routed_experts", "other")


def param_kind(name: str) -> str:
    """The kind of a megatron parameter, from its name (local or TE spec)."""
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("output_layer."):
        return "output"
    if "layernorm" in name or "layer_norm" in name:
        return "norms"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp.router." in name:
        return "router"
    if ".self_attention." in name:
        return "attention"
    if ".mlp.linear_fc" in name:
        return "dense_mlp"
    return "other"


@dataclass(frozen=True)
class Groups:
    """Global ranks of each process group this rank belongs to (megatron's own groups)."""

    tp: tuple[int, ...]
    pp: tuple[int, ...]
    ep: tuple[int, ...]
    etp: tuple[int, ...]
    dp: tuple[int, ...]
    """Dense data-parallel group (gradient reduction of non-expert weights)."""
    expert_dp: tuple[int, ...]
    """Expert data-parallel group (gradient reduction of expert weights)."""


@dataclass(frozen=True)
class BufferShard:
    """One megatron DDP grad buffer of this rank, and the distributed optimizer's view of it."""

    expert: bool
    param_bytes_per_elem: int
    grad_elem_bytes: int
    """Gradient dtype size (fp32: the learner reduces gradients in fp32)."""
    grad_bytes: int
    """grad_data: numel (padded for the distributed optimizer) x grad dtype size."""
    param_buffer_bytes: int
    """param_data: under the distributed optimizer params are moved into a padded buffer."""
    params_numel: int
    """Parameter elements in the buffer (no padding)."""
    low_precision_numel: int
    """Of those, elements of non-fp32 params (the optimizer keeps an fp32 main copy of these)."""
    shard_numel: int
    """Distributed optimizer: the most parameter elements any data-parallel rank owns."""
    shard_low_precision_numel: int
    """Distributed optimizer: the most non-fp32 parameter elements any data-parallel rank owns."""


@dataclass(frozen=True)
class MetaRank:
    """What one rank (and every rank of its pipeline stage) holds, counted by megatron."""

    rank: int
    """The global rank that was built."""
    stage_ranks: tuple[int, ...]
    """Every global rank of this pipeline stage (same shapes)."""
    pp_rank: int
    groups: Groups
    params_by_kind: dict[str, int]
    """Parameter elements by kind (`KINDS`)."""
    param_bytes: int
    """Parameter bytes as built (params dtype; norm weights may be fp32)."""
    num_layers: int
    num_moe_layers: int
    buffers: tuple[BufferShard, ...]
    """megatron's DDP buffers, laid out for the distributed optimizer (padded); without it
    megatron does not pad, so `params_numel` is the buffer size then. They hold only what
    trains (with LoRA: the adapters)."""
    adapter_params: int = 0
    """LoRA adapter elements on this rank (`model.lora`; not in `params_by_kind`)."""
    frozen_param_bytes: int = 0
    """Bytes of this rank's frozen parameters (LoRA's base, `model.freeze`): outside the DDP
    buffers, no gradient, no optimizer state."""

    @property
    def params(self) -> int:
        return sum(self.params_by_kind.values())


# --------------------------------------------------------------------------- the fake world


class _OnMeta(TorchFunctionMode):
    """Every tensor megatron makes lands on the meta device, whatever device it names
    (megatron allocates grad buffers and CUDA-path weights on an explicit device)."""

    _FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.empty_strided,
                            torch.tensor, torch.arange, torch.randn, torch.rand})

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in self._FACTORIES:
            kwargs["device"] = META
        elif func in (torch.Tensor.cuda, torch.Tensor.cpu) and args[0].device == META:
            return args[0]
        elif func is torch.Tensor.to and args[0].device == META:
            dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
            return args[0] if dtype in (None, args[0].dtype) else func(args[0], dtype=dtype)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process as rank `rank` of `world` on the fake backend (no communication).
    megatron also makes gloo groups (CPU side channels); they are made fake too."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():
        raise RuntimeError("the meta-device build needs a process without a process group "
                           "(it joins a fake world); run the planner in its own process")
    excepthook = sys.excepthook  # init_process_group prefixes it with "[rank r]"; undone below
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    real_new_group = dist.new_group

    def new_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = None
        return real_new_group(*args, **kwargs)

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = real_new_group
        dist.destroy_process_group()
        sys.excepthook = excepthook


def _local_spec(model: ModelConfig) -> ModelConfig:
    """The model with the local layer spec, no fp8 and no GPU-only settings: the same parameter
    shapes as the TE spec, buildable without CUDA / Transformer Engine."""
    return dataclasses.replace(model, layer_spec="local", fp8="none", **GPU_ONLY_DEFAULTS)


@contextlib.contextmanager
def _cpu_path() -> Iterator[None]:
    """transformer_config / build_gpt take the CPU path (host init, no `.cuda()`), also on a
    GPU machine: the build must touch no device. (megatron's CPU shims only where CUDA is
    absent, as the learner applies them.)"""
    megatron_patches.apply()
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: False
    try:
        yield
    finally:
        torch.cuda.is_available = real


# --------------------------------------------------------------------------- one rank


def _group(get: Callable[[], Any]) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(get()))


def _groups() -> Groups:
    return Groups(
        tp=_group(ps.get_tensor_model_parallel_group),
        pp=_group(ps.get_pipeline_model_parallel_group),
        ep=_group(ps.get_expert_model_parallel_group),
        etp=_group(ps.get_expert_tensor_parallel_group),
        dp=_group(ps.get_data_parallel_group),
        expert_dp=_group(ps.get_expert_data_parallel_group),
    )


def _shard_numel(buffer: Any, low_precision: bool) -> int:
    """The most parameter elements one data-parallel rank owns under megatron's distributed
    optimizer: each bucket [start, end) is cut into dp equal ranges (end - start is a
    multiple of dp, megatron pads it so), and a rank owns the parameter elements in its range
    (the optimizer's main params and Adam states are exactly those)."""
    dp = buffer.data_parallel_world_size
    owned = [0] * dp
    spans = [(start, end, bucket) for p, (start, end, bucket) in buffer.param_index_map.items()
             if not low_precision or p.dtype != torch.float32]
    for bucket_id, (b_start, b_end) in enumerate(buffer.bucket_indices):
        size = (b_end - b_start) // dp
        for r in range(dp):
            lo, hi = b_start + r * size, b_start + (r + 1) * size
            owned[r] += sum(max(0, min(hi, e) - max(lo, s)) for s, e, b in spans if b == bucket_id)
    return max(owned)


def _buffer_shard(buffer: Any, expert: bool) -> BufferShard:
    params = list(buffer.param_index_map)
    low = [p for p in params if p.dtype != torch.float32]
    return BufferShard(
        expert=expert,
        param_bytes_per_elem=torch.empty((), dtype=buffer.param_dtype, device=META).element_size(),
        grad_elem_bytes=buffer.grad_data.element_size(),
        grad_bytes=buffer.grad_data.numel() * buffer.grad_data.element_size(),
        param_buffer_bytes=buffer.param_data.numel() * buffer.param_data.element_size(),
        params_numel=sum(p.numel() for p in params),
        low_precision_numel=sum(p.numel() for p in low),
        shard_numel=_shard_numel(buffer, False),
        shard_low_precision_numel=_shard_numel(buffer, True),
    )


def _build_rank(model: ModelConfig, parallel: ParallelConfig, rank: int, world: int) -> MetaRank:
    model = _local_spec(model)
    with _cpu_path(), fake_world(rank, world), parallel_layout(parallel, seed=0) as layout:
        tcfg = transformer_config(model, parallel)
        tcfg.perform_initialization = False  # values are not needed, and meta has none
        with torch.device(META), _OnMeta():
            gpt = build_gpt(model, tcfg)
            apply_lora(gpt, model, seed=0)
            freeze(gpt, model)
            ddp = wrap_ddp(gpt, tcfg, distributed_optimizer=True)  # both variants' sizes from one layout
        by_kind = dict.fromkeys(KINDS, 0)
        layers, moe_layers = set(), set()
        adapters = 0
        for name, p in gpt.named_parameters():
            if is_lora_name(name):
                adapters += p.numel()
                continue
            by_kind[param_kind(name)] += p.numel()
            if name.startswith("decoder.layers."):
                layer = int(name.split(".")[2])
                layers.add(layer)
                if ".mlp.router." in name:
                    moe_layers.add(layer)
        buffers = tuple(_buffer_shard(b, False) for b in ddp.buffers) + tuple(
            _buffer_shard(b, True) for b in ddp.expert_parallel_buffers)
        per_stage = world // layout.pp
        return MetaRank(
            rank=rank,
            stage_ranks=tuple(range(layout.pp_rank * per_stage, (layout.pp_rank + 1) * per_stage)),
            pp_rank=layout.pp_rank,
            groups=_groups(),
            params_by_kind=by_kind,
            param_bytes=sum(p.numel() * p.element_size() for p in gpt.parameters()),
            num_layers=len(layers),
            num_moe_layers=len(moe_layers),
            buffers=buffers,
            adapter_params=adapters,
            frozen_param_bytes=sum(p.numel() * p.element_size() for p in gpt.parameters() if not p.requires_grad),
        )


def build_meta_ranks(model: ModelConfig, parallel: ParallelConfig, world: int) -> list[MetaRank]:
    """One MetaRank per pipeline stage of `model` laid out as `parallel` at world size `world`.

    megatron's default rank order ("tp-cp-ep-dp-pp") puts the pipeline stage outermost, so
    stage s is global ranks [s * world/pp, (s+1) * world/pp); the first of them is built
    (and megatron's own pipeline rank of it is checked)."""
    pp = parallel.pipeline_model_parallel_size
    out = []
    for stage in range(pp):
        built = _build_rank(model, parallel, stage * (world // pp), world)
        if built.pp_rank != stage:
            raise RuntimeError(f"rank {built.rank} is pipeline stage {built.pp_rank}, expected {stage}")
        out.append(built)
    return out


def model_param_counts(model: ModelConfig, parallel: ParallelConfig) -> dict[str, int]:
    """Parameter elements of the whole model by kind, from one build at TP=1, PP=1 and
    `parallel`'s EP (routed experts x EP: megatron splits them evenly), so nothing is counted
    twice (a tied output head is the embedding at PP=1) and the build stays small."""
    ep = parallel.expert_model_parallel_size
    ref = ParallelConfig(expert_model_parallel_size=ep, micro_batch_size=parallel.micro_batch_size)
    (rank,) = build_meta_ranks(model, ref, world=ep)
    counts = dict(rank.params_by_kind)
    counts["routed_experts"] *= ep
    return counts
