"""Manual garbage collection, megatron's `manual_gc` in small: Python's automatic collector
starts a generation-2 pass whenever allocations cross its thresholds, which in a training
step lands at random (a multi-hundred-millisecond pause on a process holding millions of
objects). With `parallel.manual_gc_interval` = N > 0 the first learner update turns the
automatic collector off and collects, and every N-th update after collects again, at the
same point of the step every time.

    manual_gc.tick(cfg.parallel.manual_gc_interval)   # once per optimizer update (the learner)
    manual_gc.restore()                                # automatic collection back (tests, benches)

Process-wide, as the collector is: the count runs over every learner's updates in the
process (PPO's actor and critic both tick). Interval 0 leaves the collector alone.
"""

from __future__ import annotations

import atexit
import gc

_state = {"updates": 0, "owned": False, "exit_freeze": False}


def tick(interval: int) -> bool:
    """One learner update. Returns whether it collected: the first update after the
    collector was taken over, then every `interval`-th."""
    if interval <= 0:
        return False
    if not _state["owned"]:
        gc.disable()
        _state["owned"], _state["updates"] = True, 0
        gc.collect()
        return True
    _state["updates"] += 1
    if _state["updates"] % interval:
        return False
    gc.collect()
    return True


def restore() -> None:
    """Automatic collection back on, if `tick` turned it off; the count starts over."""
    if _state["owned"]:
        gc.enable()
    _state["owned"], _state["updates"] = False, 0


def active() -> bool:
    """Whether manual collection owns the collector now."""
    return bool(_state["owned"])


def skip_final_collections() -> None:
    """Called by an entry point once its work is done: when the interpreter then exits, the
    objects alive at that moment (`gc.freeze`, from an atexit handler) are left out of its
    last collections. With torch, megatron and vLLM loaded those passes walk millions of
    objects for 1-3 s per process (measured on the CPU path: 5.0 s -> 2.0-2.2 s from a
    2-rank run's summary to torchrun's exit), to free memory the operating system takes back
    anyway. Nothing changes before the exit, so a test that runs a program's `main` in its
    own process keeps collecting as before. Registered once per process."""
    if not _state["exit_freeze"]:
        atexit.register(gc.freeze)
        _state["exit_freeze"] = True
