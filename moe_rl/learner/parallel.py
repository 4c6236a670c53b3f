"""Process groups: the torchrun world, and megatron-core's model-parallel layout inside it.

`init_distributed()` joins the world torchrun describes in the environment (or makes a
one-process world when run plainly), once per process. `parallel_layout(cfg)` is a context
manager around megatron-core's global parallel state: it builds the TP/PP/EP/ETP/DP groups
and the model-parallel RNG states on entry and destroys them on exit, so a test can build
several layouts one after another in the same processes.

    init_distributed()
    with parallel_layout(cfg.parallel, seed=1) as layout:
        ... build the model, train ...
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import rerun_state_machine as rerun
from megatron.core import tensor_parallel

from moe_rl.config import ParallelConfig
from moe_rl.learner import megatron_patches
from moe_rl.runtime.process_group import join_world

log = logging.getLogger(__name__)


def init_distributed(backend: str = "auto", timeout_s: float = 600.0, engine_ranks: int = 0) -> tuple[int, int]:
    """`moe_rl.runtime.process_group.join_world` (the torchrun world, or a one-process one;
    idempotent; `engine_ranks`: the separate placement's worlds) for a process that runs the
    learner: megatron-core's patches (its CPU shims when CUDA is absent) are applied first.
    Returns (rank, world) of the torchrun world."""
    megatron_patches.apply()
    return join_world(backend, timeout_s, engine_ranks)


def comm_device() -> torch.device:
    """Where collective payloads must live: the current GPU under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wait_for_device() -> None:
    """Wait until the device has run everything queued so far (copies to the host made
    without waiting included): once per pass, before the host reads what those copied."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def all_reduce_(t: torch.Tensor, op: Any = None, group: Any = None) -> torch.Tensor:
    """In-place all-reduce of a host tensor of any backend's liking (moved and back if needed)."""
    dev = comm_device()
    buf = t if t.device == dev else t.to(dev)
    dist.all_reduce(buf, op=op or dist.ReduceOp.SUM, group=group)
    if buf is not t:
        t.copy_(buf)
    return t


@dataclass(frozen=True)
class Layout:
    """Where this rank sits in the model-parallel layout (read from megatron's state)."""

    tp: int
    pp: int
    ep: int
    etp: int
    dp: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_rank: int
    sequence_parallel: bool

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def name(self) -> str:
        return f"tp{self.tp}-pp{self.pp}-ep{self.ep}-etp{self.etp}-dp{self.dp}"


def sequence_parallel_for(cfg: ParallelConfig) -> bool:
    """Megatron requires sequence parallel for MoE layers with TP>1. Unset means: switch it
    on under TP (with a log line); an explicit false under TP was refused by config checks."""
    if cfg.tensor_model_parallel_size == 1:
        return False
    if cfg.sequence_parallel is None:
        log.info("tensor parallel with MoE: enabling sequence parallel (megatron-core needs it)")
    return True


@contextlib.contextmanager
def parallel_layout(cfg: ParallelConfig, seed: int = 1234) -> Iterator[Layout]:
    """Initialise megatron-core's parallel state for `cfg` and tear it down on exit."""
    if not dist.is_initialized():
        raise RuntimeError("call init_distributed() before parallel_layout()")
    if ps.model_parallel_is_initialized():
        raise RuntimeError("a parallel layout is already active in this process; exit it first")
    from moe_rl.config import Config, validate_layout

    world = dist.get_world_size()
    validate_layout(Config(parallel=cfg), world)
    before = set(dist.distributed_c10d._world.pg_map)  # (megatron's groups are those added by its initialisation)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
    )
    # megatron's schedules consult a global "rerun state machine" (fault-injection /
    # result-validation replays); owned here, disabled, and torn down with the layout.
    rerun.initialize_rerun_state_machine(mode=rerun.RerunMode.DISABLED)
    megatrons = [g for g in dist.distributed_c10d._world.pg_map if g not in before]
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        _layout_seed[:] = [seed]
        yield Layout(
            tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(),
            etp=ps.get_expert_tensor_parallel_world_size(),
            dp=ps.get_data_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            sequence_parallel=sequence_parallel_for(cfg),
        )
    finally:
        _layout_seed.clear()
        ps.destroy_model_parallel()
        rerun.destroy_rerun_state_machine()
        _destroy_groups(megatrons)


def _destroy_groups(groups: list) -> None:
    """Destroy the process groups megatron created for the layout: `destroy_model_parallel`
    only forgets them, while torch keeps every group (and each gloo group's transport
    threads, which poll) until it is destroyed; a process that enters many layouts (the
    tests, a tool) piled up 51 threads per layout, which took CPU from everything else.
    Only megatron's own groups, and only those of the world installed now (another world
    swapped in, `moe_rl.runtime.worlds`, keeps its own)."""
    live = dist.distributed_c10d._world.pg_map
    for group in groups:
        if group in live:
            dist.destroy_process_group(group)


_layout_seed: list[int] = []  # the active layout's seed


def active_seed() -> int:
    """The active parallel_layout()'s seed (0 outside one)."""
    return _layout_seed[0] if _layout_seed else 0


def graph_safe_rng() -> None:
    """megatron's CUDA RNG tracker in its graph-safe form (megatron's CUDA graphs refuse the
    other), re-seeded with the active layout's seed; nothing when it is graph-safe already
    (the form then stays for the process)."""
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        is_graph_safe_cuda_rng_tracker,
    )

    if is_graph_safe_cuda_rng_tracker(get_cuda_rng_tracker()):
        return
    if not _layout_seed:
        raise RuntimeError("CUDA graphs need an active parallel_layout() (its seed seeds the graph-safe RNG)")
    tensor_parallel.model_parallel_cuda_manual_seed(_layout_seed[0], use_cudagraphable_rng=True, force_reset_rng=True)
