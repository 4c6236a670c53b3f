"""Where the rollout engines sit in the torchrun world, and how a step's prompts, results
and weights move between ranks.

Colocated (the default): the world is cut into rollout groups of
`sampler.tensor_parallel_size` consecutive ranks; each group runs one engine (a
tensor-parallel shard of it on each of its ranks), so the rollout data-parallel size is
world / rollout TP. Separate: the last `sampler.engine_ranks` ranks are cut into groups
that way and host engines only; the ranks before them train and host none.

Engine e samples a contiguous block of the step's prompts (whole groups of G responses stay
on one engine); the groups' summaries are gathered to every rank, and each training row is
sent (`exchange`, an all-to-all) only to the ranks that train on it. At world 1 this is
one engine sampling everything. Everything here runs in the world of all ranks (`moe_rl.runtime.worlds.bridge`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import torch.distributed as dist

from moe_rl.runtime.collectives import Group, all_gather_object, broadcast_object, exchange_objects
from moe_rl.runtime.worlds import bridge

T = TypeVar("T")


@dataclass(frozen=True)
class EnginePlacement:
    """This rank's place among the rollout engines."""

    world: int
    """Ranks in the torchrun world."""
    rank: int
    """This rank."""
    ranks_per_engine: int
    """Rollout tensor-parallel size."""
    engine_ranks: int = 0
    """Engine-only ranks at the end of the world (separate placement); 0 when colocated."""

    @staticmethod
    def current(ranks_per_engine: int, engine_ranks: int = 0) -> EnginePlacement:
        with bridge():
            if dist.is_initialized():
                return EnginePlacement(dist.get_world_size(), dist.get_rank(), ranks_per_engine, engine_ranks)
        return EnginePlacement(int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")),
                               ranks_per_engine, engine_ranks)

    @property
    def first_engine_rank(self) -> int:
        return self.world - self.engine_ranks if self.engine_ranks else 0

    @property
    def trains(self) -> bool:
        """This rank is a learner rank."""
        return self.rank < self.world - self.engine_ranks

    @property
    def hosts_engine(self) -> bool:
        return self.rank >= self.first_engine_rank

    @property
    def engines(self) -> int:
        """Number of engines (the rollout data-parallel size)."""
        return (self.world - self.first_engine_rank) // self.ranks_per_engine

    @property
    def engine(self) -> int | None:
        """Index of this rank's engine (None on a learner-only rank)."""
        return (self.rank - self.first_engine_rank) // self.ranks_per_engine if self.hosts_engine else None

    @property
    def leader(self) -> bool:
        """The first rank of its engine's group: the one whose results are gathered (the
        group's other ranks return the same tokens)."""
        return self.hosts_engine and (self.rank - self.first_engine_rank) % self.ranks_per_engine == 0

    def share(self, num_prompts: int) -> range:
        """The prompts this rank's engine samples: a contiguous block, sizes differing by at
        most one (the first `num_prompts % engines` engines take one more); none without one."""
        if self.engine is None:
            return range(0)
        base, extra = divmod(num_prompts, self.engines)
        start = self.engine * base + min(self.engine, extra)
        return range(start, start + base + (1 if self.engine < extra else 0))

    def gather(self, mine: T) -> list[T]:
        """Every engine leader's `mine`, in engine order, on every rank (collective)."""
        everyone = self.all_gather(mine if self.leader else None)
        return cast("list[T]", [everyone[self.first_engine_rank + e * self.ranks_per_engine] for e in range(self.engines)])  # (leaders' own)

    def gather_engines(self, mine: T, group: Group) -> list[T]:
        """Every engine leader's `mine`, in engine order, on every engine rank. Collective
        over the engine ranks only (`group`, from `engines_group`; None when every rank hosts
        an engine): under separate placement the learner ranks are not involved."""
        if group is None:
            return self.gather(mine)
        with bridge():
            everyone = all_gather_object(mine if self.leader else None, group=group)
        return cast("list[T]", [everyone[e * self.ranks_per_engine] for e in range(self.engines)])  # (leaders' own)

    def all_engines(self, mine: T, group: Group) -> list[T]:
        """Every engine rank's `mine` (leaders' and the others'), in rank order, on every
        engine rank: what each shard of each engine has to say (its failure). Collective over
        the engine ranks (`group` as in `gather_engines`; None: every rank)."""
        if group is None:
            return self.all_gather(mine)
        with bridge():
            return all_gather_object(mine, group=group)

    def from_engines(self, obj: T) -> T:
        """The first engine rank's `obj` on every rank (collective)."""
        if self.world == 1:
            return obj
        with bridge():
            return broadcast_object(obj, src=self.first_engine_rank)

    def engines_group(self) -> Group:
        """The process group of the engine-only ranks (separate placement; None otherwise).
        Collective over every rank, at the same point on each."""
        if not self.engine_ranks or self.world == 1:
            return None
        with bridge():
            return dist.new_group(list(range(self.first_engine_rank, self.world)))

    def all_gather(self, mine: T) -> list[T]:
        """Every rank's `mine`, in rank order, on every rank (collective)."""
        if self.world == 1:
            return [mine]
        with bridge():
            return all_gather_object(mine)

    def exchange(self, outgoing: list[T]) -> list[T]:
        """All-to-all: `outgoing[r]` goes to rank r; returns what each rank sent here (collective)."""
        if self.world == 1:
            return list(outgoing)
        with bridge():
            return exchange_objects(outgoing)

    def from_rank0(self, obj: T) -> T:
        """Global rank 0's `obj` on every rank (collective)."""
        if self.world == 1:
            return obj
        with bridge():
            return broadcast_object(obj, src=0)

    def group_env(self, group: Group = None) -> dict[str, str]:
        """The environment of this rank's engine world (vLLM's external_launcher reads it):
        the group's own rank and size, and a rendezvous address its leader picked (a fresh
        port, so vLLM's world never shares a store with the trainer's). Collective over every
        rank, or over the engine ranks of `group` (`engines_group`: engines rebuilt alone)."""
        mine = None
        if self.leader:
            single_node = os.environ.get("LOCAL_WORLD_SIZE", str(self.world)) == str(self.world)
            host = "127.0.0.1" if single_node else socket.gethostbyname(socket.getfqdn())
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("", 0))
                mine = (host, sock.getsockname()[1])
        addresses = self.gather_engines(mine, group)
        if self.engine is None:
            return {}
        address = addresses[self.engine]
        assert address is not None  # (its leader's)
        host, port = address
        return {"RANK": str((self.rank - self.first_engine_rank) % self.ranks_per_engine),
                "WORLD_SIZE": str(self.ranks_per_engine), "LOCAL_RANK": os.environ.get("LOCAL_RANK", "0"),
                "MASTER_ADDR": host, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "False"}

    def weights_group(self) -> dist.ProcessGroup:
        """Separate placement: a process group of global rank 0 (which holds the learner's
        full tensors) and the engine ranks, for the weight broadcast. Collective: every rank
        calls it once, at the same point."""
        with bridge():
            return dist.new_group([0, *range(self.first_engine_rank, self.world)])

    def barrier(self) -> None:
        if self.world > 1:
            with bridge():
                dist.barrier()


def concat(parts: Sequence[Sequence[T]]) -> list[T]:
    return [x for part in parts for x in part]
