"""Launch multi-process test workers as torchrun worlds (gloo on CPU), with the variables
torchrun gives the learner's ranks; the ranks are forked from the preloaded zygote
(`moe_rl_testing.forked`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from moe_rl_testing import ROOT, forked

WORKERS = Path(__file__).resolve().parent / "workers"


def torchrun(worker: str, nproc: int, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run moe_rl_testing/workers/<worker> (or the script at an absolute path) as a torchrun
    world of `nproc` processes; raise with the workers' output if it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # (this checkout's moe_rl)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "moe_rl_testing.worker_main", str(WORKERS / worker), *args]
    proc = forked.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode})\n--- stdout\n{proc.stdout[-6000:]}\n"
            f"--- stderr\n{proc.stderr[-12000:]}"
        )
    return proc


# torchrun's variables: without them init_distributed makes a private one-process world
# (TORCHELASTIC_USE_AGENT_STORE would make that world's store a client of a host nobody runs).
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


@contextlib.contextmanager
def plain_process() -> Iterator[None]:
    """In a torchrun worker: this process as a plain one-process run, so that one launch can
    do a 1-process part on rank 0 (while the other ranks wait to join the torchrun world)
    before its multi-process part. torchrun's variables are hidden (init_distributed then
    makes a private one-rank world, as a plain `python` run gets); on exit the world made
    inside is torn down and the variables are back."""
    import torch.distributed as dist

    hidden = {k: os.environ.pop(k) for k in TORCHRUN_ENV if k in os.environ}
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.update(hidden)


def one_process_then_world(out: str, reference: Callable[[], object], layouts: Callable[[], object],
                           world_size: int) -> None:
    """In a torchrun worker: rank 0 runs `reference()` as a plain one-process run (saved to
    <out>/reference.pt) while the other ranks wait to join the world, then every rank runs
    `layouts()` (rank 0 saves it to <out>/layouts.pt): one launch where a 1-process launch
    and a multi-process one were two (a process start is ~9 s on the 2-core machine)."""
    import torch
    import torch.distributed as dist

    from moe_rl.learner.parallel import init_distributed

    alone_on_rank0(reference, f"{out}/reference.pt")
    rank, world = init_distributed()  # the other ranks wait here for rank 0's one-process part
    assert world == world_size, f"launched with {world} processes, the layouts need {world_size}"
    result = layouts()
    if rank == 0:
        torch.save(result, f"{out}/layouts.pt")
    dist.barrier()
    dist.destroy_process_group()


def alone_on_rank0(run: Callable[[], object], path: str) -> None:
    """In a torchrun worker: on rank 0 only, `run()` as a plain one-process run (its own
    one-rank world, gone after), its result saved to `path`; other ranks do nothing."""
    import torch

    from moe_rl.learner.parallel import init_distributed

    if os.environ["RANK"] == "0":
        with plain_process():
            assert init_distributed() == (0, 1)
            torch.save(run(), path)
