"""`skip_final_collections` changes nothing before the interpreter exits (a test that runs a
program's `main` in its own process keeps collecting), and registers its exit handler once.
(What it does at the exit: tests/integration/runtime/test_exit_freeze_at_exit.py.)"""

from __future__ import annotations

import atexit
import gc

from moe_rl.runtime.manual_gc import skip_final_collections


def test_nothing_is_frozen_before_the_exit_and_the_handler_is_registered_once():
    before = gc.get_freeze_count()
    skip_final_collections()
    handlers = atexit._ncallbacks()
    cycle: list = []
    cycle.append(cycle)
    skip_final_collections()
    assert gc.get_freeze_count() == before and atexit._ncallbacks() == handlers
    assert any(o is cycle for o in gc.get_objects())  # (still walked by the collector)
