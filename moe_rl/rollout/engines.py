"""This rank's rollout engine (shard) and its life: built on the learner's starting weights,
handed to the weight transport, woken, closed, and, when a call fails, rebuilt.

    engines = Engines(placement, weight_sync, sampler=cfg.sampler, rl=cfg.rl, seed=cfg.run.seed,
                      trust_checkpoint=cfg.run.trust_checkpoint)   # collective: the engine groups form
    engines.start(run_dir, weights_source, eos_ids)      # collective: one engine per rollout group
    ro = engines.generate("generating step 3", prompt_ids, n=G, ...)  # collective over the engine ranks

A failed call is agreed over the engine ranks: every engine is rebuilt from its starting
weights and the call retried (the same seeds) while `sampler.max_restarts` lasts, raising
`EnginesRebuilt` first when the weights have moved since (the newest must come again), else
the run stops with one line (`moe_rl.rollout.engine_faults`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from moe_rl.config import RLConfig, SamplerConfig
from moe_rl.rollout.engine_faults import (
    EngineFailedError,
    EngineFault,
    EnginesRebuilt,
    RestartBudget,
    failure_line,
)
from moe_rl.rollout.placement import EnginePlacement
from moe_rl.rollout.sampler_start import build_sampler, sampler_weights_dir
from moe_rl.runtime.failures import describe_error
from moe_rl.runtime.fault_hooks import kill_point, release_hangs
from moe_rl.runtime.watchdog import HUNG_EXIT, call_deadline, exit_on_hang
from moe_rl.sampler import Rollouts, Sampler

log = logging.getLogger(__name__)


class EngineWeights(Protocol):
    """What the engines need of the weight transport that feeds them
    (`moe_rl.weights.WeightSynchronizer`, or the collector's `FixedWeights`)."""

    synced: bool
    """A push has been made or received since this process started."""
    engines_group: Any
    """The engine ranks' process group, set by `Engines` (where the engines agree on a
    check after a push; None: they are the whole world)."""

    def attach(self, engine: Sampler | None) -> None:
        """This rank's engine (None: none, or dropped), once it has started."""
        ...

    def finish(self) -> None:
        """Wait for anything a push left in flight."""
        ...


class WeightTransport(EngineWeights, Protocol):
    """The weight transport of a run (`moe_rl.weights.WeightSynchronizer`): the learner ranks
    push, the engine-only ranks receive, every engine remembers the version it holds."""

    held_version: int | None
    """The learner's update count of the weights this rank's engine holds (None: its start)."""

    def push(self, learner: Any, version: int) -> dict[str, float]:
        """A learner rank's side (`learner`: a `moe_rl.learner.protocols.PolicyLearner`, which
        the rollout may not import): the weights into the engines; the sync's metrics."""
        ...

    def receive(self) -> object:
        """An engine-only rank's side: load the weights the learner pushes."""
        ...

    def poll(self) -> bool:
        """An engine-only rank's side: the learner's next push has begun to arrive."""
        ...


class Engines:
    """This rank's engine (None on a learner-only rank) and what rebuilding it needs."""

    def __init__(self, placement: EnginePlacement, weight_sync: EngineWeights, *, sampler: SamplerConfig, rl: RLConfig,
                 seed: int, trust_checkpoint: bool) -> None:
        """Collective: the engine groups form. The engines are built as `sampler` and `rl`
        ask (`moe_rl.sampler.engine_config`), seeded with the run's `seed`; `trust_checkpoint`
        is the run's `run.trust_checkpoint` (for reading their starting weights)."""
        self.placement, self.weight_sync = placement, weight_sync
        self.sampler_cfg, self.rl_cfg, self.seed, self.trust_checkpoint = sampler, rl, seed, trust_checkpoint
        self.group = placement.engines_group()  # (collective)
        """The engine ranks' process group (None: they are the whole world)."""
        weight_sync.engines_group = self.group  # (where the engines agree on a check after a push)
        self.sampler: Sampler | None = None
        self.restarts = RestartBudget(sampler.max_restarts)
        """Engine rebuilds after a failure (`engine_faults`): rollout/engine_restarts."""
        self.returns_routed_experts = False
        """Every engine returns its routed experts (known after `start`)."""
        self._hf_dir: Path | None = None
        self._eos_ids: list[int] = []

    def start(self, run_dir: Path, weights_source: Path | None, eos_ids: list[int]) -> None:
        """Build this rank's engine (shard) on the weights the learner starts from.
        Collective: rank 0's `weights_source` counts, rank 0 converts a megatron checkpoint
        for all, engine groups agree on their rendezvous, and every rank learns whether the
        engines return routed experts."""
        pl = self.placement
        weights_source = pl.from_rank0(weights_source)
        if pl.rank == 0:
            hf_dir = sampler_weights_dir(run_dir, weights_source, self.trust_checkpoint)
        pl.barrier()
        if pl.rank != 0:
            hf_dir = sampler_weights_dir(run_dir, weights_source, self.trust_checkpoint, convert=False)
        self._hf_dir, self._eos_ids = hf_dir, list(eos_ids)
        group_env = pl.group_env() if pl.ranks_per_engine > 1 else None  # (collective over every rank)
        if pl.hosts_engine:
            self.sampler = self._build(hf_dir, group_env)
        self.weight_sync.attach(self._checked())
        self.returns_routed_experts = all(pl.gather(bool(getattr(self.sampler, "returns_routed_experts", False))))

    def _build(self, hf_dir: Path, group_env: dict[str, str] | None) -> Sampler:
        return build_sampler(self.sampler_cfg, self.rl_cfg, self.seed, hf_dir, self._eos_ids, group_env)

    def generate(self, doing: str, prompt_ids: list[list[int]], **kwargs: Any) -> Rollouts:
        """`Sampler.generate` on this rank's engine, its failure agreed over the engine ranks
        (collective over them): a failed call is retried, the same seeds on rebuilt engines,
        while `sampler.max_restarts` lasts (`recover`)."""
        while True:
            ro, fault = None, None
            kill_point("generate")  # (a test hook: a no-op unless MOE_RL_TEST_KILL_AT names it)
            try:
                ro = self.guarded(doing).generate(prompt_ids, **kwargs)  # (raises on a rank without an engine)
            except Exception as e:  # (whatever the engine raised: out of memory, a crashed worker)
                fault = EngineFault(self.placement.rank, describe_error(e))
            faults = [f for f in self.placement.all_engines(fault, self.group) if f is not None]
            if not faults and ro is not None:  # (no fault here: this rank's call returned)
                return ro
            self.recover(faults, doing, everywhere=self.group is None)

    def _checked(self) -> GuardedSampler | None:
        """What the weight transport loads into and checks (`sampler.verify_every`: its
        score call under the deadline too); None without an engine."""
        return self.guarded("checking the weights pushed to it") if self.sampler is not None else None

    def guarded(self, doing: str) -> GuardedSampler:
        """This rank's engine with its generate and score calls under
        `sampler.generate_timeout_s` (`doing`: what the one line says the engine was doing):
        the rollout's, the evaluation's, each decoding segment's and the weight check's."""
        return GuardedSampler(self, doing)

    def deadline(self, doing: str, requested: int) -> contextlib.AbstractContextManager[None]:
        """`sampler.generate_timeout_s` for a call of `requested` tokens, and what a hang does."""
        limit = self.sampler_cfg.timeout_for(requested)
        return call_deadline(limit, self._on_hang(doing, requested, limit))

    def _on_hang(self, doing: str, requested: int, limit: float) -> Callable[[], None]:
        """What a hung call does: an out-of-process engine (one that can `kill` itself) is
        killed, so that the call fails like a crashed worker and `sampler.max_restarts`
        decides; an in-process one cannot be interrupted from here, so the process says so
        in one line and exits (`moe_rl.runtime.watchdog`)."""
        kill = getattr(self.sampler, "kill", None)
        if kill is not None and not getattr(self.sampler, "in_process", True):
            def killed() -> None:
                log.warning("the engine on rank %d hung while %s: no result after %.0f s (sampler.generate_timeout_s"
                            "=%g); killing its process", self.placement.rank, doing, limit,
                            self.sampler_cfg.generate_timeout_s)
                kill()
                release_hangs()
            return killed
        return exit_on_hang(f"moe_rl: the engine on rank {self.placement.rank} hung while {doing}: no result after "
                            f"{limit:.0f} s (sampler.generate_timeout_s={self.sampler_cfg.generate_timeout_s:g} for "
                            f"{requested} requested tokens); the job ends here (exit {HUNG_EXIT}): continue from the "
                            "last checkpoint with run.resume=true")

    def recover(self, faults: list[EngineFault], doing: str, everywhere: bool) -> None:
        """After failures every rank taking part agrees on: rebuild every engine from its
        starting weights and return (the caller retries), raising `EnginesRebuilt` first when
        the weights have moved since (the newest must come again); with no restart left, raise
        `EngineFailedError` (`everywhere`: on every rank of the world alike)."""
        try:
            self.restarts.spend(faults, doing)
        except EngineFailedError as e:
            self.discard()
            e.everywhere = everywhere
            raise
        if self.placement.rank == self.placement.first_engine_rank:
            log.warning("engine rank %d failed while %s (%s): rebuilding the engines and retrying (restart %d of "
                        "sampler.max_restarts=%d)", faults[0].rank, doing, faults[0].cause, self.restarts.used,
                        self.restarts.max_restarts)
        if self.placement.hosts_engine:
            self.discard()
            pl = self.placement
            group_env = pl.group_env(self.group) if pl.ranks_per_engine > 1 else None
            assert self._hf_dir is not None  # (set by start)
            self.sampler = self._build(self._hf_dir, group_env)
            self.weight_sync.attach(self._checked())
        if self.weight_sync.synced:
            raise EnginesRebuilt()

    def failed_alone(self, doing: str, e: Exception) -> EngineFailedError:
        """The run's end for an engine that failed where the engines do not agree (decoding in
        segments, each at its own pace): this rank says it and exits; torchrun stops the others."""
        self.discard()
        return EngineFailedError(failure_line([EngineFault(self.placement.rank, describe_error(e))], doing,
                                              self.restarts.max_restarts))

    def discard(self) -> None:
        """Drop a failed engine, whatever state it is in, and the memory it held."""
        sampler, self.sampler = self.sampler, None
        self.weight_sync.attach(None)
        if sampler is not None:
            with contextlib.suppress(Exception):
                sampler.close()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Back from vLLM's sleep mode (an engine that sleeps between steps)."""
        wake = getattr(self.sampler, "wake_up", None)
        if wake is not None:
            wake()

    def close(self) -> None:
        """The last push's sends finished (before the process groups go), then the engine."""
        self.weight_sync.finish()
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
            self.weight_sync.attach(None)


class GuardedSampler:
    """An engine whose generate and score calls must return within the run's deadline
    (`Engines.guarded`); every other attribute is the engine's own."""

    def __init__(self, engines: Engines, doing: str) -> None:
        self._engines, self._doing = engines, doing

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int = 1, max_new_tokens: int = 16,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
                 prompt_seeds: Sequence[int] | None = None) -> Rollouts:
        requested = len(prompt_token_ids) * n * max_new_tokens
        sampler = self._sampler()
        with self._engines.deadline(self._doing, requested):
            return sampler.generate(prompt_token_ids, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                                    top_p=top_p, seed=seed, prompt_seeds=prompt_seeds)

    def score(self, prompt_token_ids: Sequence[Sequence[int]], response_token_ids: Sequence[Sequence[int]],
              temperature: float = 1.0) -> list[list[float]]:
        requested = sum(len(p) + len(r) for p, r in zip(prompt_token_ids, response_token_ids))
        sampler = self._sampler()
        with self._engines.deadline(self._doing, requested):
            return sampler.score(prompt_token_ids, response_token_ids, temperature=temperature)

    @property
    def precision(self) -> str:
        return self._sampler().precision

    @property
    def returns_routed_experts(self) -> bool:
        return self._sampler().returns_routed_experts

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._sampler().update_weights(named_tensors)

    def close(self) -> None:
        self._sampler().close()

    def _sampler(self) -> Sampler:
        if self._engines.sampler is None:
            raise RuntimeError("this rank has no engine (dropped after a failure)")
        return self._engines.sampler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engines.sampler, name)
