"""What the programs that learn from preference pairs (DPO, the reward model) share: the
step's pairs -> one update, the held-out statistics, their summary; the run loop
(`moe_rl.loop`) owns the run directory, evaluation cadence, checkpoints, resume and signals.

A subclass builds its models (`_build`), makes one update on a step's pairs (`_train_on`),
gives the held-out statistics (`_held_out`), and says what a finished run leaves
(`finish`, `_summary_fields`). The pairs of a step are a pure function of run.seed and the
step (`moe_rl.programs.preference.data.pairs_of_step`), so checkpoints resume bit-exactly with the
model, optimizer, schedule and RNG they hold.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

from moe_rl.config import Config
from moe_rl.loop import Program


class PreferenceProgram(Program):
    """One run on preference pairs: `section` is the recipe section with batch_size and
    eval_max_pairs (`dpo` or `rm`); `self.model` is what trains."""

    name = "preference"
    evaluates_at_start = True
    section = "dpo"
    """The recipe section with its batch size and held-out pairs (`dpo` or `rm`)."""

    @classmethod
    def check(cls, cfg: Config, world: int) -> str:
        """The layout, the starting weights, the model, the device, the pairs and their
        lengths (`preflight.check_pairs_run`); the `--check` line."""
        from moe_rl.programs.preference.preflight import check_pairs_recipe

        return check_pairs_recipe(cfg, world, cls.section)

    def __init__(self, cfg: Config, section: str, pairs_cfg: Any) -> None:
        """`pairs_cfg`: the `section` of `cfg` the program reads its batch size and held-out
        pairs from (`cfg.dpo`, `cfg.rm`), handed over by the program."""
        from moe_rl.learner import init_distributed
        from moe_rl.programs.preference.preflight import check_pairs_run

        self.cfg, self.pairs_cfg = cfg, pairs_cfg
        self.train_pairs, self.eval_pairs, self.encoder = check_pairs_run(cfg, int(os.environ.get("WORLD_SIZE", "1")),
                                                                          section)
        if self.pairs_cfg.eval_max_pairs:
            self.eval_pairs = self.eval_pairs[: self.pairs_cfg.eval_max_pairs]
        self.rank, self.world = init_distributed(cfg.parallel.distributed_backend)
        self.log = logging.getLogger(type(self).__module__)
        self.model: Any = None
        self.eval_tokens: Any = None
        self._stack = contextlib.ExitStack()

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

    def _summary_fields(self) -> dict[str, Any]:
        """The algorithm's own fields of summary.json (its name and settings)."""
        raise NotImplementedError

    def setup(self, resume_from: Path | None) -> int:
        """The seed, the layout, the models (resumed or from their start)."""
        from moe_rl.learner import load_checkpoint, parallel_layout

        self.layout = self._stack.enter_context(parallel_layout(self.cfg.parallel, seed=self.cfg.run.seed))
        self.layout_name = self.layout.name
        torch.manual_seed(self.cfg.run.seed)
        self._build(self.layout, resume_from)
        if resume_from is None:
            return 0
        meta = load_checkpoint(self.model, resume_from, trust=self.cfg.run.trust_checkpoint)
        start = int(meta.get("trainer_step", meta["step"]))
        self.log.info("resumed from %s at step %d", resume_from, start)
        return start

    def step(self, step: int) -> dict[str, float]:
        """One optimizer step on the step's pairs: the loss as `learner/loss`, the
        statistics under their own names (TRL's)."""
        from moe_rl.programs.preference.data import encode_pairs, pairs_of_step

        pairs = pairs_of_step(self.train_pairs, step - 1, self.pairs_cfg.batch_size, self.cfg.run.seed,
                              self.cfg.task.shuffle)
        stats, update = self._train_on(encode_pairs(pairs, self.encoder, self.layout.tp))
        metrics = {("learner/loss" if k == "loss" else k): v for k, v in stats.items()}
        from moe_rl.learner.microbatch import OPTIMIZER_METRICS

        metrics.update({f"learner/{k}": update[k] for k in OPTIMIZER_METRICS if k in update})
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out metrics (`eval/...`); collective."""
        if self.eval_tokens is None:
            return {}
        return {f"eval/{k}": v for k, v in self._held_out().items()}

    def save(self, path: Path, meta: dict[str, Any], background: bool = False) -> Any:
        """Collective: the model, optimizer, schedule and RNG."""
        from moe_rl.learner.checkpoint import start_checkpoint

        return start_checkpoint(self.model, path, config=self.cfg, extra_meta=meta, background=background)

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The algorithm's fields and the held-out accuracy at every evaluation and the last."""
        evals = eval_accuracies(history)
        return {**self._summary_fields(), "eval_accuracy": [{"step": s, "accuracy": a} for s, a in evals],
                "final_eval_accuracy": evals[-1][1] if evals else None}

    def log_line(self, step: int, m: dict[str, float]) -> str:
        held = (f", held-out accuracy {m['eval/rewards/accuracies']:.3f}" if "eval/rewards/accuracies" in m else "")
        return (f"{self.name} step {step}: loss {m['learner/loss']:.4f}, accuracy {m['rewards/accuracies']:.2f}, "
                f"margin {m['rewards/margins']:.3f}{held}")

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        keys = [("loss", "learner/loss"), ("acc", "rewards/accuracies"), ("margin", "rewards/margins")]
        return {short: f"{metrics[k]:.3g}" for short, k in keys if k in metrics}

    def close(self) -> None:
        self._stack.close()


def eval_accuracies(history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, held-out preference accuracy) of every evaluation in a run's logged rows."""
    return [(int(h["step"]), h["eval/rewards/accuracies"]) for h in history if "eval/rewards/accuracies" in h]
