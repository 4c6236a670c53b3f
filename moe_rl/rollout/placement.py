"""Where the rollout engines sit in the torchrun world, and how a step's prompts and
results move between them.

The world is cut into rollout groups of `sampler.tensor_parallel_size` consecutive ranks;
each group runs one engine (a tensor-parallel shard of it on each of its ranks), so the
rollout data-parallel size is world / rollout TP. Engine e samples a contiguous block of
the step's prompts (whole groups of G responses stay on one engine); the blocks are then
gathered so that every rank holds every scored group, in prompt order, and builds the
same training batch. At world 1 this is one engine sampling everything.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class EnginePlacement:
    """This rank's place among the rollout engines."""

    world: int
    """Ranks in the torchrun world."""
    rank: int
    """This rank."""
    ranks_per_engine: int
    """Rollout tensor-parallel size."""

    @staticmethod
    def current(ranks_per_engine: int) -> EnginePlacement:
        if dist.is_initialized():
            return EnginePlacement(dist.get_world_size(), dist.get_rank(), ranks_per_engine)
        return EnginePlacement(int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")),
                               ranks_per_engine)

    @property
    def engines(self) -> int:
        """Number of engines (the rollout data-parallel size)."""
        return self.world // self.ranks_per_engine

    @property
    def engine(self) -> int:
        """Index of this rank's engine."""
        return self.rank // self.ranks_per_engine

    @property
    def leader(self) -> bool:
        """The first rank of its engine's group: the one whose results are gathered (the
        group's other ranks return the same tokens)."""
        return self.rank % self.ranks_per_engine == 0

    def share(self, num_prompts: int) -> range:
        """The prompts this rank's engine samples: a contiguous block, sizes differing by at
        most one (the first `num_prompts % engines` engines take one more)."""
        base, extra = divmod(num_prompts, self.engines)
        start = self.engine * base + min(self.engine, extra)
        return range(start, start + base + (1 if self.engine < extra else 0))

    def gather(self, mine: Any) -> list[Any]:
        """Every engine leader's `mine`, in engine order, on every rank (collective)."""
        if self.world == 1:
            return [mine]
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine if self.leader else None)
        return [everyone[e * self.ranks_per_engine] for e in range(self.engines)]

    def group_env(self) -> dict[str, str]:
        """The environment of this rank's engine world (vLLM's external_launcher reads it):
        the group's own rank and size, and a rendezvous address its leader picked (a fresh
        port, so vLLM's world never shares a store with the trainer's). Collective."""
        mine = None
        if self.leader:
            single_node = os.environ.get("LOCAL_WORLD_SIZE", str(self.world)) == str(self.world)
            host = "127.0.0.1" if single_node else socket.gethostbyname(socket.getfqdn())
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("", 0))
                mine = (host, sock.getsockname()[1])
        host, port = self.gather(mine)[self.engine]
        return {"RANK": str(self.rank % self.ranks_per_engine), "WORLD_SIZE": str(self.ranks_per_engine),
                "LOCAL_RANK": os.environ.get("LOCAL_RANK", "0"), "MASTER_ADDR": host, "MASTER_PORT": str(port),
                "TORCHELASTIC_USE_AGENT_STORE": "False"}

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def concat(parts: Sequence[Sequence[Any]]) -> list[Any]:
    return [x for part in parts for x in part]
