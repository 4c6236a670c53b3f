"""Keep an in-process vLLM engine and the trainer in separate torch.distributed worlds.

vLLM's worker calls `torch.distributed.init_process_group` unless a default group already
exists, and then treats that group as its own world. Inside a torchrun rank the existing
group is the trainer's: vLLM would run its start-up collectives over the trainer's ranks
and deadlock (the other ranks are not constructing a sampler). On shutdown it calls
`destroy_process_group()`, which tears down *every* group of the process, megatron's
included.

`SeparateWorlds` keeps two snapshots of c10d's global registry (default group, group
maps, naming counter) and swaps them in and out around every call into vLLM, so vLLM only
ever sees (and creates, and destroys) its own single-rank world, and the trainer only
ever sees its own. The swap is a handful of attribute assignments; there are no
collectives. Not thread-safe: call vLLM from one thread, as the trainer does anyway.

vLLM's groups are named from `_VLLM_GROUP_NAME_BASE` up so that their names in torch's
C++ group registry (shared by both worlds) cannot collide with the trainer's "0", "1", ...
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed.distributed_c10d as c10d

log = logging.getLogger(__name__)

_VLLM_GROUP_NAME_BASE = 1 << 20

# Module-level registries of torch.distributed_c10d that make up "the world".
_GLOBALS = (
    "_pg_map",
    "_pg_names",
    "_pg_group_ranks",
    "_pg_backend_config",
    "_tags_to_pg",
    "_pg_to_tag",
    "_group_count",
    "_backend",
    "_default_pg_init_method",
)


@dataclass
class _World:
    default_pg: Any = None
    globals: dict[str, Any] = field(default_factory=dict)
    coalesce_state: dict = field(default_factory=dict)
    comms: list = field(default_factory=list)


def _empty_world(group_count: int = 0) -> _World:
    g = {name: {} for name in _GLOBALS}
    g["_group_count"] = group_count
    g["_backend"] = None
    g["_default_pg_init_method"] = None
    return _World(globals=g)


def _capture() -> _World:
    w = c10d._world
    return _World(
        default_pg=w._default_pg,
        globals={name: getattr(c10d, name) for name in _GLOBALS if hasattr(c10d, name)},
        coalesce_state=w._pg_coalesce_state,
        comms=w._comms,
    )


def _install(world: _World) -> None:
    w = c10d._world
    w._default_pg = world.default_pg
    for name, value in world.globals.items():
        setattr(c10d, name, value)
    w._pg_coalesce_state = world.coalesce_state
    w._comms = world.comms


def _reregister(world: _World) -> None:
    """Put `world`'s groups back into torch's C++ name registry (vLLM's shutdown clears it)."""
    register = getattr(c10d, "_register_process_group", None)
    resolve = getattr(c10d, "_resolve_process_group", None)
    if register is None:
        return
    for pg, name in world.globals.get("_pg_names", {}).items():
        try:
            if resolve is not None:
                with contextlib.suppress(Exception):
                    if resolve(name) is pg:
                        continue
            register(name, pg)
        except Exception as e:  # already registered under that name: nothing to restore
            log.debug("could not re-register process group %s: %s", name, e)


class SeparateWorlds:
    """Two c10d worlds in one process: the caller's and an embedded engine's.

        with ENGINE_WORLD.engine():   # vLLM sees only its own world here
            llm = LLM(...)
        # here the trainer's default group (if any) is back, untouched

    vLLM keeps its parallel state in module globals, so all in-process engines share one
    world: use the process-wide `ENGINE_WORLD`.
    """

    def __init__(self) -> None:
        self._engine_world = _empty_world(_VLLM_GROUP_NAME_BASE)
        self._depth = 0

    @contextlib.contextmanager
    def engine(self, *, shutting_down: bool = False) -> Iterator[None]:
        """Run the body in the engine's world; restore the caller's world afterwards.

        Re-entrant (nested uses are no-ops). With `shutting_down`, the caller's groups are
        re-registered in torch's C++ registry afterwards, since destroying the engine's
        default group unregisters every group of the process.
        """
        if self._depth:
            yield
            return
        outer = _capture()
        _install(self._engine_world)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self._engine_world = _capture()
            _install(outer)
            if shutting_down:
                _reregister(outer)
                if self._engine_world.default_pg is None:  # destroyed: start the next one fresh
                    self._engine_world = _empty_world(_VLLM_GROUP_NAME_BASE)


ENGINE_WORLD = SeparateWorlds()


@contextlib.contextmanager
def preserved_torch_state() -> Iterator[None]:
    """Undo what vLLM changes process-wide in torch while the body runs.

    vLLM's CPU worker replaces `torch.set_num_threads` with a stub that only warns; the
    engine seeds the global RNGs (python, numpy, torch) at start-up, and its CPU sampler
    draws from torch's global generator every step. The trainer keeps its own thread count
    and RNG streams (CPU ones; on GPU vLLM's seeded requests use their own generators).
    """
    set_num_threads = torch.set_num_threads
    num_threads = torch.get_num_threads()
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)
