"""One step's rollout: problems -> sampler -> rewards -> (dynamic sampling) -> batch.

    collector = RolloutCollector(cfg)                  # task + tokenizer, on every rank
    collector.start_sampler(run_dir, weights_source)   # where the engine lives (rank 0)
    rollout = collector.collect(step, timer)
    collector.update_weights(named_tensors)            # after the learner's update

Determinism: problems and sampler seeds derive from (run.seed, step, draw) alone, so a run
resumed from a checkpoint replays the same rollouts an uninterrupted run samples.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from moe_rl.config import Config, ConfigError
from moe_rl.rollout.packing import pack_rollout
from moe_rl.rollout.sampler_start import build_sampler, sampler_weights_dir
from moe_rl.rollout.types import Rollout, ScoredGroup
from moe_rl.sampler import Sampler
from moe_rl.tasks import make_task
from moe_rl.tasks.base import Problem
from moe_rl.tasks.tokenizer import load_tokenizer
from moe_rl.timing import StepTimer

log = logging.getLogger("moe_rl.rollout")


class RolloutCollector:
    """Owns the task, the tokenizer and the sampler engine."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.task = make_task(cfg.task)
        self.tok = load_tokenizer(cfg.task.tokenizer)
        if self.tok.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"the tokenizer has {self.tok.vocab_size} pieces; model.vocab_size={cfg.model.vocab_size}")
        self.sampler: Sampler | None = None

    @property
    def pad_id(self) -> int:
        return self.tok.pad_id

    def start_sampler(self, run_dir: Path, weights_source: Path | None) -> None:
        """Build the engine on the weights the learner starts from."""
        hf_dir = sampler_weights_dir(self.cfg, run_dir, weights_source)
        self.sampler = build_sampler(self.cfg, hf_dir, self.tok.eos_id)

    @property
    def returns_routed_experts(self) -> bool:
        return bool(getattr(self.sampler, "returns_routed_experts", False))

    def problems(self, step: int, draw: int) -> list[Problem]:
        rng = np.random.default_rng([self.cfg.run.seed, step, draw])
        return self.task.sample(self.cfg.rl.prompts_per_step, rng)

    def collect(self, step: int, timer: StepTimer) -> Rollout:
        """Generate and score groups (dynamic sampling: keep drawing until
        `prompts_per_step` groups with a reward spread are found, or `max_draws`), then pack
        the training batch."""
        rl = self.cfg.rl
        kept: list[ScoredGroup] = []
        drawn: list[ScoredGroup] = []
        draws = 0
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
            return pack_rollout(kept[: rl.prompts_per_step], drawn, draws, self.cfg, self.pad_id)

    def _draw(self, step: int, draw: int, timer: StepTimer) -> list[ScoredGroup]:
        """One draw of `prompts_per_step` problems, G responses each, scored."""
        cfg, G = self.cfg, self.cfg.rl.group_size
        problems = self.problems(step, draw)
        prompt_ids = [self.tok.encode(p.prompt) for p in problems]
        with timer.phase("sample"):
            ro = self.sampler.generate(prompt_ids, n=G, max_new_tokens=cfg.sampler.max_new_tokens,
                                       temperature=cfg.sampler.temperature, top_p=cfg.sampler.top_p,
                                       seed=cfg.run.seed * 1_000_003 + step * 101 + draw)
        with timer.phase("reward"):
            texts = [self.tok.decode(r) for r in ro.response_token_ids]
            rewards = self.task.rewards([problems[i] for i in ro.prompt_index], texts)
        groups = []
        for i, ids in enumerate(prompt_ids):
            sl = slice(i * G, (i + 1) * G)
            groups.append(ScoredGroup(ids, ro.response_token_ids[sl], ro.logprobs[sl], texts[sl], rewards[sl],
                                      ro.finish_reasons[sl],
                                      ro.routed_experts[sl] if ro.routed_experts is not None else None))
        return groups

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream the learner's weights (Hugging Face names, full tensors) into the engine."""
        self.sampler.update_weights(named_tensors)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
