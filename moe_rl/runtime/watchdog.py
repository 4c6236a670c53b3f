"""A call that must return in time: an engine's generate or score call that deadlocks
(as opposed to one that raises) would otherwise hang the whole run forever.

    with call_deadline(seconds, on_hang):   # on_hang() runs on a timer thread if the
        ro = sampler.generate(...)          # block has not finished by then

What `on_hang` does is the caller's: an out-of-process engine is killed (its pending call
then fails like a crashed worker, and the restart budget takes over); an in-process engine
cannot be interrupted, so `exit_on_hang` prints one line and ends the process with status
`HUNG_EXIT`, which makes torchrun end the job, whose other ranks wait in a collective the
hung rank never reaches; `run.resume=true` continues from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator

HUNG_EXIT = 3
"""The process's exit status when an engine call hung (the run's fault status)."""


@contextlib.contextmanager
def call_deadline(seconds: float, on_hang: Callable[[], None]) -> Iterator[None]:
    """Run the block; if it has not finished after `seconds` (> 0; 0 or less: no deadline),
    call `on_hang()` once from a timer thread. The timer is cancelled when the block ends."""
    if seconds <= 0:
        yield
        return
    timer = threading.Timer(seconds, on_hang)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def exit_on_hang(line: str) -> Callable[[], None]:
    """An `on_hang` that prints `line` to stderr and ends the process at once with
    `HUNG_EXIT` (no cleanup can run: the main thread is stuck inside the engine)."""

    def hang() -> None:
        print(line, file=sys.stderr, flush=True)
        os._exit(HUNG_EXIT)

    return hang
