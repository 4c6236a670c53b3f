"""The DPO loop: pairs -> reference and policy log-probs -> one update -> log / evaluate /
checkpoint, in the RL trainer's run directory (`moe_rl.rundir`).

Per step, on every rank: the step's `dpo.batch_size` pairs (a pure function of run.seed and
the step, `data.pairs_of_step`) become 2P rows; the frozen reference (run.init_checkpoint,
loaded once) scores them once, the policy scores them without gradients, and one optimizer
update runs the surrogate whose gradient is DPO's (`surrogate`). Metrics use TRL's names
(`learner/loss`, `rewards/*`, `logps/*`) and the held-out ones `eval/*`, every
`dpo.eval_every` steps and at the end, against reference log-probs computed once at start.
Checkpoints (`run.save_every`, and the last step) resume bit-exactly: the pairs of a step
depend only on the step, and the checkpoint holds the model, optimizer, schedule and RNG.
SIGINT / SIGTERM finish the step, save and exit (130 / 143), like the RL trainer.
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
from moe_rl.batch import TokenBatch
from moe_rl.config import Config, ConfigError
from moe_rl.dpo.data import encode_pairs, pair_rows, pairs_of_step
from moe_rl.dpo.loss import PairLogps, pair_metrics
from moe_rl.dpo.preflight import check_dpo_run
from moe_rl.dpo.surrogate import COEF_KEY, surrogate_coefficients, surrogate_loss
from moe_rl.interrupt import StopOnSignal, StoppedBySignal
from moe_rl.rundir import RunDirectory

log = logging.getLogger("moe_rl.dpo")


def sequence_logps(learner: Any, tokens: TokenBatch) -> torch.Tensor:
    """[B] fp64 log pi(response | prompt), summed over response tokens (whole batch, every rank)."""
    return (learner.logprobs(tokens).double() * tokens.response_mask()).sum(-1)


def load_start(learner: Any, path: str, trust: bool) -> None:
    """The starting weights (a moe_rl checkpoint or a Hugging Face directory), model only."""
    from moe_rl.learner import load_checkpoint
    from moe_rl.learner.checkpoint import is_checkpoint
    from moe_rl.learner.hf_import import load_hf_weights

    p = Path(path)
    if is_checkpoint(p):
        load_checkpoint(learner, p, load_optimizer=False, trust=trust)
    elif (p / "config.json").is_file():
        load_hf_weights(learner, p)
    else:
        raise ConfigError(f"run.init_checkpoint={path} is neither a moe_rl checkpoint nor a Hugging Face directory")
    learner.step = 0


class DPOTrainer:
    """Owns the policy, the frozen reference and the run directory of one DPO run."""

    def __init__(self, cfg: Config) -> None:
        from moe_rl.learner import init_distributed

        self.train_pairs, self.eval_pairs, self.encoder = check_dpo_run(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        if cfg.dpo.eval_max_pairs:
            self.eval_pairs = self.eval_pairs[: cfg.dpo.eval_max_pairs]
        self.cfg = cfg
        self.rank, self.world = init_distributed(cfg.parallel.distributed_backend)
        self.run_dir = RunDirectory(cfg)
        self.start_step = 0

    def _setup(self, layout: Any) -> None:
        from moe_rl.learner import Learner, load_checkpoint

        cfg = self.cfg
        resume_from = self.run_dir.prepare(cfg.run.resume, rank=self.rank)
        torch.manual_seed(cfg.run.seed)
        self.policy = Learner(cfg, layout, total_updates=cfg.run.steps)
        self.ref = Learner(cfg, layout, trainable=False)
        load_start(self.ref, cfg.run.init_checkpoint, cfg.run.trust_checkpoint)
        if resume_from is not None:
            meta = load_checkpoint(self.policy, resume_from, trust=cfg.run.trust_checkpoint)
            self.start_step = int(meta.get("trainer_step", meta["step"]))
            log.info("resumed from %s at step %d", resume_from, self.start_step)
        else:
            load_start(self.policy, cfg.run.init_checkpoint, cfg.run.trust_checkpoint)
        self.layout = layout
        self.eval_tokens = encode_pairs(self.eval_pairs, self.encoder, layout.tp) if self.eval_pairs else None
        self.eval_ref = sequence_logps(self.ref, self.eval_tokens) if self.eval_pairs else None
        if self.rank == 0:
            self.run_dir.start_logging(self.start_step)

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> dict[str, float]:
        d, t0 = self.cfg.dpo, time.perf_counter()
        pairs = pairs_of_step(self.train_pairs, step - 1, d.batch_size, self.cfg.run.seed, self.cfg.task.shuffle)
        tokens = encode_pairs(pairs, self.encoder, self.layout.tp)
        ref = sequence_logps(self.ref, tokens)
        logps = PairLogps(*pair_rows(sequence_logps(self.policy, tokens)), *pair_rows(ref))
        coef = surrogate_coefficients(logps.margin(), d.beta, d.loss, d.label_smoothing)
        update = self.policy.train_step(tokens, surrogate_loss, extras={COEF_KEY: coef})
        metrics = _named(pair_metrics(logps, d.beta, d.loss, d.label_smoothing))
        metrics.update({f"learner/{k}": update[k] for k in ("grad_norm", "lr", "update_skipped") if k in update})
        if self._eval_due(step):
            metrics.update(self.evaluate())
        metrics["time/step"] = time.perf_counter() - t0
        metrics["step"] = step
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Held-out loss, preference accuracy and margins (`eval/...`)."""
        d = self.cfg.dpo
        logps = PairLogps(*pair_rows(sequence_logps(self.policy, self.eval_tokens)), *pair_rows(self.eval_ref))
        return {f"eval/{k}": v for k, v in pair_metrics(logps, d.beta, d.loss, d.label_smoothing).items()}

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.dpo.eval_every
        return self.eval_tokens is not None and bool(every) and (step % every == 0 or step == self.cfg.run.steps)

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        from moe_rl.learner import parallel_layout

        cfg, t0 = self.cfg, time.perf_counter()
        with parallel_layout(cfg.parallel, seed=cfg.run.seed) as layout:
            try:
                self._setup(layout)
                if self.start_step == 0 and self.eval_tokens is not None:
                    start = self.evaluate()  # (collective: every rank takes part)
                    if self.rank == 0:
                        self.run_dir.log(0, {**start, "step": 0})
                self._loop()
                if self.rank == 0 and cfg.run.export_hf:
                    self._export_final()
            finally:
                self.run_dir.close()
        return self._summary(time.perf_counter() - t0) if self.rank == 0 else {}

    def _loop(self) -> None:
        cfg = self.cfg
        with StopOnSignal() as stop:
            for step in range(self.start_step + 1, cfg.run.steps + 1):
                metrics = self.step(step)
                if self.rank == 0:
                    self.run_dir.log(step, metrics)
                    log.info("dpo step %d: loss %.4f, accuracy %.2f, margin %.3f%s", step, metrics["learner/loss"],
                             metrics["rewards/accuracies"], metrics["rewards/margins"],
                             f", held-out accuracy {metrics['eval/rewards/accuracies']:.3f}"
                             if "eval/rewards/accuracies" in metrics else "")
                signum = stop.agreed() if step < cfg.run.steps else None  # collective: every rank stops here
                every = cfg.run.save_every
                if signum or (every and step % every == 0) or step == cfg.run.steps:
                    self._save(step)
                if signum:
                    if self.rank == 0:
                        log.warning("stopped by %s after step %d of %d, saved in %s; to continue, run the same "
                                    "command with run.resume=true", signal.Signals(signum).name, step, cfg.run.steps,
                                    self.run_dir.checkpoints / f"step_{step:06d}")
                    raise StoppedBySignal(signum)

    def _save(self, step: int) -> None:
        from moe_rl.learner import save_checkpoint

        save_checkpoint(self.policy, self.run_dir.checkpoints / f"step_{step:06d}",
                        extra_meta={"trainer_step": step, "run_id": self.run_dir.run_id})
        if self.rank == 0:
            self.run_dir.rotate_checkpoints()

    def _export_final(self) -> None:
        """The final checkpoint as a Hugging Face directory `<run>/hf` (the starting
        directory's config.json and tokenizer files when it was one: `moe_rl.convert`)."""
        from moe_rl.convert import megatron_to_hf

        final = self.run_dir.checkpoints / f"step_{self.cfg.run.steps:06d}"
        log.info("exported the final model to %s", megatron_to_hf(final, self.run_dir.path / "hf", force=True))

    def _summary(self, wall_seconds: float) -> dict[str, Any]:
        """summary.json: steps, held-out accuracy first and last, wall time."""
        evals = [(h["step"], h["eval/rewards/accuracies"]) for h in self.run_dir.history
                 if "eval/rewards/accuracies" in h]
        out = {"algorithm": "dpo", "loss": self.cfg.dpo.loss, "beta": self.cfg.dpo.beta,
               "steps": self.cfg.run.steps, "wall_seconds": wall_seconds, "world_size": self.world,
               "eval_accuracy": [{"step": s, "accuracy": a} for s, a in evals],
               "final_eval_accuracy": evals[-1][1] if evals else None,
               "tensorboard": str(self.run_dir.path / "tb")}
        atomic_write_text(self.run_dir.path / "summary.json", json.dumps(out, indent=2) + "\n")
        return out


def _named(m: dict[str, float]) -> dict[str, float]:
    """`pair_metrics` under the logged names: the loss as `learner/loss`, TRL's names as is."""
    return {("learner/loss" if k == "loss" else k): v for k, v in m.items()}
