"""The loop shared by the trainers that learn from preference pairs (DPO, the reward model):
the step's pairs -> one update -> log / evaluate / checkpoint, in the RL trainer's run
directory (`moe_rl.rundir`).

A subclass builds its models (`_build`), makes one update on a step's pairs (`_train_on`),
gives the held-out statistics (`_held_out`), and says what a finished run leaves
(`_finish`, `_summary_fields`). The loop owns the rest: the pairs of a step are a pure function of run.seed and the step
(`moe_rl.preference.data.pairs_of_step`), so checkpoints (`run.save_every`, and the last step)
resume bit-exactly with the model, optimizer, schedule and RNG they hold; SIGINT / SIGTERM
finish the step, save and exit (130 / 143), like the RL trainer.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from moe_rl.atomic import atomic_write_text
from moe_rl.config import Config
from moe_rl.interrupt import StopOnSignal, StoppedBySignal
from moe_rl.rundir import RunDirectory


class PreferenceTrainer:
    """One run on preference pairs: `section` is the recipe section with batch_size,
    eval_every and eval_max_pairs (`dpo` or `rm`); `self.model` is what trains."""

    name = "preference"
    """The algorithm's name in log lines."""

    def __init__(self, cfg: Config, section: str) -> None:
        from moe_rl.learner import init_distributed
        from moe_rl.preference.preflight import check_pairs_run

        self.cfg, self.pairs_cfg = cfg, getattr(cfg, section)
        self.train_pairs, self.eval_pairs, self.encoder = check_pairs_run(cfg, int(os.environ.get("WORLD_SIZE", "1")),
                                                                          section)
        if self.pairs_cfg.eval_max_pairs:
            self.eval_pairs = self.eval_pairs[: self.pairs_cfg.eval_max_pairs]
        self.rank, self.world = init_distributed(cfg.parallel.distributed_backend)
        self.run_dir = RunDirectory(cfg)
        self.start_step = 0
        self.log = logging.getLogger(f"moe_rl.{section}")
        self.model: Any = None
        self.eval_tokens: Any = None

    def _build(self, layout: Any, resume_from: Path | None) -> None:
        """Build `self.model` (and whatever else the algorithm needs), from `resume_from` or
        from run.init_checkpoint, and set `self.eval_tokens`."""
        raise NotImplementedError

    def _train_on(self, tokens: Any) -> tuple[dict[str, float], dict[str, float]]:
        """One optimizer update on a step's pairs (2P rows, `encode_pairs`' layout): (the pair
        statistics before it, `loss` included; the learner's update metrics)."""
        raise NotImplementedError

    def _held_out(self) -> dict[str, float]:
        """The pair statistics of the held-out pairs; collective."""
        raise NotImplementedError

    def step(self, step: int) -> dict[str, float]:
        """One optimizer step on the step's pairs; its metrics (`eval/*` when due): the
        loss as `learner/loss`, the statistics under their own names (TRL's)."""
        from moe_rl.preference.data import encode_pairs, pairs_of_step

        t0, run = time.perf_counter(), self.cfg.run
        pairs = pairs_of_step(self.train_pairs, step - 1, self.pairs_cfg.batch_size, run.seed, self.cfg.task.shuffle)
        stats, update = self._train_on(encode_pairs(pairs, self.encoder, self.layout.tp))
        metrics = {("learner/loss" if k == "loss" else k): v for k, v in stats.items()}
        metrics.update({f"learner/{k}": update[k] for k in ("grad_norm", "lr", "update_skipped") if k in update})
        if self._eval_due(step):
            metrics.update(self.evaluate())
        metrics["time/step"] = time.perf_counter() - t0
        metrics["step"] = step
        return metrics

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics (`eval/...`); collective."""
        return {f"eval/{k}": v for k, v in self._held_out().items()}

    def _finish(self) -> None:
        """Rank 0, after the last step: what the run leaves besides its checkpoints."""

    def _summary_fields(self) -> dict[str, Any]:
        """The algorithm's own fields of summary.json (its name and settings)."""
        raise NotImplementedError

    def checkpoint_path(self, step: int) -> Path:
        """Where the checkpoint of `step` is (or would be) saved."""
        return self.run_dir.checkpoints / f"step_{step:06d}"

    def _summary(self, wall_seconds: float) -> dict[str, Any]:
        """summary.json: the algorithm's fields, steps, held-out accuracy at every evaluation
        and the last, the final checkpoint, wall time."""
        evals = self.eval_accuracies()
        out = {**self._summary_fields(), "steps": self.cfg.run.steps, "wall_seconds": wall_seconds,
               "world_size": self.world, "eval_accuracy": [{"step": s, "accuracy": a} for s, a in evals],
               "final_eval_accuracy": evals[-1][1] if evals else None,
               "final_checkpoint": str(self.checkpoint_path(self.cfg.run.steps)),
               "tensorboard": str(self.run_dir.path / "tb")}
        atomic_write_text(self.run_dir.path / "summary.json", json.dumps(out, indent=2) + "\n")
        return out

    def _log_line(self, step: int, m: dict[str, float]) -> str:
        held = (f", held-out accuracy {m['eval/rewards/accuracies']:.3f}" if "eval/rewards/accuracies" in m else "")
        return (f"{self.name} step {step}: loss {m['learner/loss']:.4f}, accuracy {m['rewards/accuracies']:.2f}, "
                f"margin {m['rewards/margins']:.3f}{held}")

    def _setup(self, layout: Any) -> None:
        """The run directory, the seed, the models (resumed or from their start), logging."""
        from moe_rl.learner import load_checkpoint

        resume_from = self.run_dir.prepare(self.cfg.run.resume, rank=self.rank)
        torch.manual_seed(self.cfg.run.seed)
        self.layout = layout
        self._build(layout, resume_from)
        if resume_from is not None:
            meta = load_checkpoint(self.model, resume_from, trust=self.cfg.run.trust_checkpoint)
            self.start_step = int(meta.get("trainer_step", meta["step"]))
            self.log.info("resumed from %s at step %d", resume_from, self.start_step)
        if self.rank == 0:
            self.run_dir.start_logging(self.start_step)

    def _eval_due(self, step: int) -> bool:
        """Held-out evaluation every eval_every steps and at the last."""
        every = self.pairs_cfg.eval_every
        return self.eval_tokens is not None and bool(every) and (step % every == 0 or step == self.cfg.run.steps)

    def fit(self) -> dict[str, Any]:
        """The whole run, on every rank; rank 0 returns the summary."""
        from moe_rl.learner import parallel_layout

        cfg, t0 = self.cfg, time.perf_counter()
        with parallel_layout(cfg.parallel, seed=cfg.run.seed) as layout:
            try:
                self._setup(layout)
                if self.start_step == 0 and self.eval_tokens is not None and self.pairs_cfg.eval_every:
                    start = self.evaluate()  # (collective: every rank takes part)
                    if self.rank == 0:
                        self.run_dir.log(0, {**start, "step": 0})
                self._loop()
                if self.rank == 0:
                    self._finish()
            finally:
                self.run_dir.close()
        return self._summary(time.perf_counter() - t0) if self.rank == 0 else {}

    def _loop(self) -> None:
        """Steps from the start (or the resumed step) to run.steps; a checkpoint every
        run.save_every steps, at the last, and on SIGINT / SIGTERM (then StoppedBySignal)."""
        cfg = self.cfg
        with StopOnSignal() as stop:
            for step in range(self.start_step + 1, cfg.run.steps + 1):
                metrics = self.step(step)
                if self.rank == 0:
                    self.run_dir.log(step, metrics)
                    self.log.info("%s", self._log_line(step, metrics))
                signum = stop.agreed() if step < cfg.run.steps else None  # collective: every rank stops here
                every = cfg.run.save_every
                if signum or (every and step % every == 0) or step == cfg.run.steps:
                    self._save(step)
                if signum:
                    if self.rank == 0:
                        self.log.warning("stopped by %s after step %d of %d, saved in %s; to continue, run the same "
                                         "command with run.resume=true", signal.Signals(signum).name, step,
                                         cfg.run.steps, self.checkpoint_path(step))
                    raise StoppedBySignal(signum)

    def _save(self, step: int) -> None:
        """Collective: the model, optimizer, schedule and RNG at `step`; old ones rotated out."""
        from moe_rl.learner import save_checkpoint

        save_checkpoint(self.model, self.checkpoint_path(step),
                        extra_meta={"trainer_step": step, "run_id": self.run_dir.run_id})
        if self.rank == 0:
            self.run_dir.rotate_checkpoints()

    def eval_accuracies(self) -> list[tuple[int, float]]:
        """(step, held-out preference accuracy) of every evaluation so far."""
        return [(int(h["step"]), h["eval/rewards/accuracies"]) for h in self.run_dir.history
                if "eval/rewards/accuracies" in h]
