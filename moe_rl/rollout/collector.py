"""One step's rollout: problems -> engines -> rewards -> (dynamic sampling) -> batch.

    collector = RolloutCollector(sampler=cfg.sampler, task=cfg.task, rl=cfg.rl, model=cfg.model,
                                 parallel=cfg.parallel, run=cfg.run,
                                 make_sync=make_sync)  # task, tokenizer, engine placement, weight sync
    collector.start_sampler(run_dir, weights_source)   # one engine per rollout group
    collector.assign_rows(dp_rank)                     # where each step's rows are trained on
    rollout = collector.collect(step, timer)  # collective: each rank gets its rows
    collector.weight_sync.push(learner, version)       # after the learner's update (moe_rl.weights)

Every rank of the torchrun world belongs to a rollout group with one engine
(`placement.EnginePlacement`); each engine samples its block of the step's prompts. Every
rank learns every group's summary (rewards, lengths: what dynamic sampling, advantages and
statistics need), and each training row travels once, from the engine that sampled it to
the ranks of the data-parallel rank that trains on it (row % dp). Determinism: problems and per-prompt sampler
seeds derive from (run.seed, step, draw, prompt index) alone, so the rollouts are the same
whatever the number of engines, and a resumed run replays what an uninterrupted run samples.
An engine's failed generate call is agreed over the engine ranks and retried on rebuilt
engines while sampler.max_restarts lasts, else the run stops with one line (`engine_faults`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_rl.config import (
    ModelConfig,
    ParallelConfig,
    RLConfig,
    RunConfig,
    SamplerConfig,
    TaskConfig,
)
from moe_rl.rollout.ahead import agreed_ahead, engines_lacking, save_ahead
from moe_rl.rollout.engine_faults import (
    EngineFailedError,
    EngineFault,
    EngineNote,
)
from moe_rl.rollout.engines import Engines, WeightTransport
from moe_rl.rollout.episodes import Episodes
from moe_rl.rollout.evaluate import HeldOut
from moe_rl.rollout.learning_signal import LearningSignalWatch
from moe_rl.rollout.packing import pack_rows, plan_step, staleness_stats
from moe_rl.rollout.placement import EnginePlacement, concat
from moe_rl.rollout.pool import RolloutPool
from moe_rl.rollout.types import GroupSummary, Rollout, RowSample, Sampled, ScoredGroup
from moe_rl.runtime.failures import describe_error
from moe_rl.runtime.fault_hooks import kill_point
from moe_rl.runtime.timing import StepTimer
from moe_rl.sampler import Sampler
from moe_rl.sampler.base import SleepingSampler, base_seeds
from moe_rl.tasks import make_task
from moe_rl.tasks.base import Problem
from moe_rl.tokenization import PromptEncoder, load_tokenizer

log = logging.getLogger(__name__)


class RolloutCollector:
    """Owns the task, the tokenizer and this rank's engine (shard)."""

    def __init__(self, *, sampler: SamplerConfig, task: TaskConfig, rl: RLConfig, model: ModelConfig,
                 parallel: ParallelConfig, run: RunConfig,
                 make_sync: Callable[[EnginePlacement], WeightTransport] | None = None,
                 placement: EnginePlacement | None = None) -> None:
        """The run's sections: `sampler` (the engines), `task` (problems, tokenizer, rewards),
        `rl` (the step's groups), `model` and `parallel` (the learner's batch layout), `run`
        (seed, starting checkpoint, evaluation). `make_sync(placement)`: the weight transport
        the engines receive updates through (`moe_rl.weights.make_weight_synchronizer`,
        collective: every rank, here); None: the engines keep their starting weights (an
        evaluation)."""
        self.sampler_cfg, self.task_cfg, self.rl_cfg, self.model_cfg = sampler, task, rl, model
        self.tp, self.seed = parallel.tensor_model_parallel_size, run.seed
        separate = sampler.placement == "separate"
        self.placement = placement or EnginePlacement.current(sampler.tensor_parallel_size,
                                                              sampler.engine_ranks if separate else 0)
        self.weight_sync: WeightTransport = make_sync(self.placement) if make_sync is not None else FixedWeights()
        self.engines = Engines(self.placement, self.weight_sync, sampler=sampler, rl=rl, seed=run.seed,
                               trust_checkpoint=run.trust_checkpoint)  # (collective too)
        self.task = make_task(task)
        self.tok = load_tokenizer(task.tokenizer, run.init_checkpoint)  # (checked by the preflight)
        self.prompts = PromptEncoder.from_config(task, self.tok)
        self.episodes = (Episodes(self.task, self.tok, self.prompts.template, rl=rl, task_cfg=task,
                                  max_new_tokens=sampler.max_new_tokens) if rl.multi_turn else None)
        """Multi-turn episodes' environments and template (`episodes`); None: one response each."""
        self.learner_wait = 0.0
        """Seconds the last `deliver` waited for the engines (a learner-only rank)."""
        self.engine_wait = 0.0
        """Seconds this engine last waited for the learner's weights (set by the trainer)."""
        self.held_out = HeldOut(task, run)
        self._row_owners: list[int | None] = [0] * self.placement.world  # (until assign_rows: all rows everywhere)
        self._dp = 1
        self._signal = LearningSignalWatch(rl.dynamic_sampling, group_advantages=not rl.uses_critic)

    @property
    def pad_id(self) -> int:
        return self.tok.pad_id

    @property
    def sampler(self) -> Sampler | None:
        """This rank's engine (`engines`), None on a learner-only rank."""
        return self.engines.sampler

    @property
    def returns_routed_experts(self) -> bool:
        """Every engine returns its routed experts (known after `start_sampler`)."""
        return self.engines.returns_routed_experts

    def start_sampler(self, run_dir: Path, weights_source: Path | None) -> None:
        """Build this rank's engine (shard) on the weights the learner starts from (`Engines.start`,
        collective)."""
        self.engines.start(run_dir, weights_source, self.tok.eos_ids)

    def problems(self, step: int, draw: int) -> list[Problem]:
        """The problems of one draw of (1-based) training step `step`: the first is the task's
        batch (a dataset walks its epochs), dynamic sampling's further draws are random ones
        seeded from (run.seed, step, draw)."""
        n = self.rl_cfg.prompts_per_step
        if draw == 0:
            return self.task.batch(step - 1, n, self.seed)
        return self.task.sample(n, np.random.default_rng([self.seed, step, draw]))

    def seeds(self, step: int, draw: int, num_problems: int) -> list[int]:
        """The base sampler seed of each problem of a draw (`base_seeds`: sample j of problem
        i draws with seed_i + j), from (run.seed, step, draw) alone."""
        return base_seeds(self.seed * 1_000_003 + step * 101 + draw, num_problems, self.rl_cfg.group_size)

    def assign_rows(self, dp_rank: int | None) -> None:
        """Tell the collector which data-parallel rank this rank trains as (None: an
        engine-only rank), so that each step's rows go only where they are trained on.
        Collective over every rank; call once, after the learner's layout exists."""
        self._row_owners = self.placement.all_gather(dp_rank)
        self._dp = 1 + max(r for r in self._row_owners if r is not None)

    def collect(self, step: int, timer: StepTimer) -> Rollout:
        """`sample` then `deliver`: the synchronous step. Collective over every rank."""
        return self.deliver(step, self.sample(step, timer), timer)

    def sample(self, step: int, timer: StepTimer) -> Sampled | None:
        """Generate and score step `step`'s groups (dynamic sampling: keep drawing until
        `prompts_per_step` groups with a reward spread are found, or `max_draws`) with the
        weights the engines hold now. Collective over the engine ranks only (none on a
        learner-only rank, which returns None): the engines can sample a coming step while
        the learner ranks train (`rl.max_staleness`). After an engine failure it raises
        `EnginesRebuilt` (the engines need the newest weights again) or `EngineFailedError`."""
        if not self.placement.hosts_engine:
            return None
        rl = self.rl_cfg
        out = Sampled(step, self.weight_sync.held_version or 0)
        while len(out.drawn) < (rl.max_draws if rl.dynamic_sampling else 1):
            summaries, mine, seconds, cut = self._draw(step, len(out.drawn), out.version, timer)
            out.reward_timeouts += cut
            out.held.update({(len(out.drawn), i): g for i, g in mine.items()})
            out.kept += [(len(out.drawn), i) for i, g in enumerate(summaries)
                         if not rl.dynamic_sampling or g.has_signal]
            out.drawn.append(summaries)
            out.engine_seconds.append(seconds)
            if len(out.kept) >= rl.prompts_per_step:
                break
        if not out.kept:  # no group with signal in any draw: the last draw trains with zero advantages
            log.warning("step %d: every group had equal rewards in %d draws", step, len(out.drawn))
            out.kept = [(len(out.drawn) - 1, i) for i in range(len(out.drawn[-1]))]
        out.kept = out.kept[: rl.prompts_per_step]
        if self.sampler_cfg.sleep_between_steps and isinstance(self.sampler, SleepingSampler):  # the learner's turn
            self.sampler.sleep()
        return out

    def sampled_from_groups(self, step: int, mine: list[ScoredGroup], seconds: float, dropped: int,
                            reward_timeouts: int = 0, aside: Sequence[ScoredGroup] = ()) -> Sampled:
        """Step `step`'s batch from groups this engine decoded in segments
        (`moe_rl.rollout.segmented`): every engine's summaries, in engine order, on every
        engine rank, and its own groups kept on its leader; the groups dynamic sampling set
        aside follow the kept ones in the draw (the statistics count them, nothing trains on
        them). Collective over the engine ranks."""
        p = self.placement
        parts = p.gather_engines(([g.summary() for g in mine], seconds, dropped, reward_timeouts,
                                  [g.summary() for g in aside]), self.engines.group)
        offset = sum(len(part[0]) for part in parts[: p.engine])
        summaries = concat([part[0] for part in parts])
        out = Sampled(step, self.weight_sync.held_version or 0, [(0, i) for i in range(len(summaries))],
                      [summaries + concat([part[4] for part in parts])], [[part[1] for part in parts]],
                      dropped_stale=sum(part[2] for part in parts), reward_timeouts=sum(part[3] for part in parts))
        if p.leader:
            out.held = {(0, offset + i): g for i, g in enumerate(mine)}
        return out

    def _engine_checks(self) -> dict[str, float]:
        """Separate engine ranks: the metrics of their last check after a push
        (`WeightSynchronizer.take_checks`; {} for a colocated or fixed transport, whose
        learner ranks log the check with the push)."""
        take = getattr(self.weight_sync, "take_checks", None)
        return take() if take is not None and not self.placement.trains else {}

    def weight_sync_ready(self) -> bool:
        """Every engine has begun to receive the learner's next weights (a pause point of
        the throughput schedule). Collective over the engine ranks, so that they agree."""
        return all(self.placement.gather_engines(self.weight_sync.poll(), self.engines.group))

    def sampled_ahead(self, run_dir: Path, step: int) -> Sampled | None:
        """The batch of `step` the engines sampled ahead before a stop, when every engine has
        its share (`moe_rl.rollout.ahead.agreed_ahead`; collective over the engine ranks)."""
        return agreed_ahead(self.placement, self.engines.group, run_dir, step)

    def engines_lacking(self, why: str) -> list[str]:
        """Every engine's reason for lacking a file it needs on a resume (`ahead.engines_lacking`)."""
        return engines_lacking(self.placement, self.engines.group, why)

    def save_ahead(self, run_dir: Path, sampled: Sampled | None, keep: int = 3) -> None:
        """Keep a batch sampled ahead on disk (each engine leader its share) for a resume,
        with the `keep` newest before it."""
        p = self.placement
        if sampled is not None and p.leader and p.engine is not None:  # (a leader is an engine rank)
            save_ahead(run_dir, p.engine, (p.engines, p.ranks_per_engine), sampled, keep)

    def deliver(self, step: int, sampled: Sampled | EngineNote | None, timer: StepTimer) -> Rollout:
        """Hand each data-parallel rank its rows of step `step`'s sampled groups, dropping
        groups sampled more than `rl.max_staleness` weight pushes ago. Collective over every
        rank: every rank learns every group's summary and returns the same statistics, but
        holds only its own rows' tokens. An engine's `EngineNote` instead of a batch is raised
        on every rank (`engine_faults`: push the weights again, or stop)."""
        t0 = time.perf_counter()
        with timer.phase("gather"):
            got = self.placement.from_engines(
                sampled if isinstance(sampled, EngineNote) or sampled is None
                else (sampled.public(self.engine_wait), self.engines.restarts.used, self._engine_checks()))
        if isinstance(got, EngineNote):
            raise got.error()
        assert got is not None  # (the first engine rank's: it sampled)
        public, restarts, checks = got
        self.learner_wait = time.perf_counter() - t0 if not self.placement.hosts_engine else 0.0
        drawn, current = public.drawn, step - 1  # the learner's policy: the weights of `step - 1` pushes
        rl = self.rl_cfg
        kept = [(d, i) for d, i in public.kept if current - drawn[d][i].version <= rl.max_staleness]
        with timer.phase("reward"):
            plan = plan_step([drawn[d][i] for d, i in kept], [g for d in drawn for g in d], len(drawn), rl, self.tp)
        dropped = sum(len(drawn[d][i].response_lens) for d, i in public.kept if (d, i) not in kept)
        plan.stats.update(staleness_stats([drawn[d][i] for d, i in kept], current, dropped + public.dropped_stale))
        if self.task_cfg.agent:  # (every rank sees the same statistics: they stop together, before any row moves)
            from moe_rl.rollout.gateway.agents import check_agent_failures

            check_agent_failures(plan.stats, self.task_cfg.max_agent_failures_frac, self.task_cfg.agent, plan.rows)
        with timer.phase("gather"):
            rows = self._deliver(kept, sampled.held if isinstance(sampled, Sampled) else {},
                                 [len(drawn[d][i].response_lens) for d, i in kept])
        self._signal.observe(step, plan.stats["reward/zero_variance_frac"])
        if self._row_owners[self.placement.rank] is None:  # an engine-only rank trains on nothing
            rollout = Rollout(None, torch.zeros(0), [], plan.stats)
        else:
            rollout = Rollout(*pack_rows(rows, plan, self.model_cfg, self.sampler_cfg.max_new_tokens, self.pad_id),
                              stats=plan.stats)
        rollout.stats.update(self._engine_stats(public.engine_seconds, drawn))
        rollout.stats["reward/timeouts"] = float(public.reward_timeouts)
        rollout.stats["rollout/engine_restarts"] = float(restarts)
        rollout.stats.update(checks)  # (separate engines: their check of the last push, sampler.verify_every)
        rollout.stats.update({"time/learner_wait": self.learner_wait, "time/engine_wait": public.engine_wait})
        return rollout

    def _deliver(self, kept: list[tuple[int, int]], held: dict[tuple[int, int], ScoredGroup],
                 sizes: list[int]) -> list[RowSample]:
        """Send each kept group's `sizes[k]` responses (G, but for agent episodes), as
        training rows sum(sizes[:k]) + j, from the engine that sampled them to every rank of
        the data-parallel rank that holds the row (row % dp); return this rank's rows in row
        order. One all-to-all: nobody receives others' rows."""
        outgoing: list[list[RowSample]] = [[] for _ in self._row_owners]
        for k, key in enumerate(kept):
            group = held.get(key)
            if group is None:
                continue
            for j in range(sizes[k]):
                row = sum(sizes[:k]) + j
                for rank, owner in enumerate(self._row_owners):
                    if owner == row % self._dp:
                        outgoing[rank].append(group.row(j, row))
        incoming = self.placement.exchange(outgoing)
        return sorted((r for part in incoming for r in part), key=lambda r: r.row_id)

    def _draw(self, step: int, draw: int, version: int,
              timer: StepTimer) -> tuple[list[GroupSummary], dict[int, ScoredGroup], list[float], int]:
        """One draw of `prompts_per_step` problems, G responses each, scored: this engine's
        block sampled here and kept (by prompt index) on its leader; every group's summary
        gathered to every engine rank, with each engine's generation seconds, and the number
        of rewards cut at task.reward_timeout_s over the engines."""
        problems = self.problems(step, draw)
        seeds = self.seeds(step, draw, len(problems))
        share = self.placement.share(len(problems))
        draw_groups = (self._draw_agents if self.task_cfg.agent else
                       self._draw_responses if self.episodes is None else self._draw_episodes)
        groups, sample_seconds, cut = draw_groups(step, [problems[i] for i in share], [seeds[i] for i in share],
                                                  version, timer)
        mine = {share[i]: g for i, g in enumerate(groups)}
        with timer.phase("gather"):
            parts = self.placement.gather_engines(([g.summary() for g in mine.values()], sample_seconds, cut),
                                                  self.engines.group)
        summaries = concat([part for part, _, _ in parts])
        return (summaries, (mine if self.placement.leader else {}), [seconds for _, seconds, _ in parts],
                sum(cut for _, _, cut in parts))

    def _draw_responses(self, step: int, problems: list[Problem], seeds: list[int], version: int,
                        timer: StepTimer) -> tuple[list[ScoredGroup], float, int]:
        """This engine's problems of a draw, G single responses each, scored: the groups, the
        generation seconds and the rewards cut at task.reward_timeout_s."""
        s, G = self.sampler_cfg, self.rl_cfg.group_size
        prompt_ids = [self.prompts.encode(p) for p in problems]
        t0 = time.perf_counter()
        with timer.phase("sample"):
            ro = self.engines.generate(f"generating step {step}", prompt_ids, n=G, max_new_tokens=s.max_new_tokens,
                                temperature=s.temperature, top_p=s.top_p, prompt_seeds=seeds)
        sample_seconds = time.perf_counter() - t0  # (generation alone, as segmented decoding counts it)
        with timer.phase("reward"):
            texts = [self.tok.decode(r) for r in ro.response_token_ids]
            scores = self.task.score([problems[i] for i in ro.prompt_index], texts)
            rewards = scores.values
        groups = []
        for i, ids in enumerate(prompt_ids):
            sl = slice(i * G, (i + 1) * G)
            groups.append(ScoredGroup(ids, ro.response_token_ids[sl], ro.logprobs[sl], texts[sl], rewards[sl],
                                      ro.finish_reasons[sl],
                                      ro.routed_experts[sl] if ro.routed_experts is not None else None, version))
        return groups, sample_seconds, scores.timeouts

    def _draw_episodes(self, step: int, problems: list[Problem], seeds: list[int], version: int,
                       timer: StepTimer) -> tuple[list[ScoredGroup], float, int]:
        """This engine's problems of a draw, G multi-turn episodes each (`episodes`), decoded in
        rounds of at most rl.max_turn_tokens tokens until every engine's episodes are over
        (each round's failure agreed over the engine ranks, as `Engines.generate`'s)."""
        s, G, episodes = self.sampler_cfg, self.rl_cfg.group_size, self.episodes
        assert episodes is not None  # (a multi-turn task's collector has its episodes)
        pool = RolloutPool(s.max_new_tokens, episodes.max_turn_tokens, episodes)
        for i, (problem, seed) in enumerate(zip(problems, seeds)):
            episodes.admit(pool, (step, 0, i), problem, seed, G)
        t0 = time.perf_counter()
        with timer.phase("sample"):
            while True:
                kill_point("generate")
                fault = None
                if pool.running:
                    try:
                        if self.sampler is None:
                            raise RuntimeError("this rank has no engine (dropped after a failure)")
                        pool.segment(self.sampler, version, s.temperature, s.top_p)
                    except Exception as e:  # (whatever the engine raised; the round is retried on a rebuilt engine)
                        fault = EngineFault(self.placement.rank, describe_error(e))
                parts = self.placement.all_engines((fault, bool(pool.running)), self.engines.group)
                faults = [f for f, _ in parts if f is not None]
                if faults:
                    self.engines.recover(faults, f"generating step {step}", everywhere=self.engines.group is None)
                elif not any(running for _, running in parts):
                    break
        groups = [g.scored([self.tok.decode(r.tokens) for r in g.responses], g.episode_rewards()[0])
                  for g in sorted(pool.done, key=lambda g: g.key)]
        cut = sum(g.episode_rewards()[1] for g in pool.done)
        return groups, time.perf_counter() - t0, cut

    def _draw_agents(self, step: int, problems: list[Problem], seeds: list[int], version: int,
                     timer: StepTimer) -> tuple[list[ScoredGroup], float, int]:
        """This engine's problems of a draw, G episodes each through the agent program
        `task.agent` on the gateway (`moe_rl.rollout.gateway`); its rewards are the agent's."""
        from moe_rl.rollout.gateway.agents import draw_agent_groups

        t0 = time.perf_counter()
        with timer.phase("sample"):
            groups = draw_agent_groups(self.sampler, self.tok, self.prompts.template, self.task, task_cfg=self.task_cfg,
                                       rl=self.rl_cfg, sampler_cfg=self.sampler_cfg, problems=problems, seeds=seeds,
                                       version=version)
        return groups, time.perf_counter() - t0, 0

    def evaluate(self, step: int) -> dict[str, float]:
        """Greedy accuracy and pass@k on `task.eval_data_path`, every engine taking its block of
        the held-out problems (`evaluate.HeldOut`). Collective: every rank returns the same."""
        return self.held_out.evaluate(step, self.engines, self.prompts, self.tok, self.sampler_cfg, self.episodes)

    @property
    def last_eval_examples(self) -> list[dict[str, Any]]:
        """The last evaluation's examples (what the run loop logs)."""
        return self.held_out.last_examples

    def failed_alone(self, doing: str, e: Exception) -> EngineFailedError:
        """The run's end for an engine that failed on its own (`Engines.failed_alone`)."""
        return self.engines.failed_alone(doing, e)

    def _engine_stats(self, engine_seconds: list[list[float]], drawn: list[list[GroupSummary]]) -> dict[str, float]:
        """Each engine's generation seconds over the step's draws (the slowest and the fastest
        engine), and the engines' throughput (docs/step.md, "Throughput"): the response tokens
        of every group drawn (dynamic sampling's discarded groups too: they were generated)
        over each draw's slowest engine's seconds, summed (what the step waits for), and the
        engines' GPUs (processes on CPU)."""
        seconds_DE = np.array(engine_seconds)
        per_engine = seconds_DE.sum(axis=0)  # over draws
        tokens = float(sum(sum(g.response_lens) for draw in drawn for g in draw))
        waited = float(seconds_DE.max(axis=1).sum())
        gpus = self.placement.engines * self.placement.ranks_per_engine
        return {"sampler/engines": float(self.placement.engines),
                "sampler/sample_seconds_max": float(per_engine.max()),
                "sampler/sample_seconds_min": float(per_engine.min()),
                "perf/engine_tokens": tokens,
                "perf/engine_tokens_per_s_per_gpu": tokens / waited / gpus if waited > 0 else 0.0}

    def close(self) -> None:
        self.engines.close()  # (the last push's sends first, before the process groups go)
        self.task.close()  # (the reward worker; the evaluation's task shares it)


class FixedWeights:
    """The weight transport of a collector whose engines keep their starting weights."""

    held_version: int | None = None
    synced = False
    engines_group: Any = None

    def attach(self, engine: Sampler | None) -> None:
        """(nothing to deliver to it)"""

    def finish(self) -> None:
        """(nothing in flight)"""

    def push(self, learner: Any, version: int) -> dict[str, float]:
        raise RuntimeError("this collector's engines keep their starting weights: nothing pushes to them")

    def receive(self) -> object:
        raise RuntimeError("this collector's engines keep their starting weights: nothing arrives")

    def poll(self) -> bool:
        """(no push ever begins)"""
        return False
