"""The RL loop: collect -> score -> update -> sync -> log/checkpoint.

    trainer = Trainer(cfg)          # inside torchrun or a plain process
    summary = trainer.fit()

One step, on every rank of the torchrun world:
  1. collect (`moe_rl.rollout`): every rollout group's engine samples its block of the
     problems, G responses each; rewards, dynamic sampling, advantages; the scored groups
     are gathered so every rank packs the same batch;
  2. score: the learner recomputes old logprobs and records routing (R3: replaying the
     sampler's); a reference model scores the batch when `kl_coef > 0`;
  3. update: `epochs x num_minibatches` optimizer steps with the objective's loss
     (`moe_rl.update`), under the learner's routing plan (router shift, R2/R3 replay);
  4. sync: every rank assembles the learner's full tensors and streams them into its engine;
  5. log and checkpoint (`moe_rl.rundir`).
Determinism: problems, sampler seeds and mini-batch shuffles derive from (run.seed, step)
alone, so a run resumed from a checkpoint replays the same steps an uninterrupted run takes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from moe_rl.config import Config, ConfigError, validate_layout
from moe_rl.diagnostics import compute_mismatch
from moe_rl.metrics import combine
from moe_rl.rollout import Rollout, RolloutCollector
from moe_rl.rundir import RunDirectory
from moe_rl.timing import StepTimer
from moe_rl.update import PolicyLossFn, minibatch_rows

log = logging.getLogger("moe_rl.trainer")


def check_run_inputs(cfg: Config) -> None:
    """Starting weights and sampler capabilities, checked before any work."""
    init = cfg.run.init_checkpoint
    if not init and not cfg.run.resume:
        raise ConfigError("run.init_checkpoint is required: a moe_rl checkpoint or a Hugging Face directory "
                          "(the tiny recipes use moe_rl/assets/tiny_base)")
    if init and not Path(init).exists():
        raise ConfigError(f"run.init_checkpoint={init} does not exist (paths are relative to the working directory)")
    if cfg.rl.replay == "R3" and cfg.sampler.backend == "vllm" and not torch.cuda.is_available():
        raise ConfigError("rl.replay=R3 needs the sampler's routed experts, which vLLM cannot return on CPU "
                          "(no V2 model runner); use sampler.backend=transformers")


class Trainer:
    """Sequences the rollout collector and the learner(s); owns nothing they own."""

    def __init__(self, cfg: Config) -> None:
        from moe_rl.learner import init_distributed

        check_run_inputs(cfg)
        # The layout is checked against torchrun's WORLD_SIZE before any process group exists.
        validate_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        self.cfg = cfg
        separate = cfg.sampler.placement == "separate"
        self.rank, self.world = init_distributed(cfg.parallel.distributed_backend,
                                                 engine_ranks=cfg.sampler.engine_ranks if separate else 0)
        self.collector = RolloutCollector(cfg)
        self.run_dir = RunDirectory(cfg)
        self.records_routing = cfg.rl.records_routing
        self._stack = contextlib.ExitStack()
        self.start_step = 0

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        from moe_rl.learner import Learner, load_checkpoint, parallel_layout

        cfg = self.cfg
        resume_from = self.run_dir.prepare(cfg.run.resume, rank=self.rank)
        self.layout = self._stack.enter_context(parallel_layout(cfg.parallel, seed=cfg.run.seed))
        updates = cfg.run.steps * cfg.rl.epochs * cfg.rl.num_minibatches
        self.learner = Learner(cfg, self.layout, total_updates=updates)
        init = cfg.run.init_checkpoint
        if resume_from is not None:
            meta = load_checkpoint(self.learner, resume_from, trust=cfg.run.trust_checkpoint)
            self.start_step = int(meta.get("trainer_step", meta["step"]))
            log.info("resumed from %s at step %d", resume_from, self.start_step)
        elif init:
            self._load_init(self.learner, init)
        self.ref = None
        if cfg.rl.kl_coef > 0:
            if not init:
                raise ConfigError("rl.kl_coef > 0 needs run.init_checkpoint (the reference policy)")
            self.ref = Learner(cfg, self.layout, trainable=False)
            self._load_init(self.ref, init)
        self._stack.callback(self.collector.close)
        self.collector.start_sampler(self.run_dir.path, resume_from or (Path(init) if init else None))
        self.start_step = self.collector.placement.from_rank0(self.start_step)  # (to engine-only ranks)
        if self.rank == 0:
            self._stack.callback(self.run_dir.close)
            self.run_dir.start_logging(self.start_step)
        self._check_sampler_routing()

    def _load_init(self, learner: Any, path: str) -> None:
        from moe_rl.learner import load_checkpoint
        from moe_rl.learner.checkpoint import is_checkpoint
        from moe_rl.learner.hf_import import load_hf_weights

        p = Path(path)
        if is_checkpoint(p):
            load_checkpoint(learner, p, load_optimizer=False, trust=self.cfg.run.trust_checkpoint)
        elif (p / "config.json").is_file():
            load_hf_weights(learner, p)
        else:
            raise ConfigError(f"run.init_checkpoint={path} is neither a moe_rl checkpoint nor a Hugging Face directory")
        learner.step = 0

    def _check_sampler_routing(self) -> None:
        if self.cfg.rl.replay == "R3" and not self.collector.returns_routed_experts:
            raise ConfigError(
                f"rl.replay=R3 needs the sampler's routed experts; sampler.backend={self.cfg.sampler.backend} "
                "does not return them here (vLLM on CPU cannot); use sampler.backend=transformers"
            )

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> dict[str, float]:
        cfg, timer = self.cfg, StepTimer()
        t_step = time.perf_counter()
        rollout = self.collector.collect(step, timer)
        if self.rank == 0:
            self.run_dir.save_rollout(step, rollout)
        score = None
        with timer.phase("old_logprob"):
            if not cfg.rl.scores_in_update:
                score = self.learner.score(rollout.batch, cfg.sampler.temperature, self.learner.routing_plan(
                    cfg.rl.replay, capture=self.records_routing, sampler=rollout.sampler_routing))
            ref_logp = self.ref.logprobs(rollout.batch, cfg.sampler.temperature) if self.ref is not None else None
        with timer.phase("update"):
            metrics, score = self._update(step, rollout, score, ref_logp)
        metrics.update(self._rollout_metrics(rollout, score))
        with timer.phase("sync"):
            metrics.update(self._sync_weights())
        if self._eval_due(step):
            with timer.phase("eval"):
                metrics.update(self.collector.evaluate(step))
        timings = timer.seconds
        timings["step"] = time.perf_counter() - t_step
        timings["other"] = timings["step"] - sum(v for k, v in timings.items() if k != "step")
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        metrics["step"] = step
        return metrics

    def _rollout_metrics(self, rollout: Rollout, score: Any) -> dict[str, float]:
        """The rollout's statistics, sampler-learner mismatch and routing disagreement."""
        metrics: dict[str, float] = dict(rollout.stats)
        mask_BT = rollout.batch.response_mask()
        metrics.update(compute_mismatch(rollout.rollout_logp_BT, score.logp_BT, mask_BT, check_values=False).summary())
        if rollout.sampler_routing is not None and score.record is not None:
            metrics.update(self.learner.sampler_disagreement(score.record, rollout.sampler_routing, rollout.batch))
        return metrics

    def _update(self, step: int, rollout: Rollout, score: Any, ref_logp: torch.Tensor | None) -> tuple[dict, Any]:
        """`epochs x num_minibatches` optimizer steps on the rollout batch. Without `score`
        (the on-policy shortcut: one update, no replay), the update's own forward provides
        the old logprobs and routing record, returned as the step's score."""
        cfg, batch = self.cfg, rollout.batch
        extras = {"adv_B": rollout.adv_B, "rollout_logp_BT": rollout.rollout_logp_BT}
        if score is not None:
            extras["old_logp_BT"] = score.logp_BT
        if ref_logp is not None:
            extras["ref_logp_BT"] = ref_logp
        if score is None:
            plan = self.learner.routing_plan("none", capture=self.records_routing)
        elif self.records_routing:
            plan = self.learner.routing_plan(cfg.rl.replay, old=score.record, sampler=rollout.sampler_routing)
        else:
            plan = self.learner.routing_plan("none")
        loss_fn = PolicyLossFn(cfg, on_policy=score is None)
        updates = []
        for epoch in range(cfg.rl.epochs):
            for rows in minibatch_rows(batch.batch_size, cfg.rl.num_minibatches, self.layout.dp,
                                       seed=cfg.run.seed * 7919 + step * 31 + epoch):
                out, own = self.learner.train_step_scored(
                    batch.select(rows), loss_fn, {k: v[rows] for k, v in extras.items()}, cfg.sampler.temperature,
                    plan, row_ids=rows, scored=score is None)
                score = score or own
                updates.append({k if "/" in k else f"learner/{k}": v for k, v in out.items()})
        metrics = combine(updates)
        metrics["policy/updates"] = float(len(updates))
        return metrics, score

    def _sync_weights(self) -> dict[str, float]:
        """Colocated: every rank assembles the learner's full tensors (receiving only the
        pieces it lacks) and streams them into its own engine, in layer-aligned buckets.
        Separate: rank 0 assembles them and broadcasts the buckets to the engine ranks."""
        from moe_rl.learner.export import hf_named_tensors
        from moe_rl.learner.gather import SyncTraffic

        traffic = SyncTraffic()
        colocated = self.cfg.sampler.placement == "colocated"
        stream = hf_named_tensors(self.learner, dst=None if colocated else 0, traffic=traffic)
        report = self.collector.sync_weights(stream)
        mine = {**report.metrics(), "sync/bytes_received": float(traffic.bytes_received),
                "sync/bytes_sent": float(traffic.bytes_sent)}
        everyone = self.learner.all_gather_object(mine)
        per_rank = {f"{k}_rank{r}": v for r, m in enumerate(everyone) if len(everyone) > 1 for k, v in m.items()
                    if k in ("sync/seconds", "sync/bytes_received")}
        return {**mine, **per_rank, "sync/seconds_max": max(m["sync/seconds"] for m in everyone)}

    def _serve_rollouts(self) -> dict[str, Any]:
        """An engine-only rank (separate placement): sample its share of every step and take
        the weights after each update; the learner ranks do the rest."""
        with self._stack:
            self._stack.callback(self.collector.close)
            self.collector.start_sampler(self.run_dir.path, None)
            start = self.collector.placement.from_rank0(None)
            for step in range(start + 1, self.cfg.run.steps + 1):
                self.collector.collect(step, StepTimer())
                self.collector.receive_weights()
                if self._eval_due(step):
                    self.collector.evaluate(step)
        return {}

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.run.eval_every
        return bool(every) and (step % every == 0 or step == self.cfg.run.steps)

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        if not self.collector.placement.trains:
            return self._serve_rollouts()
        with self._stack:
            self.setup()
            t0 = time.perf_counter()
            bar = self._progress_bar()
            for step in range(self.start_step + 1, self.cfg.run.steps + 1):
                metrics = self.step(step)
                if self.rank == 0:
                    self.run_dir.log(step, metrics)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(_postfix(metrics), refresh=False)
                if (self.cfg.run.save_every and step % self.cfg.run.save_every == 0) or step == self.cfg.run.steps:
                    self._save(step)
            if self.rank != 0:
                return {}
            if self.cfg.run.export_hf:
                self._export_final()
            return self.run_dir.write_summary(time.perf_counter() - t0, self.world, self.layout.name)

    def _progress_bar(self) -> Any:
        if self.rank != 0 or not self.cfg.logging.progress:
            return None
        from tqdm.auto import tqdm

        bar = tqdm(total=self.cfg.run.steps, initial=self.start_step, desc=self.cfg.run.name, unit="step",
                   dynamic_ncols=True)
        self._stack.callback(bar.close)
        return bar

    def _save(self, step: int) -> None:
        from moe_rl.learner import save_checkpoint

        save_checkpoint(self.learner, self.run_dir.checkpoints / f"step_{step:06d}",
                        extra_meta={"trainer_step": step, "run_id": self.run_dir.run_id})
        if self.rank == 0:
            self.run_dir.rotate_checkpoints()

    def _export_final(self) -> None:
        """The final checkpoint as a Hugging Face directory, `<run>/hf` (rank 0): the source
        checkpoint's config.json, generation config and tokenizer files when the run started
        from one (`moe_rl.convert.hf_files`)."""
        from moe_rl.convert import megatron_to_hf

        final = self.run_dir.checkpoints / f"step_{self.cfg.run.steps:06d}"
        out = megatron_to_hf(final, self.run_dir.path / "hf", force=True)
        log.info("exported the final model to %s", out)

    def close(self) -> None:
        """Release the sampler, the logs and the layout (what `fit` does on its way out)."""
        self._stack.close()


def _postfix(m: dict[str, float]) -> dict[str, str]:
    keys = [("reward", "reward/mean"), ("gamma", "routing/gamma_mean"), ("flip", "routing/flip_rate_mean"),
            ("clip", "policy/clip_frac"), ("k3", "mismatch/k3"), ("s/step", "time/step")]
    # (the learner's own metrics are logged as learner/loss, learner/grad_norm, learner/lr)
    return {short: f"{m[k]:.3g}" for short, k in keys if k in m}


def train(cfg: Config) -> dict[str, Any]:
    """Run a whole training job (what `python -m moe_rl.train` calls)."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    return Trainer(cfg).fit()
