"""What the run loop drives: a program supplies its setup, one step, its evaluation, its
state to save, and what a finished run leaves; the loop (`moe_rl.loop.run_loop`) owns the
rest, the same for every program.

    class MyProgram(Program):
        name = "my"
        @classmethod
        def check(cls, cfg, world): ...every input check...; return "my, <what would run>"
        @classmethod
        def build(cls, cfg): cls.check(cfg, world); return cls(cfg.model, cfg.optimizer, recipe=to_dict(cfg))
        def setup(self, resume_from): ...build models, load resume_from...; return start_step
        def step(self, step): ...one optimizer step...; return {"learner/loss": ...}
        def save(self, path, meta, background=False):
            return start_checkpoint(self.model, path, recipe=self.recipe, extra_meta=meta, background=background)

`check` and `build` are the only methods that see the whole recipe: `build` is the
program's factory, handing each part the sections it reads (the constructor takes
sections and explicit values, never the root config). `moe_rl.cli.run_program` builds a
program and runs it in the loop.

The programs: RL (GRPO family and PPO, `moe_rl.programs.rl`), the engine-only role of a
separate placement (`moe_rl.programs.rl.engine_role`), DPO and the reward model
(`moe_rl.programs.preference.program`), SFT (`moe_rl.sft`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from moe_rl.config import Config


class SaveInFlight(Protocol):
    """A checkpoint a program has begun to save (`moe_rl.learner.checkpoint.PendingSave` is
    the one the learner's programs return): the loop finishes it, at once or once its files
    are written, or abandons it."""

    seconds: float
    """The save's own duration so far (its start; once finished, its writes and finish too)."""

    @property
    def step(self) -> int:
        """The trainer step saved."""
        ...

    def done(self) -> bool:
        """This rank's files are written (the others may still be writing theirs)."""
        ...

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for this rank's files; whether they are written."""
        ...

    def finish(self) -> Path:
        """Collective: complete the checkpoint and make it visible; its path."""
        ...

    def abandon(self) -> None:
        """Give up on the save: nothing more is written under its name."""
        ...


class Program:
    """One training program. Every method runs on every rank of the world, in the same
    order on each (the loop's collective calls depend on it); `summary` and `log_line` are
    asked on global rank 0 only."""

    name: str = "run"
    """The program's name in log lines."""
    trains: bool = True
    """False for a role that trains nothing and writes nothing (an engine-only rank): it
    takes part in the steps' collectives, never in saves or logs."""
    evaluates_at_start: bool = False
    """A fresh run evaluates once before step 1 (logged as step 0) when evaluation is on."""
    needs_init_weights: bool = True
    """A fresh start needs run.init_checkpoint (false: the program starts from random weights)."""
    rank: int = 0
    """Global rank (set by the program's constructor)."""
    world: int = 1
    """World size, engine-only ranks included."""
    layout_name: str = ""
    """The learner layout, for summary.json (set in `setup`)."""

    @classmethod
    def check(cls, cfg: Config, world: int) -> str:
        """Every check of this program's inputs for a world of `world` ranks, before anything
        is built: a one-line ConfigError naming the key for the first that cannot work.
        Returns what `--check` prints: one line saying what would run. The program's
        constructor runs it too, so a run and its `--check` refuse the same recipes."""
        raise NotImplementedError

    @classmethod
    def build(cls, cfg: Config) -> Program:
        """This rank's program for the recipe `cfg`, after `check` (against torchrun's
        WORLD_SIZE): the factory, which gives each part the sections it reads."""
        raise NotImplementedError

    def setup(self, resume_from: Path | None) -> int:
        """Build the models and everything a step needs, restoring `resume_from` when given
        (a checkpoint this program saved); return the last step done (0: a fresh start)."""
        raise NotImplementedError

    def step(self, step: int) -> dict[str, float]:
        """One step (1-based); its metrics. `time/<phase>` entries are the step's phases:
        the loop adds `time/step` (step, evaluation and the agreed-stop wait), `time/step_end_wait`
        and `time/other`."""
        raise NotImplementedError

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out metrics (`eval/*`), when the run's evaluation cadence says so; collective."""
        return {}

    def save(self, path: Path, meta: dict[str, Any], background: bool = False) -> SaveInFlight | None:
        """Collective: begin saving everything a resume needs at this step into checkpoint
        `path`, with `meta` (the loop's trainer_step and run_id) in its metadata, and return
        the `SaveInFlight` (the learner's `PendingSave`, `start_checkpoint`) that the loop
        finishes: at once, or, with `background`, once its files are written while the next
        steps run. None: a save that completed at once."""
        raise NotImplementedError

    def done(self, step: int, metrics: dict[str, float]) -> bool:
        """Stop after this step although run.steps is not reached (the same answer on every
        rank); the step is saved as the last."""
        return False

    def finish(self, last_step: int, final: Path) -> None:
        """After the last step and its save (`final`), on every rank: what a finished run
        leaves besides its checkpoints (an export, a model-only copy)."""

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """summary.json's program fields, from every logged row (rank 0)."""
        return {}

    def log_line(self, step: int, metrics: dict[str, float]) -> str | None:
        """A line for the log after `step` (None: nothing; the progress bar shows the step)."""
        return None

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        """The progress bar's few numbers for a step."""
        return {}

    def close(self) -> None:
        """Release engines and other resources (the loop calls it on every way out)."""
