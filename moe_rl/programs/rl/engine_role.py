"""The RL program on an engine-only rank (`sampler.placement: separate`): sample its share
of every step and take the weights after each update; the training ranks do the rest.

It runs in the same run loop as the training ranks, so both make the same collective calls
in the same order: a step (deliver the rollout, receive the weights), an evaluation when
due, the agreed-stop gather. Under `rl.max_staleness` it samples step n+1 before it takes
step n's weights, so the sampling overlaps the learners' update (`moe_rl.rollout.ahead`).
"""

from __future__ import annotations

import time
from pathlib import Path

from moe_rl.config import Config
from moe_rl.loop import Program
from moe_rl.rollout import RolloutCollector, Sampled
from moe_rl.runtime.timing import StepTimer


class EngineRole(Program):
    """Hosts an engine; trains nothing and writes no run files."""

    name = "rl-engine"
    trains = False

    def __init__(self, cfg: Config, collector: RolloutCollector, rank: int, world: int) -> None:
        self.cfg, self.collector, self.rank, self.world = cfg, collector, rank, world
        self._ahead: Sampled | None = None

    def setup(self, resume_from: Path | None) -> int:
        self.collector.start_sampler(self.cfg.run_dir, None)
        start = self.collector.placement.from_rank0(None)
        self.collector.weight_sync.held_version = start
        self.collector.assign_rows(None)  # (trains on no rows)
        if self.cfg.rl.max_staleness:
            self._ahead = self._first_batch(start + 1)
        return start

    def _first_batch(self, step: int) -> Sampled | None:
        """Asynchronous rollout's first batch: the one sampled ahead before a stop, when this
        run is resumed and every engine saved its share; else sampled now."""
        saved = self.collector.sampled_ahead(self.cfg.run_dir, step) if step > 1 else None
        return saved or self.collector.sample(step, StepTimer())

    def step(self, step: int) -> dict[str, float]:
        timer = StepTimer()
        ahead, self._ahead = self._ahead, None
        self.collector.deliver(step, ahead or self.collector.sample(step, timer), timer)
        if self.cfg.rl.max_staleness and step < self.cfg.run.steps:
            self._ahead = self.collector.sample(step + 1, timer)
            self.collector.save_ahead(self.cfg.run_dir, self._ahead)
        t0 = time.perf_counter()
        self.collector.weight_sync.receive()
        self.collector.engine_wait = time.perf_counter() - t0
        return {}

    def evaluate(self, step: int) -> dict[str, float]:
        self.collector.evaluate(step)  # (the training ranks log it)
        return {}

    def close(self) -> None:
        self.collector.close()
