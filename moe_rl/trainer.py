"""The RL loop: collect -> score -> update -> sync -> log/checkpoint.

    trainer = Trainer(cfg)          # inside torchrun or a plain process
    summary = trainer.fit()

One step, on every rank of the torchrun world (docs/step.md):
  1. collect (`moe_rl.rollout`): every rollout group's engine samples its block of the
     problems, G responses each; rewards, dynamic sampling, advantages; each data-parallel
     rank receives only its rows, as a `StepBatch`;
  2. score: the learner recomputes old logprobs and records routing for those rows (R3:
     replaying the sampler's); a reference model scores them when `kl_coef > 0`;
  3. update: `epochs x num_minibatches` optimizer steps with the objective's loss
     (`moe_rl.update`), under the learner's routing plan (router shift, R2/R3 replay);
  4. sync: `collector.weight_sync` pushes the weights to the engines, whatever the placement;
  5. log and checkpoint (`moe_rl.rundir`); SIGINT / SIGTERM end the step, save and exit.
Determinism: problems, sampler seeds and mini-batch shuffles derive from (run.seed, step)
and the data-parallel size alone, so a run resumed from a checkpoint at the same layout replays
the steps an uninterrupted run takes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from moe_rl.config import Config
from moe_rl.config.critic import critic_minibatches
from moe_rl.diagnostics import combine_mismatch_summaries, compute_mismatch
from moe_rl.interrupt import StopOnSignal, StoppedBySignal
from moe_rl.metrics import combine
from moe_rl.preflight import check_run
from moe_rl.rollout import Rollout, RolloutCollector, Sampled
from moe_rl.rundir import RunDirectory
from moe_rl.step_batch import StepBatch
from moe_rl.timing import StepTimer
from moe_rl.update import PolicyLossFn, minibatch_rows, shuffle_seed

log = logging.getLogger("moe_rl.trainer")



class Trainer:
    """Sequences the rollout collector and the learner(s); owns nothing they own."""

    def __init__(self, cfg: Config) -> None:
        from moe_rl.learner import init_distributed

        # Every input check, once, against torchrun's WORLD_SIZE, before anything is built.
        check_run(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        self.cfg = cfg
        separate = cfg.sampler.placement == "separate"
        self.rank, self.world = init_distributed(cfg.parallel.distributed_backend,
                                                 engine_ranks=cfg.sampler.engine_ranks if separate else 0)
        self.collector = RolloutCollector(cfg)
        self.run_dir = RunDirectory(cfg)
        self.records_routing = cfg.rl.records_routing
        self._stack = contextlib.ExitStack()
        self.start_step = 0
        self._said_fewer_updates = False

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        from moe_rl.learner import Learner, load_checkpoint, parallel_layout
        from moe_rl.learner.offload import HostOffload

        cfg = self.cfg
        resume_from = self.run_dir.prepare(cfg.run.resume, rank=self.rank)
        self.layout = self._stack.enter_context(parallel_layout(cfg.parallel, seed=cfg.run.seed))
        actor_steps = cfg.run.steps - (cfg.critic.warmup_steps if cfg.rl.advantage == "gae" else 0)
        self.learner = Learner(cfg, self.layout, total_updates=actor_steps * cfg.rl.epochs * cfg.rl.num_minibatches)
        init = cfg.run.init_checkpoint
        self.ppo = self._critic_stage()
        critic = self.ppo.critic if self.ppo is not None else None
        if resume_from is not None:
            meta = load_checkpoint(self.learner, resume_from, trust=cfg.run.trust_checkpoint, critic=critic)
            self.start_step = int(meta.get("trainer_step", meta["step"]))
            if self.ppo is not None:
                self.ppo.restore(meta)
            log.info("resumed from %s at step %d", resume_from, self.start_step)
        else:
            if init:
                self._load_init(self.learner, init)
            if critic is not None and (cfg.critic.init_checkpoint or init):
                from moe_rl.learner.start import load_critic_start

                # (a PPO checkpoint's saved critic, value head included; other weights: head at zero)
                load_critic_start(critic, cfg.critic.init_checkpoint or init, cfg.run.trust_checkpoint,
                                  key="critic.init_checkpoint" if cfg.critic.init_checkpoint else "run.init_checkpoint")
        trained = [self.learner] + ([critic] if critic is not None else [])
        self._offload = [HostOffload(m) for m in trained] if cfg.optimizer.offload_during_rollout else None
        self.ref = None
        if cfg.rl.kl_coef > 0:  # (the preflight made sure there is an init checkpoint)
            self.ref = Learner(cfg, self.layout, trainable=False)
            self._load_init(self.ref, init)
        self._stack.callback(self.collector.close)
        self.collector.start_sampler(self.run_dir.path, resume_from or (Path(init) if init else None))
        self.start_step = self.collector.placement.from_rank0(self.start_step)  # (to engine-only ranks)
        self.collector.weight_sync.held_version = self.start_step
        self.collector.assign_rows(self.layout.dp_rank)
        if self.rank == 0:
            self._stack.callback(self.run_dir.close)
            self.run_dir.start_logging(self.start_step)

    def _critic_stage(self) -> Any:
        """PPO's critic (`rl.advantage: gae`), or None."""
        if self.cfg.rl.advantage != "gae":
            return None
        from moe_rl.ppo import CriticStage

        cfg = self.cfg
        return CriticStage(cfg, self.layout, updates=cfg.run.steps * cfg.critic.epochs * critic_minibatches(cfg))

    def _load_init(self, learner: Any, path: str) -> None:
        """Starting weights from a moe_rl checkpoint or a Hugging Face directory."""
        from moe_rl.learner import load_start

        load_start(learner, path, self.cfg.run.trust_checkpoint)

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> dict[str, float]:
        cfg, timer = self.cfg, StepTimer()
        t_step = time.perf_counter()
        with self._learner_on_host(timer) as offloaded:
            rollout = self.collector.collect(step, timer)
        self._save_rollout(step, rollout)
        batch = rollout.batch
        with timer.phase("old_logprob"):
            if not cfg.rl.scores_in_update or self._critic_warmup(step):
                plan = self.learner.routing_plan(cfg.rl.replay, batch, capture=self.records_routing)
                score = self.learner.score(batch, plan, cfg.sampler.temperature)
                batch = batch.scored(score.logp_BT, score.record)
            if self.ref is not None:
                batch = batch.with_reference(self.ref.score(batch, temperature=cfg.sampler.temperature).logp_BT)
        ppo_metrics: dict[str, float] = {}
        if self.ppo is not None:
            with timer.phase("values"):
                batch, ppo_metrics = self.ppo.advantages(batch, self.learner.dp_gather_object)
        with timer.phase("update"):
            metrics, batch = self._update(step, batch)
        metrics.update(ppo_metrics)
        metrics.update(rollout.stats)
        if offloaded is not None:
            metrics["learner/offloaded_gib"] = offloaded / 2**30
        metrics.update(self._mismatch_metrics(batch, step))
        with timer.phase("sync"):
            metrics.update(self._sync_weights(step))
        if self._eval_due(step):
            with timer.phase("eval"):
                metrics.update(self.collector.evaluate(step))
        timings = timer.seconds
        timings["step"] = time.perf_counter() - t_step
        timings["other"] = timings["step"] - sum(v for k, v in timings.items() if k != "step")
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        metrics["step"] = step
        return metrics

    @contextlib.contextmanager
    def _learner_on_host(self, timer: StepTimer) -> Iterator[int | None]:
        """`optimizer.offload_during_rollout`: the learner's (and PPO's critic's) grads and
        optimizer states wait on the host while the engines sample (yields the bytes moved;
        None when off)."""
        if self._offload is None:
            yield None
            return
        with timer.phase("offload"):
            moved = sum(part.offload() for part in self._offload)
        try:
            yield moved
        finally:
            with timer.phase("offload"):
                for part in self._offload:
                    part.reload()

    def _mismatch_metrics(self, batch: StepBatch, step: int) -> dict[str, float]:
        """Sampler-learner mismatch over every data-parallel rank's rows (each rank measures
        its own; the scalars are combined by count), split by staleness under asynchronous
        rollout (`mismatch/k3_stale0`, ...), and the routing disagreement."""
        mask_BT = batch.response_mask()
        mine = compute_mismatch(batch.sampler_logp_BT, batch.old_logp_BT, mask_BT, check_values=False)
        metrics = combine_mismatch_summaries(self.learner.dp_gather_object(mine.summary()))
        for stale in range(1 + self.cfg.rl.max_staleness) if self.cfg.rl.max_staleness else ():
            rows = (step - 1) - batch.version_B == stale
            part = compute_mismatch(batch.sampler_logp_BT[rows], batch.old_logp_BT[rows], mask_BT[rows],
                                    check_values=False)
            whole = combine_mismatch_summaries(self.learner.dp_gather_object(part.summary()))
            metrics[f"mismatch/k3_stale{stale}"] = whole["mismatch/k3"]
            metrics[f"mismatch/num_tokens_stale{stale}"] = whole["mismatch/num_tokens"]
        if batch.sampler_routing is not None and batch.old_routing is not None:
            metrics.update(self.learner.sampler_disagreement(batch.old_routing, batch))
        return metrics

    def _update(self, step: int, batch: StepBatch) -> tuple[dict[str, float], StepBatch]:
        """`epochs x num_minibatches` optimizer steps on the step's rows, each rank on its own
        rows of every mini-batch (the actor's, then under PPO the critic's on the same
        mini-batches). An unscored batch (the on-policy shortcut: one update, no replay)
        takes its old logprobs and routing record from the update's own forward."""
        metrics: dict[str, float] = {"policy/updates": 0.0}
        if not self._critic_warmup(step):
            metrics, batch = self._update_actor(batch, self._minibatches(step, batch, self.cfg.rl.epochs,
                                                                         self.cfg.rl.num_minibatches))
        if self.ppo is not None:  # (its own passes: epochs after the actor's reuse their shuffles)
            metrics.update(self.ppo.update(batch, self._minibatches(step, batch, self.cfg.critic.epochs,
                                                                    critic_minibatches(self.cfg))))
        return metrics, batch

    def _minibatches(self, step: int, batch: StepBatch, epochs: int, count: int) -> list[Any]:
        """`epochs` passes of `count` shuffled mini-batches (global row ids), a shuffle per
        (step, pass); the critic's passes reuse the actor's shuffles."""
        most = max(self.cfg.rl.epochs, self.cfg.critic.epochs)
        out = [rows for epoch in range(epochs)
               for rows in minibatch_rows(batch.step_rows, count, self.layout.dp,
                                          seed=shuffle_seed(self.cfg.run.seed, step, epoch, most))]
        if len(out) < epochs * count and not self._said_fewer_updates and self.rank == 0:
            self._said_fewer_updates = True  # (said once: policy/updates and critic/updates count every step's)
            log.warning("step %d: %d rows make %d of the %d mini-batches a pass asks for (dynamic sampling kept "
                        "fewer groups than rl.prompts_per_step): fewer optimizer updates this step, and the "
                        "learning-rate schedule runs behind", step, batch.step_rows, len(out) // epochs, count)
        return out

    def _update_actor(self, batch: StepBatch, minibatches: list[Any]) -> tuple[dict[str, float], StepBatch]:
        cfg = self.cfg
        loss_fn = PolicyLossFn(cfg, on_policy=batch.old_logp_BT is None)
        plan = self.learner.routing_plan(cfg.rl.replay if batch.old_logp_BT is not None else "none", batch,
                                         capture=self.records_routing)
        updates = []
        for rows in minibatches:
            result = self.learner.update(batch.take(rows), loss_fn, plan, cfg.sampler.temperature)
            if batch.old_logp_BT is None:
                batch = batch.scored(result.logp_BT, result.record)
            updates.append({k if "/" in k else f"learner/{k}": v for k, v in result.metrics.items()})
        metrics = combine(updates)
        metrics["policy/updates"] = float(len(updates))
        return metrics, batch

    def _critic_warmup(self, step: int) -> bool:
        """PPO's critic warm-up: the first `critic.warmup_steps` steps train the critic only."""
        return self.ppo is not None and step <= self.cfg.critic.warmup_steps

    def _save_rollout(self, step: int, rollout: Rollout) -> None:
        """Every data-parallel rank's rows to rank 0, when a dump is due (a debugging aid:
        the only time rows travel to one rank)."""
        every = self.cfg.logging.rollouts_every
        if not every or step % every:
            return
        rows = [r for part in self.learner.dp_gather_object(rollout.dump_rows()) for r in part]
        if self.rank == 0:
            self.run_dir.save_rollout(step, sorted(rows, key=lambda r: r["row"]))

    def _sync_weights(self, step: int) -> dict[str, float]:
        """Push the updated weights to the engines (`moe_rl.rollout.weight_sync`: the placement
        decides how), tagged with their version: the number of steps trained."""
        return self.collector.weight_sync.push(self.learner, version=step)

    def _serve_rollouts(self) -> dict[str, Any]:
        """An engine-only rank (separate placement): sample its share of every step and take
        the weights after each update; the learner ranks do the rest. Under
        `rl.max_staleness` it samples step n+1 before it takes step n's weights, so the
        sampling overlaps the learners' update (`moe_rl.rollout.ahead`)."""
        with self._stack:
            self._stack.callback(self.collector.close)
            self.collector.start_sampler(self.run_dir.path, None)
            start = self.collector.placement.from_rank0(None)
            self.collector.weight_sync.held_version = start
            self.collector.assign_rows(None)  # (trains on no rows)
            ahead = self._first_batch(start + 1) if self.cfg.rl.max_staleness else None
            with StopOnSignal() as stop:
                for step in range(start + 1, self.cfg.run.steps + 1):
                    timer = StepTimer()
                    self.collector.deliver(step, ahead or self.collector.sample(step, timer), timer)
                    if self.cfg.rl.max_staleness and step < self.cfg.run.steps:
                        ahead = self.collector.sample(step + 1, timer)
                        self.collector.save_ahead(self.run_dir.path, ahead)
                    t0 = time.perf_counter()
                    self.collector.weight_sync.receive()
                    self.collector.engine_wait = time.perf_counter() - t0
                    if self._eval_due(step):
                        self.collector.evaluate(step)
                    signum = self._agreed_stop(stop, step)  # (the learner ranks ask after their step)
                    if signum:
                        raise StoppedBySignal(signum)
        return {}

    def _first_batch(self, step: int) -> Sampled | None:
        """Asynchronous rollout's first batch: the one sampled ahead before a stop, when this
        run is resumed and every engine saved its share; else sampled now."""
        saved = self.collector.sampled_ahead(self.run_dir.path, step) if step > 1 else None
        return saved or self.collector.sample(step, StepTimer())

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
            with StopOnSignal() as stop:
                for step in range(self.start_step + 1, self.cfg.run.steps + 1):
                    metrics = self.step(step)
                    if self.rank == 0:
                        self.run_dir.log(step, metrics)
                        if bar is not None:  # postfix first: the line drawn at k/N shows step k's values
                            bar.set_postfix(_postfix(metrics), refresh=False)
                            bar.update(1)
                    signum = self._agreed_stop(stop, step)
                    if signum or self._save_due(step):
                        self._save(step)
                    if signum:
                        self._stop(step, signum, bar)
            if bar is not None:
                bar.close()  # its last line before the summary's (the stack's close is then a no-op)
            if self.rank != 0:
                return {}
            if self.cfg.run.export_hf:
                self._export_final()
            return self.run_dir.write_summary(time.perf_counter() - t0, self.world, self.layout.name)

    def _agreed_stop(self, stop: StopOnSignal, step: int) -> int | None:
        """Collective over every rank, once per step: the signal all ranks stop for after
        `step` (None: go on; a signal during the last step lets the run finish)."""
        signum = stop.agreed()
        return signum if signum and step < self.cfg.run.steps else None

    def _save_due(self, step: int) -> bool:
        every = self.cfg.run.save_every
        return (bool(every) and step % every == 0) or step == self.cfg.run.steps

    def _stop(self, step: int, signum: int, bar: Any) -> NoReturn:
        """After `step`'s checkpoint: say what happened and how to go on, and leave with the
        signal's exit status (130 for SIGINT, 143 for SIGTERM)."""
        if bar is not None:
            bar.close()
        if self.rank == 0:
            log.warning("stopped by %s after step %d of %d, saved in %s; to continue, run the same command with "
                        "run.resume=true", signal.Signals(signum).name, step, self.cfg.run.steps,
                        self.run_dir.checkpoints / f"step_{step:06d}")
        raise StoppedBySignal(signum)

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

        stage = self.ppo.state() if self.ppo is not None else {}
        save_checkpoint(self.learner, self.run_dir.checkpoints / f"step_{step:06d}",
                        extra_meta={"trainer_step": step, "run_id": self.run_dir.run_id, **stage},
                        critic=self.ppo.critic if self.ppo is not None else None)
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
    from moe_rl.cli import compile_off_without_gpu

    compile_off_without_gpu()
    return Trainer(cfg).fit()
