"""Joining the torchrun world, with torch.distributed alone.

`join_world` is what every rank does first; the learner's `init_distributed`
(`moe_rl.learner.parallel`) adds megatron-core's patches to it. An engine-only rank of a
separate placement joins here and never imports megatron-core (seconds of start-up, on the
path every step-1 rollout waits for)."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from moe_rl.config import ConfigError
from moe_rl.runtime import worlds as moe_worlds


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (for a private one-process world)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_backend(requested: str = "auto") -> str:
    """parallel.distributed_backend made concrete: "auto" is NCCL with CUDA, gloo without."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ConfigError("parallel.distributed_backend=nccl needs CUDA; use gloo or auto")
    return requested


def join_world(backend: str = "auto", timeout_s: float = 600.0, engine_ranks: int = 0) -> tuple[int, int]:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT); without it, make a one-process world. Idempotent. Returns
    (rank, world) of the torchrun world.

    `engine_ranks` > 0 (separate placement): the last `engine_ranks` ranks host rollout
    engines only. Every rank then joins the bridge world of all ranks
    (`moe_rl.runtime.worlds.BRIDGE_WORLD`), and the learner ranks' default world, megatron's, holds
    only them; an engine-only rank has no default world."""
    if dist.is_initialized() or moe_worlds.BRIDGE_WORLD.initialized:
        with moe_worlds.bridge():
            return dist.get_rank(), dist.get_world_size()
    backend = resolve_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:
        # A plain process: a one-rank world on a private port. Nothing goes into os.environ,
        # so a subprocess started later (a tool, torchrun) does not inherit this world's
        # rendezvous and try to host it again.
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, timeout=timeout)
        return 0, 1
    if not engine_ranks:
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
        return dist.get_rank(), dist.get_world_size()
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    with moe_worlds.BRIDGE_WORLD.enter():
        dist.init_process_group(backend=backend, store=dist.PrefixStore("bridge", store), rank=rank,
                                world_size=world, timeout=timeout)
    if rank < world - engine_ranks:
        dist.init_process_group(backend=backend, store=dist.PrefixStore("learner", store), rank=rank,
                                world_size=world - engine_ranks, timeout=timeout)
    return rank, world
