"""Several torch.distributed worlds in one process, swapped in and out of c10d's globals.

c10d keeps "the world" in module globals (default group, group maps, naming counter). A
`SeparateWorlds` holds a snapshot of a second world and installs it around a block:

- an in-process vLLM engine lives in its own world (`moe_rl.sampler` uses ENGINE_WORLD),
  so it never runs its start-up collectives over the trainer's ranks nor destroys them;
- with `sampler.placement=separate`, the learner ranks' default world holds only them
  (megatron's world), and a bridge world spanning every rank (`BRIDGE_WORLD`) carries
  rollouts to the learners and weights to the engine ranks.

The swap is a handful of attribute assignments; there are no collectives. Not
thread-safe: use one thread, as the trainer does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.distributed_c10d as c10d

log = logging.getLogger(__name__)

_ENGINE_GROUP_NAME_BASE = 1 << 20

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
    g: dict[str, Any] = {name: {} for name in _GLOBALS}
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
    """Two c10d worlds in one process: the caller's and a second one (an embedded engine's,
    or the bridge between learner and engine ranks).

        with ENGINE_WORLD.engine():   # vLLM sees only its own world here
            llm = LLM(...)
        # here the trainer's default group (if any) is back, untouched

    `group_name_base` keeps the second world's group names apart from the caller's in
    torch's C++ registry (shared by both worlds).
    """

    def __init__(self, group_name_base: int = _ENGINE_GROUP_NAME_BASE) -> None:
        self._base = group_name_base
        self._engine_world = _empty_world(group_name_base)
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
                    self._engine_world = _empty_world(self._base)

    enter = engine

    @property
    def initialized(self) -> bool:
        """The second world has a default group."""
        return self._engine_world.default_pg is not None


BRIDGE_WORLD = SeparateWorlds(group_name_base=1 << 21)
"""Every rank of the torchrun world, when the learners' default world holds only them."""


@contextlib.contextmanager
def bridge() -> Iterator[None]:
    """Run the body in the world of every rank: the bridge world under separate placement,
    the default world otherwise (a no-op)."""
    if not BRIDGE_WORLD.initialized:
        yield
        return
    with BRIDGE_WORLD.enter():
        yield
