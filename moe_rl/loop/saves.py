"""The run loop's checkpoints: when to save, and the one save in flight.

    saves = Saves(cfg.run, program, run_dir)
    ... each step: (signum, notes) = stop.agreed(saves.note())    # one gather for both
    saves.after_step(step, notes, due=...)    # finish a background save every rank wrote; save when due
    saves.on_stop(step)                       # a signal: finish or abandon within run.stop_grace_s

With `run.async_save` (the default) a checkpoint's files are written by a thread of the
trainer while the next steps run (`moe_rl.learner.checkpoint.start_checkpoint`); the loop
finishes it (collective: megatron's metadata, the manifest last, the rename) at the first
step boundary where every rank reports its files written, or before the next save starts:
at most one save is in flight, and a checkpoint is the latest only once complete. The last
step and a `done` program save synchronously. Whether a save is due by wall time
(`run.save_every_minutes`) is rank 0's clock, carried by the same per-step gather, so every
rank decides alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from moe_rl.checkpoints.directories import latest_checkpoint, step_dir_name
from moe_rl.config import RunConfig
from moe_rl.loop.program import Program, SaveInFlight
from moe_rl.loop.rundir import RunDirectory


class SaveNote(NamedTuple):
    """One rank's part of the per-step agreement on checkpoints (`Saves.note`), gathered
    from every rank with the stop signal (`StopOnSignal.agreed`)."""

    written: bool
    """This rank's files of the save in flight are written (true when none is in flight)."""
    clock_due: bool
    """A save is due by this rank's wall clock (run.save_every_minutes; rank 0's decides)."""


class Saves:
    """Checkpoint cadence and the save in flight of one run (every rank; only the training
    ranks save)."""

    def __init__(self, run: RunConfig, program: Program, run_dir: RunDirectory) -> None:
        self.run, self.program, self.run_dir = run, program, run_dir
        self.pending: SaveInFlight | None = None
        """The save in flight (a `PendingSave`), None when none is."""
        self.last_seconds: float | None = None
        """How long the last complete save took: its own work (start, data files, finish),
        not the steps a background write overlapped."""
        self._last_at = time.monotonic()

    def note(self) -> SaveNote:
        """This rank's part of the per-step agreement."""
        minutes = self.run.save_every_minutes
        clock_due = bool(minutes) and time.monotonic() - self._last_at >= 60 * minutes
        return SaveNote(written=self.pending is None or self.pending.done(), clock_due=clock_due)

    def clock_due(self, notes: Sequence[SaveNote | None]) -> bool:
        """run.save_every_minutes by rank 0's clock (the same answer on every rank)."""
        return bool(notes and notes[0] and notes[0].clock_due)

    def after_step(self, step: int, notes: Sequence[SaveNote | None], *, due: bool, final: bool) -> None:
        """Collective over the training ranks: finish the save in flight when every rank
        wrote its files; then, when `due`, save `step` (in the background unless `final` or
        run.async_save=false)."""
        if self.pending is not None and all(n is None or n.written for n in notes):
            self._finish()
        if due:
            self.save(step, background=self.run.async_save and not final)

    def save(self, step: int, *, background: bool) -> None:
        """Collective: save `step` (after finishing a save still in flight)."""
        if not self.program.trains:
            return
        if self.pending is not None:
            self._finish()
        self._last_at = time.monotonic()
        self.pending = self.program.save(self.path(step), {"trainer_step": step, "run_id": self.run_dir.run_id},
                                         background=background)
        if self.pending is None:  # (a program whose save completes at once)
            self._rotate()
        elif not background:
            self._finish()

    def settle(self) -> None:
        """Collective over the training ranks: complete the save in flight, if any (before a
        stop every rank agreed on)."""
        if self.pending is not None:
            self._finish()

    def path(self, step: int) -> Path:
        return self.run_dir.checkpoints / step_dir_name(step)

    def _finish(self) -> None:
        """Collective: complete the save in flight; rank 0 then rotates out older checkpoints."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending.finish()
        self.last_seconds = pending.seconds
        self._rotate()

    def _rotate(self) -> None:
        if self.program.rank == 0:
            self.run_dir.rotate_checkpoints()

    def on_stop(self, step: int, agree: Callable[[Any], list[Any]]) -> str:
        """A signal after `step`: the save in flight is finished if every rank writes its
        files within run.stop_grace_s, else abandoned; then `step` is saved (synchronously)
        when the last save's duration fits in what is left of the grace (or none was measured
        yet). Returns what happened, for the stop's line ("saved in <path>; ..."). `agree(x)`:
        collective over every rank, every rank's `x`."""
        deadline = time.monotonic() + self.run.stop_grace_s
        told = []
        written = self.pending is None or self.pending.wait(max(0.0, deadline - time.monotonic()))
        flags = agree((self.pending is not None, written))  # (every rank, the engine-only ones too)
        if self.pending is not None and all(w for _, w in flags):
            told.append(f"the save of step {self.pending.step} in flight finished")
            self._finish()
        elif self.pending is not None:
            told.append(f"the save of step {self.pending.step} in flight was abandoned (not written within "
                        f"run.stop_grace_s={self.run.stop_grace_s:g} s)")
            self.pending.abandon()
            self.pending = None
        left = deadline - time.monotonic()
        fits = self.last_seconds is None or self.last_seconds <= left
        if all(agree(fits)):
            self.save(step, background=False)
            return "; ".join([f"saved in {self.path(step)}", *told])
        told.append(f"the latest checkpoint is {latest_checkpoint(self.run_dir.path) or 'none'}")
        return "; ".join([f"not saved (the last save took {self.last_seconds:.1f} s, {max(left, 0):.1f} s of "
                          "run.stop_grace_s were left)", *told])

    def close(self) -> None:
        """On a way out without a finish (an error): a save in flight is abandoned."""
        if self.pending is not None:
            self.pending.abandon()
            self.pending = None
