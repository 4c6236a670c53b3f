"""The RL program on the ranks that train: collect -> score -> update -> sync, one step.

One step, on every training rank (docs/step.md):
  1. collect (`moe_rl.rollout`): every rollout group's engine samples its block of the
     problems, G responses each; rewards, dynamic sampling, advantages; each data-parallel
     rank receives only its rows, as a `StepBatch`;
  2. score: the learner recomputes old logprobs and records routing for those rows (R3:
     replaying the sampler's; skipped under the on-policy shortcut, and under bypass,
     `rl.old_logprobs=sampler`, where the sampler's log-probs are the old ones); a
     reference model scores them when `kl_coef > 0`; the step
     components (`component.StepComponent`: PPO's critic) give their advantages;
  3. update: `epochs x num_minibatches` optimizer steps with the objective's loss
     (`moe_rl.programs.rl.policy_loss`), under the learner's routing plan (router shift, R2/R3 replay), then
     each step component's (PPO's critic) on the same mini-batches;
  4. sync: `collector.weight_sync` pushes the weights to the engines, whatever the placement.
The run loop (`moe_rl.loop`) does the rest: evaluation, logging, checkpoints, signals.
Determinism: problems, sampler seeds and mini-batch shuffles derive from (run.seed, step)
and the data-parallel size alone, so a run resumed from a checkpoint at the same layout replays
the steps an uninterrupted run takes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from moe_rl.checkpoints.directories import step_dir_name
from moe_rl.config import (
    Config,
    CriticConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RLConfig,
    RunConfig,
    SamplerConfig,
    to_dict,
)
from moe_rl.config.critic import critic_warmup_steps
from moe_rl.loop import Program
from moe_rl.programs.rl.component import StepComponent, models_of
from moe_rl.programs.rl.step_metrics import mismatch_metrics
from moe_rl.programs.rl.update_phase import UpdatePhase
from moe_rl.rollout import Rollout, RolloutCollector
from moe_rl.rollout.engine_faults import EnginesRebuilt
from moe_rl.runtime.atomic import atomic_write_text
from moe_rl.runtime.timing import StepTimer
from moe_rl.step_batch import StepBatch

if TYPE_CHECKING:  # (the learner package imports megatron-core: loaded when a learner exists)
    from moe_rl.learner.checkpoint import PendingSave
    from moe_rl.learner.parallel import Layout

log = logging.getLogger(__name__)
T = TypeVar("T")


def join_rl_world(cfg: Config) -> tuple[int, int]:
    """Join the torchrun world (a separate placement's worlds included); only the ranks that
    train then import megatron-core and apply its patches (`init_distributed`): an
    engine-only rank never does (seconds of start-up on the path of step 1's rollouts).
    Returns (rank, world)."""
    from moe_rl.runtime.process_group import join_world

    engine_ranks = cfg.sampler.engine_ranks if cfg.sampler.placement == "separate" else 0
    rank, world = join_world(cfg.parallel.distributed_backend, engine_ranks=engine_ranks)
    if rank < world - engine_ranks:
        from moe_rl.learner import init_distributed

        init_distributed(cfg.parallel.distributed_backend, engine_ranks=engine_ranks)
    return rank, world


class LearnerRole(Program):
    """Sequences the rollout collector and the learner(s); owns nothing they own."""

    name = "rl"

    def __init__(self, collector: RolloutCollector, rank: int, world: int, *, model: ModelConfig,
                 parallel: ParallelConfig, optimizer: OptimizerConfig, rl: RLConfig, sampler: SamplerConfig,
                 critic: CriticConfig, run: RunConfig, logging_cfg: LoggingConfig, recipe: Mapping[str, Any]) -> None:
        """`sampler`: the sampling settings the learner's log-probs follow (temperature,
        max_new_tokens); `critic`: PPO's value model (read when rl.uses_critic); `recipe`:
        the resolved recipe's plain data, saved with every checkpoint."""
        self.collector, self.rank, self.world = collector, rank, world
        self.model_cfg, self.parallel, self.optimizer, self.rl = model, parallel, optimizer, rl
        self.sampler, self.critic, self.run, self.logging, self.recipe = sampler, critic, run, logging_cfg, recipe
        self._stack = contextlib.ExitStack()

    @classmethod
    def check(cls, cfg: Config, world: int) -> str:
        """The RL program's checks (`moe_rl.preflight.check_run`) and its `--check` line."""
        from moe_rl.preflight import check_rl_recipe

        return check_rl_recipe(cfg, world)

    @classmethod
    def build(cls, cfg: Config) -> Program:
        """This rank's role in an RL run, after every input check (once, against torchrun's
        WORLD_SIZE, before anything is built): every rank builds the rollout collector; the
        ranks that train are a `LearnerRole`, the engine-only ranks of a separate placement
        an `EngineRole`."""
        import torch

        from moe_rl.programs.rl.engine_role import EngineRole
        from moe_rl.sampler.precision import resolve_precision
        from moe_rl.weights import make_weight_synchronizer
        from moe_rl.weights.verify import attach_verifier

        cls.check(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        rank, world = join_rl_world(cfg)
        make_sync = partial(make_weight_synchronizer, bucket_mib=cfg.sampler.weight_sync_bucket_mib,
                            sync=cfg.sampler.sync, full_sync_every=cfg.sampler.full_sync_every,
                            precision=resolve_precision("auto", torch.cuda.is_available())
                            if cfg.sampler.precision == "auto" else cfg.sampler.precision)
        collector = RolloutCollector(sampler=cfg.sampler, task=cfg.task, rl=cfg.rl, model=cfg.model,
                                     parallel=cfg.parallel, run=cfg.run, make_sync=make_sync)
        attach_verifier(collector, cfg.sampler.verify_every, cfg.run.seed, cfg.sampler.backend)
        if not collector.placement.trains:
            return EngineRole(collector, rank, world, rl=cfg.rl, run=cfg.run)
        return cls(collector, rank, world, model=cfg.model, parallel=cfg.parallel, optimizer=cfg.optimizer, rl=cfg.rl,
                   sampler=cfg.sampler, critic=cfg.critic, run=cfg.run, logging_cfg=cfg.logging, recipe=to_dict(cfg))

    # ------------------------------------------------------------------ setup

    def setup(self, resume_from: Path | None) -> int:
        from moe_rl.learner import Learner, load_checkpoint, load_start, parallel_layout
        from moe_rl.learner.offload import HostOffload

        run, init = self.run, self.run.init_checkpoint
        self.layout = self._stack.enter_context(parallel_layout(self.parallel, seed=run.seed))
        self.layout_name = self.layout.name
        self.learner = Learner(self.model_cfg, self.parallel, self.layout, optimizer=self.optimizer,
                               total_updates=actor_updates(self.rl, self.critic, run.steps))
        self.components = step_components(self.rl, self.critic, self.model_cfg, self.parallel, run.steps, self.layout)
        start = 0
        if resume_from is not None:
            meta = load_checkpoint(self.learner, resume_from, trust=run.trust_checkpoint,
                                   components=models_of(self.components),
                                   missing_hint="; ".join(c.missing_hint for c in self.components))
            start = int(meta.get("trainer_step", meta["step"]))
            for component in self.components:
                component.restore(meta)
            log.info("resumed from %s at step %d", resume_from, start)
        else:
            if init:
                load_start(self.learner, init, run.trust_checkpoint)
            for component in self.components:
                component.start(init, run.trust_checkpoint)
        trained = [self.learner, *models_of(self.components).values()]
        self._offload = [HostOffload(m) for m in trained] if self.optimizer.offload_during_rollout else None
        self.ref = None
        if self.rl.kl_coef > 0:  # (the preflight made sure there is an init checkpoint)
            self.ref = Learner(self.model_cfg, self.parallel, self.layout)  # (frozen: no optimizer)
            load_start(self.ref, init, run.trust_checkpoint)
        self.collector.start_sampler(run.run_dir, resume_from or (Path(init) if init else None))
        start = self.collector.placement.from_rank0(start)  # (to engine-only ranks)
        self.collector.weight_sync.held_version = start
        self.collector.assign_rows(self.layout.dp_rank)
        self.updates = UpdatePhase(self.rl, self.sampler, run.seed, self.learner, self.components, self.layout.dp,
                                   self.rank)
        return start

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> dict[str, float]:
        rl, temperature, timer = self.rl, self.sampler.temperature, StepTimer()
        with self._learner_on_host(timer) as offloaded:
            rollout = self._again_if_rebuilt(lambda: self.collector.collect(step, timer), version=step - 1)
        batch = rollout.batch
        assert batch is not None and batch.sampler_logp_BT is not None  # (a training rank's rows, as sampled)
        with timer.phase("old_logprob"):
            if rl.old_logprobs == "sampler":  # bypass: the sampler's log-probs are the behaviour policy
                batch = batch.scored(batch.sampler_logp_BT, None)
            elif not rl.scores_in_update or not self.updates.actor_trains(step):
                plan = self.learner.routing_plan(rl.replay, batch, capture=rl.records_routing)
                score = self.learner.score(batch, plan, temperature)
                batch = batch.scored(score.logp_BT, score.record)
            if self.ref is not None:
                batch = batch.with_reference(self.ref.score(batch, temperature=temperature).logp_BT)
        component_metrics: dict[str, float] = {}
        for component in self.components:  # (PPO's critic: values -> token advantages)
            with timer.phase("values"):
                batch, more = component.advantages(batch, self.learner.dp_gather_object)
            component_metrics.update(more)
        with timer.phase("update"):
            metrics, batch = self.updates.run(step, batch)
        self._save_rollout(step, rollout, batch)
        metrics.update(component_metrics)
        metrics.update(rollout.stats)
        if offloaded is not None:
            metrics["learner/offloaded_gib"] = offloaded / 2**30
        metrics.update(mismatch_metrics(self.learner, batch, step, rl.max_staleness, rl.segmented))
        with timer.phase("sync"):
            metrics.update(self.collector.weight_sync.push(self.learner, version=step))
        metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        return self._again_if_rebuilt(lambda: self.collector.evaluate(step), version=step)

    def _again_if_rebuilt(self, collective: Callable[[], T], version: int) -> T:
        """`collective()` (the rollout, the evaluation), again after engines rebuilt from
        their starting weights when a generate call failed (`moe_rl.rollout.engine_faults`):
        first this learner pushes the weights they lacked (its own, `version`) once more."""
        while True:
            try:
                return collective()
            except EnginesRebuilt:
                self.collector.weight_sync.push(self.learner, version=version)

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

    def _save_rollout(self, step: int, rollout: Rollout, scored: StepBatch) -> None:
        """Every data-parallel rank's rows to rank 0, as `<run>/rollouts/step_<n>.jsonl`, when
        a dump is due (a debugging aid: the only time rows travel to one rank), with the
        learner's log-probs from `scored`, the step's batch after its updates."""
        import json

        every = self.logging.rollouts_every
        if not every or step % every:
            return
        rows = [r for part in self.learner.dp_gather_object(rollout.dump_rows(scored)) for r in part]
        if self.rank == 0:
            atomic_write_text(self.run.run_dir / "rollouts" / f"{step_dir_name(step)}.jsonl",
                              "".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["row"])))

    # ------------------------------------------------------------------ state and the end

    def save(self, path: Path, meta: dict[str, Any], background: bool = False) -> PendingSave:
        from moe_rl.learner.checkpoint import start_checkpoint

        state = {k: v for component in self.components for k, v in component.state().items()}
        return start_checkpoint(self.learner, path, recipe=self.recipe, extra_meta={**meta, **state},
                                components=models_of(self.components), background=background)

    def finish(self, last_step: int, final: Path) -> None:
        """The final checkpoint as a Hugging Face directory, `<run>/hf` (rank 0): the source
        checkpoint's config.json, generation config and tokenizer files when the run started
        from one (`moe_rl.convert.hf_files`)."""
        if self.rank != 0 or not self.run.export_hf:
            return
        from moe_rl.convert import megatron_to_hf

        log.info("exported the final model to %s", megatron_to_hf(final, self.run.run_dir / "hf", force=True))

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """First and last rewards, the run's settings, median timings."""
        rewards = [h["reward/mean"] for h in history if "reward/mean" in h]
        step_times = [h["time/step"] for h in history if "time/step" in h]
        timing_keys = sorted({k for h in history for k in h if k.startswith("time/")})
        rl = self.rl
        return {
            "reward_first10": statistics.fmean(rewards[:10]) if rewards else float("nan"),
            "reward_last10": statistics.fmean(rewards[-10:]) if rewards else float("nan"),
            "objective": rl.objective, "replay": rl.replay, "rollout_correction": rl.rollout_correction,
            "num_minibatches": rl.num_minibatches,
            "median_step_seconds": statistics.median(step_times) if step_times else float("nan"),
            "median_timings": {k: statistics.median(h[k] for h in history if k in h) for k in timing_keys},
        }

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        """The bar's figures: reward, routing, clipping, mismatch, the step's seconds and the
        throughput per GPU of the engines and the learner (with its MFU on a GPU)."""
        keys = [("reward", "reward/mean"), ("gamma", "routing/gamma_mean"), ("flip", "routing/flip_rate_mean"),
                ("clip", "policy/clip_frac"), ("k3", "mismatch/k3"), ("s/step", "time/step")]
        # (the learner's own metrics are logged as learner/loss, learner/grad_norm, learner/lr)
        out = {short: f"{metrics[k]:.3g}" for short, k in keys if k in metrics}
        rates = [("gen tok/s/gpu", "perf/engine_tokens_per_s_per_gpu"),
                 ("train tok/s/gpu", "perf/learner_tokens_per_s_per_gpu")]
        out.update({short: f"{metrics[k]:.0f}" for short, k in rates if k in metrics})
        if "perf/mfu_learner" in metrics:
            out["mfu"] = f"{metrics['perf/mfu_learner']:.1%}"
        return out

    def close(self) -> None:
        """Release the sampler and the layout."""
        with self._stack:
            self.collector.close()


def actor_updates(rl: RLConfig, critic: CriticConfig, run_steps: int) -> int:
    """The actor's optimizer steps over the run, its schedule's length: rl.epochs x
    rl.num_minibatches per step that trains it (all but the critic's warm-up steps). A
    value-pretraining run (warm-up = run.steps) never steps the actor: its schedule then spans
    run.steps x those passes (the length its checkpoints have always recorded)."""
    per_step = rl.epochs * rl.num_minibatches
    return (run_steps - critic_warmup_steps(critic, rl.uses_critic)) * per_step or max(1, run_steps * per_step)


def step_components(rl: RLConfig, critic: CriticConfig, model: ModelConfig, parallel: ParallelConfig, run_steps: int,
                    layout: Layout) -> list[StepComponent]:
    """The models the recipe trains beside the actor: PPO's critic when the advantage
    estimator needs one (the registry says so), else none."""
    if not rl.uses_critic:
        return []
    from moe_rl.programs.ppo.critic_stage import CriticStage

    return [CriticStage(critic, rl, model, parallel, layout, run_steps=run_steps)]

