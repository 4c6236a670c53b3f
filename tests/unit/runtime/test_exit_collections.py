"""`skip_final_collections`: what is alive when a process's work is done moves to the
collector's permanent generation, so the interpreter's exit-time passes skip it."""

from __future__ import annotations

import gc

from moe_rl.runtime.manual_gc import skip_final_collections


def _tracked(obj: object) -> bool:
    """Whether the collector would walk `obj` in a pass (any generation but the permanent one)."""
    return any(o is obj for o in gc.get_objects())


def test_everything_alive_is_frozen_and_later_objects_are_not():
    before = gc.get_freeze_count()  # (an in-process vLLM engine of an earlier test freezes its heap)
    try:
        cycle: list = []
        cycle.append(cycle)
        assert _tracked(cycle)
        skip_final_collections()
        assert not _tracked(cycle) and gc.get_freeze_count() > before + 1000  # (modules, functions, ...)
        later: list = []
        later.append(later)
        assert _tracked(later)
    finally:
        if before == 0:
            gc.unfreeze()  # (this test process collects as before)
