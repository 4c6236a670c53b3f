"""The RL program on an engine-only rank (`sampler.placement: separate`): sample its share
of every step and take the weights after each update; the training ranks do the rest.

It runs in the same run loop as the training ranks, so both make the same collective calls
in the same order: a step (deliver the rollout, receive the weights), an evaluation when
due, the agreed-stop gather. How the sampling overlaps the learners' update:
- `rl.max_staleness=k` alone: a queue of k batches sampled ahead; during step n the engine
  samples step n + k before it takes step n's weights (`moe_rl.rollout.ahead` keeps them
  for a resume);
- with `rl.inflight_weight_updates` or `rl.partial_rollouts`: a pool decoded in segments,
  the weights taken between two of them (`moe_rl.rollout.segmented`).
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from moe_rl.config import RLConfig, RunConfig
from moe_rl.loop import Program
from moe_rl.rollout import RolloutCollector, Sampled
from moe_rl.rollout.engine_faults import EngineFailedError, EngineNote, EnginesRebuilt
from moe_rl.rollout.segmented import SegmentedRollout
from moe_rl.runtime.timing import StepTimer
from moe_rl.weights.verify import SyncVerifyError


class EngineRole(Program):
    """Hosts an engine; trains nothing and writes no run files."""

    name = "rl-engine"
    trains = False

    def __init__(self, collector: RolloutCollector, rank: int, world: int, *, rl: RLConfig, run: RunConfig) -> None:
        """Built by `LearnerRole.build` on the ranks that only sample; `rl`: the staleness
        and segmenting that say how far ahead it samples."""
        self.collector, self.rank, self.world, self.rl, self.run = collector, rank, world, rl, run
        self._queue: deque[Sampled] = deque()
        self._segmented: SegmentedRollout | None = None
        self._failed: EngineNote | None = None
        """An engine failure met while sampling ahead, told at the next delivery."""

    def setup(self, resume_from: Path | None) -> int:
        self.collector.start_sampler(self.run.run_dir, None)
        nothing: int | None = None  # (an engine-only rank has no start of its own)
        start = self.collector.placement.from_rank0(nothing)
        assert start is not None  # (rank 0's: a training rank's)
        self.collector.weight_sync.held_version = start
        self.collector.assign_rows(None)  # (trains on no rows)
        if self.rl.segmented:
            self._segmented = SegmentedRollout(self.collector, units=start)
            if not (start and self._segmented.load(self.run.run_dir, start)):
                self._segmented.admit()
            self._segmented.fill(start + 1, None, StepTimer())
        elif self.rl.max_staleness:
            for step in range(start + 1, min(start + self.rl.max_staleness, self.run.steps) + 1):
                self._queue.append(self._first_batch(step, resumed=start > 0))
        return start

    def _first_batch(self, step: int, resumed: bool) -> Sampled:
        """A batch of the queue at the start: the one sampled ahead before a stop, when this
        run is resumed and every engine saved its share; else sampled now."""
        saved = self.collector.sampled_ahead(self.run.run_dir, step) if resumed else None
        if saved is None:
            saved = self.collector.sample(step, StepTimer())
            self.collector.save_ahead(self.run.run_dir, saved, keep=self.rl.max_staleness + 2)
        assert saved is not None  # (an engine rank samples)
        return saved

    def step(self, step: int) -> dict[str, float]:
        timer = StepTimer()
        if self._segmented is not None:
            self.collector.deliver(step, self._segmented.batch(step), timer)
            if step < self.run.steps:
                self._segmented.admit()
                self._segmented.fill(step + 1, lambda: self._receive(step), timer)
            else:
                self._receive(step)
            return {}
        if self._failed is not None:  # (every rank stops here, before training on this step)
            self.collector.deliver(step, self._failed, timer)
        if self._queue and self._queue[0].step == step:
            self.collector.deliver(step, self._queue.popleft(), timer)
        else:  # (synchronous, or a batch a rebuilt engine could not sample ahead)
            self._deliver_now(step, timer)
        k = self.rl.max_staleness
        if k and step + k <= self.run.steps:
            try:
                ahead = self.collector.sample(step + k, timer)
                assert ahead is not None  # (an engine rank samples)
                self._queue.append(ahead)
                self.collector.save_ahead(self.run.run_dir, ahead, keep=k + 2)
            except EnginesRebuilt:  # (the push below brings the newest weights; step + k is sampled when due)
                pass
            except EngineFailedError as e:  # (the learners are training this step: it finishes and is saved)
                self._failed = EngineNote.of(e)
        self._receive(step)
        return {}

    def _deliver_now(self, step: int, timer: StepTimer) -> None:
        """Sample step `step` and deliver it while the learners wait for it. After a failure
        the learners are told instead (`moe_rl.rollout.engine_faults`): to stop, or to push the
        weights a rebuilt engine lacks once more, which it takes before it samples again."""
        while True:
            try:
                sampled: Sampled | EngineNote | None = self.collector.sample(step, timer)
            except (EnginesRebuilt, EngineFailedError) as e:
                sampled = EngineNote.of(e)
            try:
                self.collector.deliver(step, sampled, timer)
                return
            except EnginesRebuilt:
                self.collector.weight_sync.receive()

    def _receive(self, step: int) -> None:
        """Take step `step`'s weights (a segmented pool is saved first: a resume from step
        `step`'s checkpoint starts from it)."""
        if self._segmented is not None:
            self._segmented.save(self.run.run_dir, step)
        t0 = time.perf_counter()
        try:
            self.collector.weight_sync.receive()
        except SyncVerifyError as e:  # (told at the next delivery, before anything is sampled with them)
            if self._segmented is not None or step >= self.run.steps:
                raise  # (this rank says it and ends; torchrun ends the others)
            self._failed = EngineNote.of(e)
        self.collector.engine_wait = time.perf_counter() - t0

    def evaluate(self, step: int) -> dict[str, float]:
        if self._failed is not None:  # (never sample with weights that failed their check)
            raise EngineFailedError(self._failed.line)
        while True:
            try:
                self.collector.evaluate(step)  # (the training ranks log it)
                return {}
            except EnginesRebuilt:  # (rebuilt after a failure: the learner pushes the weights again)
                self.collector.weight_sync.receive()

    def close(self) -> None:
        self.collector.close()
