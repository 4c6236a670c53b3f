"""The one run loop: every program (RL, PPO, DPO, the reward model, SFT, and the engine-only
role of a separate placement) runs through it.

    summary = RunLoop(program, run=cfg.run, logging_cfg=cfg.logging, recipe=to_dict(cfg)).run()

What the loop owns, the same for every program:
  - resume or fresh start: the run directory (`moe_rl.loop.rundir`) claims the directory and
    names the checkpoint to resume from; the program restores it in `setup`;
  - stepping from the resumed step to run.steps, evaluation every run.eval_every steps and
    at the last (and once before step 1 for the programs that ask);
  - metrics: metrics.jsonl, TensorBoard, W&B (logging.wandb), the progress bar, `time/step`
    and `time/other`;
  - the agreed stop: SIGINT / SIGTERM on any rank stop every rank after the same step, which
    is saved; the process leaves with 130 / 143 and a line saying how to go on;
  - checkpoints every run.save_every steps and at the last, rotation, the program's finish
    (an export) and summary.json;
  - skipped updates (a NaN or inf loss or gradient): the run stops after
    run.max_skipped_updates in a row, with one line (a `RunFaultError`).
Every rank runs the same sequence of collective calls (a step, an evaluation when due, one
agreed-stop gather, a save when due), whatever its role, so the roles cannot drift apart.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Mapping
from typing import Any, NoReturn

from moe_rl.checkpoints.directories import latest_checkpoint, step_dir_name
from moe_rl.config import LoggingConfig, RunConfig
from moe_rl.loop.interrupt import StopOnSignal, StoppedBySignal
from moe_rl.loop.program import Program
from moe_rl.loop.rundir import RunDirectory
from moe_rl.loop.saves import SaveNote, Saves
from moe_rl.runtime.failures import RunFaultError
from moe_rl.runtime.fault_hooks import kill_point

log = logging.getLogger(__name__)


class RunLoop:
    """Drives one program over the run's steps (see the module docstring)."""

    def __init__(self, program: Program, *, run: RunConfig, logging_cfg: LoggingConfig,
                 recipe: Mapping[str, Any]) -> None:
        """`recipe`: the resolved recipe's plain data (`moe_rl.config.to_dict`), saved as the
        run's config.yaml and compared on resume; the loop reads the `run` and `logging`
        sections only."""
        self.run_cfg, self.logging = run, logging_cfg
        self.program = program
        self.run_dir = RunDirectory(run, logging_cfg, recipe)
        self._bar: Any = None
        self._skipped_since: int | None = None  # the first step of the steps with skipped updates

    @property
    def _writes(self) -> bool:
        """This rank writes the run's files: global rank 0 of a program that trains."""
        return self.program.trains and self.program.rank == 0

    def run(self) -> dict[str, Any]:
        """The whole run on this rank; rank 0 returns the summary, the others {}."""
        prog = self.program
        kill_point("start")
        with contextlib.ExitStack() as stack:
            stack.callback(prog.close)
            resume_from = (self.run_dir.prepare(self.run_cfg.resume, rank=prog.rank, needs_init=prog.needs_init_weights)
                           if prog.trains else None)
            start = prog.setup(resume_from)
            if self._writes:
                stack.push(lambda _type, error, _tb: self.run_dir.close(error))  # (W&B records how it ended)
                self.run_dir.start_logging(start)
            t0 = time.perf_counter()
            self._evaluate_at_start(start)
            self._bar = self._progress_bar(stack, start)
            saves = Saves(self.run_cfg, prog, self.run_dir)
            stack.callback(saves.close)  # (an error: a save in flight is abandoned, never finished half-way)
            last = self._steps(start, saves)
            if self._bar is not None:
                self._bar.close()  # its last line before the summary's (the stack's close is then a no-op)
            final = self.run_dir.checkpoints / step_dir_name(last)
            prog.finish(last, final)
            if not self._writes:
                return {}
            fields = {"steps": last, "wall_seconds": time.perf_counter() - t0, "world_size": prog.world,
                      "layout": prog.layout_name, "final_checkpoint": str(final),
                      "tensorboard": str(self.run_dir.path / "tb")}
            return self.run_dir.write_summary({**fields, **prog.summary(self.run_dir.history)})

    def _evaluate_at_start(self, start: int) -> None:
        if start == 0 and self.program.evaluates_at_start and self.run_cfg.eval_every:
            metrics = self.program.evaluate(0)  # (collective: every rank takes part)
            if metrics and self._writes:
                self.run_dir.log(0, {**metrics, "step": 0})

    def _steps(self, start: int, saves: Saves) -> int:
        """Steps start+1 .. run.steps (or until the program is done); returns the last."""
        prog, steps, last = self.program, self.run_cfg.steps, start
        with StopOnSignal() as stop:
            for step in range(start + 1, steps + 1):
                try:
                    metrics, signum, notes = self._one_step(step, stop, saves.note())
                except RunFaultError as fault:  # (every rank alike: the save in flight, of a good step, completes)
                    if fault.everywhere:
                        saves.settle()
                    raise
                last = step
                if self._writes:
                    self._log(step, metrics)
                kill_point("step.logged")
                self._check_skipped_updates(step, metrics, saves)
                done = prog.done(step, metrics)
                signum = signum if signum and step < steps else None  # (during the last step: finish)
                if signum:
                    self._stop(step, signum, saves.on_stop(step, lambda note: stop.agreed(note)[1]))
                final = done or step == steps
                saves.after_step(step, notes, due=final or self._save_due(step) or saves.clock_due(notes), final=final)
                if done:
                    break
        return last

    def _one_step(self, step: int, stop: StopOnSignal,
                  note: SaveNote) -> tuple[dict[str, float], int | None, list[SaveNote]]:
        """The program's step, its evaluation when due, the agreed stop signal (collective over
        every rank, every step) and the step's timings. `time/step` runs to the end of the
        agreement, so that it is the step's wall time on every rank: a rank done before the
        others (a learner whose engines sample ahead) waits there (`time/step_end_wait`)."""
        t0 = time.perf_counter()
        metrics = self.program.step(step)
        if self._eval_due(step):
            t_eval = time.perf_counter()
            metrics.update(self.program.evaluate(step))
            metrics["time/eval"] = metrics.get("time/eval", 0.0) + time.perf_counter() - t_eval
        t_agree = time.perf_counter()
        signum, notes = stop.agreed(note)
        metrics["time/step_end_wait"] = time.perf_counter() - t_agree
        phases = sum(v for k, v in metrics.items() if k.startswith("time/"))
        metrics["time/step"] = time.perf_counter() - t0
        metrics["time/other"] = metrics["time/step"] - phases
        metrics["step"] = step
        return metrics, signum, notes

    def _check_skipped_updates(self, step: int, metrics: dict[str, float], saves: Saves) -> None:
        """Updates with a NaN or inf loss or gradient were skipped by the learner (never
        applied: the weights stay finite, so this step may still be saved); after
        run.max_skipped_updates in a row the run stops, without saving this step, naming the
        first step of the steps with skipped updates. Every learner rank sees the same metrics,
        so every rank stops alike, after completing the save in flight (of a good step)."""
        skipped = sum(v for k, v in metrics.items() if k.endswith("/update_skipped"))
        streak = max((v for k, v in metrics.items() if k.endswith("/skipped_in_a_row_max")), default=0.0)
        if not skipped:
            self._skipped_since = None
            return
        self._skipped_since = self._skipped_since or step
        if self._writes:
            self._say(f"step {step}: skipped {'every' if skipped >= 1 else 'an'} update with a NaN or inf loss or "
                      f"gradient (not applied; {int(streak)} in a row, run.max_skipped_updates="
                      f"{self.run_cfg.max_skipped_updates})")
        if streak < self.run_cfg.max_skipped_updates:
            return
        saves.settle()
        raise RunFaultError(
            f"{int(streak)} optimizer updates in a row had a NaN or inf loss or gradient (skipped since step "
            f"{self._skipped_since}; none was applied), so the run stopped after step {step}, unsaved; the latest "
            f"checkpoint is {latest_checkpoint(self.run_dir.path) or 'none'}. Likely causes: a "
            "learning rate too high (optimizer.lr), a reward outside its range (task.reward), fp8 scaling "
            "(model.fp8); fix the cause and resume (run.resume=true), or allow more with run.max_skipped_updates",
            everywhere=True)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        """metrics.jsonl and TensorBoard, the program's log line, the progress bar (rank 0)."""
        self.run_dir.log(step, metrics)
        line = self.program.log_line(step, metrics)
        if line is not None:
            self._say(line)
        if self._bar is not None:  # postfix first: the line drawn at k/N shows step k's values
            self._bar.set_postfix(self.program.postfix(metrics), refresh=False)
            self._bar.update(1)

    def _say(self, line: str) -> None:
        """A log line that does not break the progress bar."""
        if self._bar is None:
            log.info("%s", line)
            return
        with self._bar.external_write_mode():
            log.info("%s", line)

    def _eval_due(self, step: int) -> bool:
        every = self.run_cfg.eval_every
        return bool(every) and (step % every == 0 or step == self.run_cfg.steps)

    def _save_due(self, step: int) -> bool:
        every = self.run_cfg.save_every
        return bool(every) and step % every == 0

    def _stop(self, step: int, signum: int, saved: str) -> NoReturn:
        """After the stop's saves (`saved` says what they did): say what happened and how to
        go on, and leave with the signal's exit status (130 for SIGINT, 143 for SIGTERM)."""
        if self._bar is not None:
            self._bar.close()
        if self._writes:
            log.warning("stopped by %s after step %d of %d, %s; to continue, run the same command with "
                        "run.resume=true", signal.Signals(signum).name, step, self.run_cfg.steps, saved)
        raise StoppedBySignal(signum)

    def _progress_bar(self, stack: contextlib.ExitStack, start: int) -> Any:
        if not self._writes or not self.logging.progress:
            return None
        from tqdm.auto import tqdm

        bar = tqdm(total=self.run_cfg.steps, initial=start, desc=self.run_cfg.name, unit="step", dynamic_ncols=True)
        stack.callback(bar.close)
        return bar

