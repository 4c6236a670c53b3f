"""Ctrl-C and SIGTERM (a preempted job) stop a training loop at a step boundary.

    with StopOnSignal() as stop:
        for step in ...:
            train one step
            signum, notes = stop.agreed(note)   # collective: every rank, once per step
            if signum: save a checkpoint; raise StoppedBySignal(signum)

The first SIGINT or SIGTERM only records itself: the step in progress finishes, the loop
saves a checkpoint and leaves with exit status 130 (SIGINT) / 143 (SIGTERM), the shell's
numbers for a process ended by that signal. A second one stops at once (KeyboardInterrupt
/ SystemExit unwind the stack; checkpoints are written to temp directories and renamed, so
nothing half-written is left where a resume would read it). The same signal again
within REPEAT_WINDOW_S of the first is the same request: a launcher (torchrun, a batch
system) forwards to its workers the signal they may also have received directly.

Under torchrun the signal may reach only some ranks, so the ranks decide together:
`agreed` gathers every rank's signal over the world of all ranks (engine-only ranks of the
separate placement included), and all stop after the same step.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType, TracebackType
from typing import TypeVar

import torch.distributed as dist

from moe_rl.runtime.collectives import all_gather_object
from moe_rl.runtime.worlds import bridge

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_WINDOW_S = 1.0


def signal_exit_status(signum: int) -> int:
    """128 + the signal's number: what a shell reports for a process the signal ended."""
    return 128 + int(signum)


class StoppedBySignal(SystemExit):
    """The loop stopped at a step boundary after a signal; exits with `signal_exit_status`."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_exit_status(signum))
        self.signum = signum


NoteT = TypeVar("NoteT")
"""What the ranks gather with the stop signal (the run loop's `SaveNote`, a flag)."""


class StopOnSignal:
    """Records SIGINT/SIGTERM while the block runs (handlers are installed only in the main
    thread; the previous ones are restored on leaving, so a signal during clean-up acts as
    it did before)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        """The first signal this process received, None until then."""
        self._first_at = 0.0
        self._previous: dict[int, signal._HANDLER] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum, self._first_at = signum, time.monotonic()
            log.warning("%s received: finishing this step, then saving a checkpoint and stopping "
                        "(send it again to stop at once, without saving this step)", name)
            return
        if signum == self.signum and time.monotonic() - self._first_at < REPEAT_WINDOW_S:
            return  # the same request, forwarded by a launcher
        log.warning("second %s: stopping now; a resume continues from the newest complete checkpoint", name)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(signal_exit_status(signum))

    def agreed(self, note: NoteT) -> tuple[int | None, list[NoteT]]:
        """Collective over every rank: the signal to stop for, when any rank received one
        (the lowest rank's), else None, and every rank's `note` in rank order (what else the
        ranks must decide alike once per step rides on the same gather: the run loop's
        checkpoint writes). Every rank gets the same answer."""
        with bridge():
            if not dist.is_available() or not dist.is_initialized():
                return self.signum, [note]
            everyone = all_gather_object((self.signum, note))
        return next((s for s, _ in everyone if s), None), [n for _, n in everyone]
