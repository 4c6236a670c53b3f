"""An engine rank's rollout with in-flight weight updates and partial rollouts: the pool of
`moe_rl.rollout.pool` decoded a segment at a time, weights taken between two segments.

The step order the run loop imposes on every rank (the learner: deliver n, update, push n,
deliver n + 1, ...) is kept; what moves is where the engine takes push n:

    deliver(n)  admit(n + 1)  segment  segment  [receive(n)]  segment ...  deliver(n + 1)
                              '---- rl.inflight_push_after_segments ---'

- `rl.inflight_weight_updates: false`: push n is taken once batch n + 1 is ready (at the
  batch boundary, as one-step-off does).
- in flight, `rl.async_schedule: deterministic`: after exactly
  `rl.inflight_push_after_segments` segments (the engine waits for the learner there if it
  must): pauses at fixed token counts, so a seed gives the same rewards.
- in flight, `throughput`: at the first pause point where push n has begun to arrive
  (`WeightSynchronizer.poll`), so the engine waits for the learner only with nothing left
  to decode.
In flight, the engine decodes up to the pause point even when batch n + 1 is ready before
it: the time the learner's update takes moves the running responses on.

Batch n + 1 is this engine's share of `rl.prompts_per_step` groups: with
`rl.partial_rollouts` the first to finish (a group trains whole), the others continue into
later steps with their tokens, versions and routes; without it, step n + 1's own groups
once all have finished. Problems enter the pool in units, unit u being what the
synchronous step u draws (the same problems and seeds, so a dataset is walked in the same
order); partial rollouts keep spare groups (further units, up to quota x
(1 + `rl.partial_oversample`) groups in the pool) so that the batch can be filled by the
groups that finish first. A group holding a token more than `rl.max_staleness` versions
older than the policy it would train under is dropped (counted in rollout/dropped_stale);
should that leave the pool dry before the batch is full, a further unit is admitted.

Dynamic sampling (`rl.dynamic_sampling`): each group is scored as it finishes, and one whose
rewards are all equal (no group advantage) is set aside, counted in the batch's
`sampling/groups_with_signal_frac` and never trained on; a group of the next unit takes its
place, so the batch still fills with `prompts_per_step` groups with signal. At most
(`rl.max_draws` - 1) x quota groups are set aside per batch (the extra groups the synchronous
step's further draws would decode); past that, groups train as they finish, equal rewards and
all (zero advantages), where the synchronous step would train on fewer groups instead.

`rl.inflight_kv: keep` (throughput schedule, vLLM): the pool runs on vLLM's asynchronous
engine instead (`moe_rl.sampler.vllm_stream`, `RolloutPool.stream`). Every unfinished
response is one request that decodes until it finishes; a turn of the schedule waits
`POLL_S` for the engine's tokens, and at the push the engine is paused with its requests and
their KV kept, loads the weights and goes on. Each token's version is the engine epoch it was
drawn in, mapped to the policy version received then (`epoch_versions`).

Resume: at each weight receipt the pool is saved (`<run>/rollout_pool/step_<n>.engine<e>.json`)
before the weights of step n are loaded, i.e. in the state a resume from step n's
checkpoint starts in; a resume loads it and continues the same schedule (streaming: a
running response goes on from the tokens saved; with R3, whose routes come with the finish,
it starts over). Without the file (or under another engine layout) the engines start a
fresh pool and the log says so.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from moe_rl.rollout.ahead import read_engine_file, write_engine_file
from moe_rl.rollout.pool import PartialResponse, PoolGroup, RolloutPool, StreamingEngine
from moe_rl.rollout.types import Sampled
from moe_rl.runtime.timing import StepTimer

if TYPE_CHECKING:
    from moe_rl.rollout.collector import RolloutCollector
    from moe_rl.sampler import Sampler
    from moe_rl.tasks.base import Problem

log = logging.getLogger(__name__)

KEEP = 3
"""Saved pools kept per engine (the newest)."""

POLL_S = 0.02
"""Streaming (`rl.inflight_kv: keep`): how long one turn of the schedule waits for the
engine's tokens before it looks at the batch and the learner's push again."""


def pool_path(run_dir: Path, step: int, engine: int) -> Path:
    return run_dir / "rollout_pool" / f"step_{step:06d}.engine{engine}.json"


class SegmentedRollout:
    """This engine's pool and schedule; the collector samples, scores and delivers."""

    def __init__(self, collector: RolloutCollector, units: int = 0) -> None:
        """`units`: units of problems already admitted (a fresh pool on a resume from step n
        draws the problems of steps n + 1, ...)."""
        self.collector, self.rl_cfg, self.sampler_cfg = collector, collector.rl_cfg, collector.sampler_cfg
        self.pool = RolloutPool(self.sampler_cfg.max_new_tokens, self.rl_cfg.inflight_segment_tokens,
                                collector.episodes)
        self.quota = len(collector.placement.share(self.rl_cfg.prompts_per_step))
        self.units = units
        """Units of problems admitted so far (`admit`)."""
        self.seconds = 0.0
        """Sampling seconds since the last batch was taken."""
        self.screened: list[PoolGroup] = []
        """Dynamic sampling: finished groups set aside since the last batch for equal rewards."""
        self.reward_timeouts = 0
        """Rewards cut at task.reward_timeout_s since the last batch was taken."""
        self.streaming = self.rl_cfg.inflight_kv == "keep"
        """vLLM's streaming engine decodes the pool continuously (`RolloutPool.stream`)."""
        self.epoch_versions: dict[int, int] = {}
        """Streaming: the policy version of each engine epoch (weight loads) seen."""
        if self.streaming:
            self.epoch_versions[self._streamer().epoch] = collector.weight_sync.held_version or 0

    def _engine(self) -> Sampler:
        """This rank's engine (the pool runs on engine ranks only)."""
        if self.collector.sampler is None:
            raise RuntimeError("a rollout pool runs on an engine rank; this one has no engine")
        return self.collector.sampler

    def _streamer(self) -> StreamingEngine:
        """This rank's engine, a streaming one (rl.inflight_kv=keep)."""
        engine = self._engine()
        if not isinstance(engine, StreamingEngine):
            raise RuntimeError(f"rl.inflight_kv=keep needs a streaming engine, this rank has {type(engine).__name__}")
        return engine

    # ------------------------------------------------------------------ schedule

    def admit(self) -> None:
        """Admit the next unit of problems (this engine's share of what one synchronous step
        draws: unit u holds step u's problems and seeds), and with rl.partial_rollouts
        further units while fewer than quota x (1 + rl.partial_oversample) groups are in the
        pool (without spare groups every batch would wait for all of its own)."""
        self._admit_unit()
        if self.rl_cfg.partial_rollouts:
            target = math.ceil(self.quota * (1 + self.rl_cfg.partial_oversample))
            while len(self.pool.running) + len(self.pool.done) < target:
                self._admit_unit()

    def _admit_unit(self, groups: int | None = None) -> None:
        """The next unit's problems (`groups`: only the first that many of this engine's share,
        the places of groups dynamic sampling set aside; the rest of that unit is skipped)."""
        self.units += 1
        c, G = self.collector, self.rl_cfg.group_size
        problems = c.problems(self.units, 0)
        seeds = c.seeds(self.units, 0, len(problems))
        for i in c.placement.share(len(problems))[:groups]:
            if c.episodes is not None:
                c.episodes.admit(self.pool, (self.units, 0, i), problems[i], seeds[i], G)
            else:
                self.pool.admit((self.units, 0, i), c.prompts.encode(problems[i]), seeds[i], G)

    def fill(self, step: int, receive: Callable[[], None] | None, timer: StepTimer) -> None:
        """Decode segments until `step`'s batch is ready and `receive` (the learner's next
        weights; None: already taken) has been called at the schedule's pause point. Until
        that point the engine keeps decoding even with the batch ready, rather than wait for
        the learner idle: the running responses move on."""
        rl = self.rl_cfg
        self.pool.drop_older_than(step - 1 - rl.max_staleness)
        segments = 0
        while True:
            if rl.dynamic_sampling and (short := self.quota - len(self.pool.done) - len(self.pool.running)) > 0:
                self._admit_unit(short)  # in the places of the groups set aside
            ready = len(self.pool.done) >= self._wanted(step)
            if receive is not None and (self._due(segments, ready) or (ready and not self.pool.running)):
                receive()
                receive = None
                if self.streaming:  # (tokens drawn from now on: the new epoch, the version just received)
                    self.epoch_versions[self._streamer().epoch] = self.collector.weight_sync.held_version or 0
                self.pool.drop_older_than(step - 1 - rl.max_staleness)
                continue
            if ready and receive is None:
                return
            if not self.pool.running:  # (dropped groups left the pool short)
                self._admit_unit()
            self._segment(step, timer)
            segments += 1

    def _segment(self, step: int, timer: StepTimer) -> None:
        """One segment of the pool; an engine that fails ends the run (the engines decode at
        their own pace, so they cannot agree on a restart: sampler.max_restarts is 0 here)."""
        s, t0 = self.sampler_cfg, time.perf_counter()
        with timer.phase("sample"):
            try:
                if self.streaming:
                    self.pool.stream(self._streamer(), self.epoch_versions.__getitem__, s.temperature, s.top_p, POLL_S)
                else:
                    self._engine()  # (raises on a rank without one)
                    self.pool.segment(self.collector.engines.guarded(f"generating step {step}"),  # (the deadline)
                                      self.collector.weight_sync.held_version or 0, s.temperature, s.top_p)
            except Exception as e:  # (whatever the engine raised: out of memory, a crashed worker)
                raise self.collector.failed_alone(f"generating step {step}", e) from e
        self.seconds += time.perf_counter() - t0
        if self.rl_cfg.dynamic_sampling:
            with timer.phase("reward"):
                self._screen()

    def _screen(self) -> None:
        """Score the groups that just finished; set aside those with all rewards equal, at
        most (rl.max_draws - 1) x quota per batch (past that they train as they are)."""
        fresh = [g for g in self.pool.done if g.rewards is None]
        if not fresh:
            return
        self._score(fresh)
        new = {id(g) for g in fresh}
        budget = (self.rl_cfg.max_draws - 1) * self.quota
        kept = []
        for g in self.pool.done:
            if id(g) in new and g.rewards is not None and len(set(g.rewards)) == 1 and len(self.screened) < budget:
                self.screened.append(g)
            else:
                kept.append(g)
        self.pool.done = kept

    def _score(self, groups: list[PoolGroup]) -> None:
        """Each group's rewards (an episode's were given as it ended); timeouts counted."""
        if not groups:
            return
        if self.pool.episodes is not None:
            for g in groups:
                g.rewards, cut = g.episode_rewards()
                self.reward_timeouts += cut
            return
        draws: dict[tuple[int, int], list] = {}
        texts = [self._texts(g) for g in groups]
        scores = self.collector.task.score([self._problem(g, draws) for g, t in zip(groups, texts) for _ in t],
                                           [x for t in texts for x in t])
        starts = list(itertools.accumulate((len(t) for t in texts), initial=0))
        for g, start, t in zip(groups, starts, texts):
            g.rewards = scores.values[start:start + len(t)]
        self.reward_timeouts += scores.timeouts

    def _texts(self, g: PoolGroup) -> list[str]:
        return [self.collector.tok.decode(r.tokens) for r in g.responses]

    def _wanted(self, step: int) -> int:
        """Finished groups the batch waits for: the quota (partial rollouts; dynamic sampling,
        whose replacements keep the pool at the quota), or every group in the pool (the unit
        admitted for `step`: nothing carries over then)."""
        if self.rl_cfg.partial_rollouts or self.rl_cfg.dynamic_sampling:
            return self.quota
        return len(self.pool.done) + len(self.pool.running)

    def _due(self, segments: int, ready: bool) -> bool:
        """The learner's weights are taken now: at the batch boundary without in-flight
        updates; after rl.inflight_push_after_segments segments (deterministic); once the
        push has begun to arrive (throughput)."""
        rl = self.rl_cfg
        if not rl.inflight_weight_updates:
            return ready
        if rl.async_schedule == "deterministic":
            return segments >= rl.inflight_push_after_segments
        return self.collector.weight_sync_ready()

    # ------------------------------------------------------------------ batches

    def batch(self, step: int) -> Sampled:
        """Take step `step`'s batch from the pool, scored (collective over the engine ranks),
        with the groups dynamic sampling set aside since the last one (for the statistics)."""
        self.pool.drop_older_than(step - 1 - self.rl_cfg.max_staleness)
        groups = self.pool.take(self.quota)
        self._score([g for g in groups if g.rewards is None])
        dropped, self.pool.dropped_stale = self.pool.dropped_stale, 0
        seconds, self.seconds = self.seconds, 0.0
        timeouts, self.reward_timeouts = self.reward_timeouts, 0
        aside, self.screened = self.screened, []
        scored = [g.scored(self._texts(g)) for g in groups]
        return self.collector.sampled_from_groups(step, scored, seconds, dropped, timeouts,
                                                  [g.scored(self._texts(g)) for g in aside])

    def _problem(self, g: PoolGroup, draws: dict[tuple[int, int], list]) -> Problem:
        """The problem of a pooled group (the draws of its unit made once per batch)."""
        if g.key[:2] not in draws:
            draws[g.key[:2]] = self.collector.problems(g.key[0], g.key[1])
        return draws[g.key[:2]][g.key[2]]

    # ------------------------------------------------------------------ resume

    def _restart_running(self) -> None:
        """Streaming with R3: a response's routes arrive with its finish, so a saved running
        response has none for the tokens it holds, and a continuation would route them again
        under other weights: such responses start over (from their next seed)."""
        for g in self.pool.running:
            g.responses = [r if r.finish is not None or not r.tokens else
                           PartialResponse(segments=r.segments + 1, carried=r.carried) for r in g.responses]

    def save(self, run_dir: Path, step: int) -> None:
        """Keep the pool as it is before step `step`'s weights load (an engine leader)."""
        p = self.collector.placement
        if not p.leader:
            return
        doc = {"step": step, "layout": [p.engines, p.ranks_per_engine], "pool": self.pool.to_json(),
               "units": self.units, "seconds": self.seconds, "screened": [g.to_json() for g in self.screened],
               "reward_timeouts": self.reward_timeouts}
        assert p.engine is not None  # (a leader is an engine rank)
        write_engine_file(pool_path(run_dir, step, p.engine), doc, p.engine, KEEP)

    def load(self, run_dir: Path, step: int) -> bool:
        """The pool saved at step `step`'s weight receipt, when every engine has its own
        under this layout (collective over the engine ranks); False: start afresh."""
        p = self.collector.placement
        assert p.engine is not None  # (an engine rank)
        doc, why = read_engine_file(pool_path(run_dir, step, p.engine), (p.engines, p.ranks_per_engine))
        missing = self.collector.engines_lacking(why)
        if missing:
            if p.rank == p.first_engine_rank:
                log.warning("resuming from step %d without the engines' rollout pool (%s): starting a fresh pool, "
                            "so the schedule differs from the uninterrupted run's", step, "; ".join(missing))
            return False
        assert doc is not None  # (no engine lacks its file: this one's was read)
        self.pool.load_json(doc["pool"])
        if self.streaming and self._engine().returns_routed_experts:
            self._restart_running()
        if self.pool.episodes is not None:  # (running episodes' environments, rebuilt from their turns)
            draws: dict = {}
            for g in self.pool.running:
                for r in g.responses:
                    self.pool.episodes.restore(self._problem(g, draws), r)
        self.units = doc["units"]
        self.seconds = doc["seconds"]
        self.screened = [PoolGroup.from_json(g) for g in doc.get("screened", [])]
        self.reward_timeouts = doc.get("reward_timeouts", 0)
        return True
