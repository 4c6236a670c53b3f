"""One step's rollout: problems -> engines -> rewards -> (dynamic sampling) -> batch.

    collector = RolloutCollector(cfg)                  # task, tokenizer, engine placement
    collector.start_sampler(run_dir, weights_source)   # one engine per rollout group
    rollout = collector.collect(step, timer)           # collective: every rank, same batch
    collector.sync_weights(named_tensors)              # after the learner's update

Every rank of the torchrun world belongs to a rollout group with one engine
(`placement.EnginePlacement`); each engine samples its block of the step's prompts and the
scored groups are gathered to every rank. Determinism: problems and per-prompt sampler
seeds derive from (run.seed, step, draw, prompt index) alone, so the rollouts are the same
whatever the number of engines, and a resumed run replays what an uninterrupted run samples.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_rl.config import Config, ConfigError
from moe_rl.rollout.evaluate import EvalReport, evaluate_problems
from moe_rl.rollout.packing import pack_rollout
from moe_rl.rollout.placement import EnginePlacement, concat
from moe_rl.rollout.sampler_start import build_sampler, sampler_weights_dir
from moe_rl.rollout.types import Rollout, ScoredGroup
from moe_rl.rollout.weight_sync import (
    SyncReport,
    broadcast_buckets,
    receive_buckets,
    stream_in_buckets,
)
from moe_rl.sampler import Sampler
from moe_rl.sampler.base import base_seeds
from moe_rl.tasks import make_task
from moe_rl.tasks.base import Problem
from moe_rl.timing import StepTimer
from moe_rl.tokenization import PromptEncoder, check_fits_model, load_tokenizer

log = logging.getLogger("moe_rl.rollout")


class RolloutCollector:
    """Owns the task, the tokenizer and this rank's engine (shard)."""

    def __init__(self, cfg: Config, placement: EnginePlacement | None = None) -> None:
        self.cfg = cfg
        separate = cfg.sampler.placement == "separate"
        self.placement = placement or EnginePlacement.current(cfg.sampler.tensor_parallel_size,
                                                              cfg.sampler.engine_ranks if separate else 0)
        self._weights_group = self.placement.weights_group() if separate and self.placement.world > 1 else None
        self.task = make_task(cfg.task)
        self.tok = load_tokenizer(cfg.task.tokenizer, cfg.run.init_checkpoint)
        check_fits_model(self.tok, cfg.model.vocab_size)
        self.prompts = PromptEncoder.from_config(cfg.task, self.tok)
        self.sampler: Sampler | None = None
        self.returns_routed_experts = False
        """Every engine returns its routed experts (known after `start_sampler`)."""
        self.engine_seconds: list[float] = []
        self._eval: tuple[Any, list[Problem]] | None = None
        self.last_eval_examples: list[dict[str, Any]] = []

    @property
    def pad_id(self) -> int:
        return self.tok.pad_id

    def start_sampler(self, run_dir: Path, weights_source: Path | None) -> None:
        """Build this rank's engine (shard) on the weights the learner starts from.
        Collective: rank 0's `weights_source` counts, rank 0 converts a megatron checkpoint
        for all, engine groups agree on their rendezvous, and every rank learns whether the
        engines return routed experts."""
        pl = self.placement
        weights_source = pl.from_rank0(weights_source)
        if pl.rank == 0:
            hf_dir = sampler_weights_dir(self.cfg, run_dir, weights_source)
        pl.barrier()
        if pl.rank != 0:
            hf_dir = sampler_weights_dir(self.cfg, run_dir, weights_source, convert=False)
        group_env = pl.group_env() if pl.ranks_per_engine > 1 else None
        if pl.hosts_engine:
            self.sampler = build_sampler(self.cfg, hf_dir, self.tok.eos_ids, pl, group_env)
        routed = pl.gather(bool(getattr(self.sampler, "returns_routed_experts", False)))
        self.returns_routed_experts = all(routed)

    def problems(self, step: int, draw: int) -> list[Problem]:
        """The problems of one draw of (1-based) training step `step`: the first is the task's
        batch (a dataset walks its epochs), dynamic sampling's further draws are random ones
        seeded from (run.seed, step, draw)."""
        n = self.cfg.rl.prompts_per_step
        if draw == 0:
            return self.task.batch(step - 1, n, self.cfg.run.seed)
        return self.task.sample(n, np.random.default_rng([self.cfg.run.seed, step, draw]))

    def collect(self, step: int, timer: StepTimer) -> Rollout:
        """Generate and score groups (dynamic sampling: keep drawing until
        `prompts_per_step` groups with a reward spread are found, or `max_draws`), then pack
        the training batch. Collective: every rank returns the same rollout."""
        rl = self.cfg.rl
        kept: list[ScoredGroup] = []
        drawn: list[ScoredGroup] = []
        draws = 0
        self.engine_seconds = []
        while draws < (rl.max_draws if rl.dynamic_sampling else 1):
            groups = self._draw(step, draws, timer)
            draws += 1
            drawn += groups
            kept += [g for g in groups if not rl.dynamic_sampling or g.has_signal]
            if len(kept) >= rl.prompts_per_step:
                break
        if not kept:  # no group with signal in any draw: the last draw trains with zero advantages
            log.warning("step %d: every group had equal rewards in %d draws", step, draws)
            kept = groups
        with timer.phase("reward"):
            rollout = pack_rollout(kept[: rl.prompts_per_step], drawn, draws, self.cfg, self.pad_id)
        rollout.stats.update(self._engine_stats())
        if self.cfg.sampler.sleep_between_steps and self.sampler is not None:  # the learner's turn
            self.sampler.sleep()
        return rollout

    def _draw(self, step: int, draw: int, timer: StepTimer) -> list[ScoredGroup]:
        """One draw of `prompts_per_step` problems, G responses each, scored: this engine's
        block sampled here, every engine's blocks gathered."""
        cfg, G = self.cfg, self.cfg.rl.group_size
        problems = self.problems(step, draw)
        seeds = base_seeds(cfg.run.seed * 1_000_003 + step * 101 + draw, len(problems), G)
        share = self.placement.share(len(problems))
        prompt_ids = [self.prompts.encode(problems[i]) for i in share]
        t0 = time.perf_counter()
        mine: list[ScoredGroup] = []
        if self.sampler is not None:  # (a learner-only rank under separate placement has none)
            with timer.phase("sample"):
                ro = self.sampler.generate(prompt_ids, n=G, max_new_tokens=cfg.sampler.max_new_tokens,
                                           temperature=cfg.sampler.temperature, top_p=cfg.sampler.top_p,
                                           prompt_seeds=[seeds[i] for i in share])
            with timer.phase("reward"):
                texts = [self.tok.decode(r) for r in ro.response_token_ids]
                rewards = self.task.rewards([problems[share[i]] for i in ro.prompt_index], texts)
            for i, ids in enumerate(prompt_ids):
                sl = slice(i * G, (i + 1) * G)
                mine.append(ScoredGroup(ids, ro.response_token_ids[sl], ro.logprobs[sl], texts[sl], rewards[sl],
                                        ro.finish_reasons[sl],
                                        ro.routed_experts[sl] if ro.routed_experts is not None else None))
        sample_seconds = time.perf_counter() - t0
        with timer.phase("gather"):
            parts = self.placement.gather((mine, sample_seconds))
        self.engine_seconds.append([seconds for _, seconds in parts])
        return concat([groups for groups, _ in parts])

    def evaluate(self, step: int) -> dict[str, float]:
        """Greedy accuracy and pass@k on `task.eval_data_path` (`evaluate.py`), every engine
        taking its block of the held-out problems. Collective: every rank returns the same."""
        if self._eval is None:
            task = make_task(dataclasses.replace(self.cfg.task, data_path=self.cfg.task.eval_data_path))
            problems = list(getattr(task, "problems", None) or [])
            if not problems:
                raise ConfigError(f"task.eval_data_path={self.cfg.task.eval_data_path}: the task {task.name!r} "
                                  "has no fixed problems to evaluate on; use task.name=dataset")
            self._eval = (task, problems[: self.cfg.run.eval_max_problems or None])
        task, problems = self._eval
        self._wake()
        mine = EvalReport(self.cfg.run.eval_k)
        share = self.placement.share(len(problems))
        if self.sampler is not None:
            s = self.cfg.sampler
            mine = evaluate_problems(self.sampler, self.prompts, self.tok, task, [problems[i] for i in share],
                                     k=self.cfg.run.eval_k, temperature=s.temperature, top_p=s.top_p,
                                     max_new_tokens=s.max_new_tokens, seed=self.cfg.run.seed + 7 * share.start)
        total = EvalReport(self.cfg.run.eval_k)
        for part in self.placement.gather(mine):
            total.add(part)
        self.last_eval_examples = total.examples
        return total.metrics()

    def _engine_stats(self) -> dict[str, float]:
        per_engine = np.sum(np.array(self.engine_seconds), axis=0)  # over draws
        return {"sampler/engines": float(self.placement.engines),
                "sampler/sample_seconds_max": float(per_engine.max()),
                "sampler/sample_seconds_min": float(per_engine.min())}

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """A learner rank's side of the weight sync. Colocated: stream the learner's weights
        (Hugging Face names, full tensors) into this rank's engine in layer-aligned buckets.
        Separate: rank 0 broadcasts the buckets to the engine ranks. Every learner rank
        drains the stream to the end (its collectives are the learner's)."""
        bucket_bytes = self.cfg.sampler.weight_sync_bucket_mib << 20
        if self._weights_group is not None:
            return broadcast_buckets(named_tensors, bucket_bytes, self._weights_group, send=self.placement.rank == 0)
        return stream_in_buckets(named_tensors, bucket_bytes, self.sampler.update_weights)

    def receive_weights(self) -> SyncReport:
        """An engine-only rank's side of the weight sync (separate placement)."""
        self._wake()
        return receive_buckets(self._weights_group, self.sampler.update_weights)

    def _wake(self) -> None:
        wake = getattr(self.sampler, "wake_up", None)
        if wake is not None:
            wake()

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
