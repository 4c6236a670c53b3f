"""The RL loop: sample -> reward -> advantages -> old logprobs (+ routing) -> K updates
-> weight sync, with logging and checkpoints.

    trainer = Trainer(cfg)          # inside torchrun or a plain process
    summary = trainer.fit()

One step, on every rank of the torchrun world:
  1. sample (global rank 0 owns the sampler): `prompts_per_step` problems, G responses each;
     with dynamic sampling, groups whose rewards are all equal are dropped and more prompts
     are drawn (at most `max_draws` batches);
  2. rewards from the task's verifier (+ DAPO overlong shaping), group advantages; the
     rollout batch is broadcast to all ranks;
  3. the learner recomputes old logprobs and records routing (R3: replaying the sampler's);
     a reference model scores the batch when `kl_coef > 0`;
  4. `epochs x num_minibatches` optimizer updates with the objective, the router-shift
     weights (rspo) and the replay mode; mini-batches are balanced over data-parallel ranks;
  5. the learner's weights stream into the sampler (`update_weights`).
Every step logs rewards, lengths, objective / routing / mismatch metrics and a timing
breakdown to TensorBoard and `metrics.jsonl`, with a progress bar on the console.

Determinism: problems, sampler seeds and mini-batch shuffles derive from (run.seed, step)
alone, so a run resumed from a checkpoint replays the same steps an uninterrupted run takes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_rl.advantages import compute_advantages, filter_groups, overlong_penalty
from moe_rl.batch import TokenBatch
from moe_rl.config import Config, ConfigError, atomic_write_text, save_config, validate_layout
from moe_rl.diagnostics import compute_mismatch
from moe_rl.objectives import OBJECTIVES, PolicyBatch, make_hparams, policy_loss
from moe_rl.routing.record import align_sampler_routing
from moe_rl.tasks import make_task
from moe_rl.tasks.base import Problem
from moe_rl.tasks.tokenizer import load_tokenizer

log = logging.getLogger("moe_rl.trainer")

KEEP_CHECKPOINTS = 2


@dataclass
class _Group:
    """One prompt and its G scored responses, as the sampler returned them."""

    prompt: list[int]
    responses: list[list[int]]
    logprobs: list[list[float]]
    texts: list[str]
    rewards: list[float]
    finish: list[str]
    routed: list[Any] | None


@dataclass
class Rollout:
    """One step's training batch (built on rank 0, broadcast to every rank)."""

    batch: TokenBatch
    rewards_B: torch.Tensor
    adv_B: torch.Tensor
    rollout_logp_BT: torch.Tensor
    texts: list[str]
    sampler_routing: Any | None  # (ids_BSLK, valid_BS) aligned to the batch, when returned
    stats: dict[str, float]


def check_objective_args(cfg: Config) -> None:
    """rl.objective and rl.objective_args against the objective registry, before any work."""
    if cfg.rl.objective not in OBJECTIVES:
        raise ConfigError(f"rl.objective={cfg.rl.objective!r} is unknown; valid: {', '.join(OBJECTIVES)}")
    try:
        make_hparams(cfg.rl.objective, **cfg.rl.objective_args)
    except ValueError as e:
        raise ConfigError(f"rl.objective_args: {e}") from e


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


def minibatch_rows(B: int, num_minibatches: int, dp: int, seed: int) -> list[torch.Tensor]:
    """Split rows 0..B-1 into `num_minibatches` shuffled mini-batches, each balanced over
    data-parallel ranks (the learner gives row r to rank r % dp)."""
    g = torch.Generator().manual_seed(seed)
    chunks: list[list[torch.Tensor]] = [[] for _ in range(num_minibatches)]
    for r in range(dp):
        rows = torch.arange(r, B, dp)
        rows = rows[torch.randperm(rows.numel(), generator=g)]
        for k, part in enumerate(torch.tensor_split(rows, num_minibatches)):
            chunks[k].append(part)
    return [torch.cat(c).sort().values for c in chunks if sum(p.numel() for p in c)]


def _timer(timings: dict[str, float], name: str) -> contextlib.AbstractContextManager:
    @contextlib.contextmanager
    def cm() -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0

    return cm()


def _mean_metrics(items: list[dict[str, float]]) -> dict[str, float]:
    """Combine per-update metrics: max / min for *_max / *_min, mean otherwise."""
    out: dict[str, float] = {}
    for k in {k for m in items for k in m}:
        vals = [m[k] for m in items if k in m]
        out[k] = max(vals) if k.endswith("_max") else min(vals) if k.endswith("_min") else sum(vals) / len(vals)
    return out


class Trainer:
    """Owns the learner(s), the sampler (rank 0), the task and the run directory."""

    def __init__(self, cfg: Config) -> None:
        from moe_rl.learner import init_distributed

        check_objective_args(cfg)
        check_run_inputs(cfg)
        # The layout is checked against torchrun's WORLD_SIZE before any process group exists.
        validate_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        self.cfg = cfg
        self.rank, self.world = init_distributed(cfg.parallel.distributed_backend)
        self.run_dir = cfg.run_dir
        self.task = make_task(cfg.task)
        self.tok = load_tokenizer(cfg.task.tokenizer)
        if self.tok.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"the tokenizer has {self.tok.vocab_size} pieces; model.vocab_size={cfg.model.vocab_size}")
        self.needs_routing = cfg.rl.capture_routing or cfg.rl.replay != "none" or OBJECTIVES[cfg.rl.objective].needs_router_shift
        if OBJECTIVES[cfg.rl.objective].needs_router_shift and not cfg.rl.capture_routing:
            raise ConfigError(f"rl.objective={cfg.rl.objective} needs rl.capture_routing=true (router shift)")
        self._layout_cm = None
        self.sampler = None
        self.writer = None
        self.start_step = 0
        self.history: list[dict[str, float]] = []
        self.flip_history: list[list[float]] = []

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        from moe_rl.learner import Learner, latest_checkpoint, load_checkpoint, parallel_layout

        cfg = self.cfg
        resume_from = latest_checkpoint(self.run_dir) if cfg.run.resume else None
        if self.rank == 0:
            if not resume_from and self.run_dir.exists() and any(self.run_dir.glob("checkpoints/step_*")):
                log.warning("%s holds checkpoints from an earlier run; starting fresh (run.resume=true continues it)",
                            self.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
        self._layout_cm = parallel_layout(cfg.parallel, seed=cfg.run.seed)
        self.layout = self._layout_cm.__enter__()
        updates = cfg.run.steps * cfg.rl.epochs * cfg.rl.num_minibatches
        self.learner = Learner(cfg, self.layout, total_updates=updates)
        init = cfg.run.init_checkpoint
        if resume_from is not None:
            meta = load_checkpoint(self.learner, resume_from)
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
        if self.rank == 0:
            self._start_sampler(resume_from)
            self._start_logging()
        self._check_sampler_routing()

    def _load_init(self, learner: Any, path: str) -> None:
        from moe_rl.learner import load_checkpoint
        from moe_rl.learner.checkpoint import is_checkpoint
        from moe_rl.learner.hf_import import load_hf_weights

        p = Path(path)
        if is_checkpoint(p):
            load_checkpoint(learner, p, load_optimizer=False)
        elif (p / "config.json").is_file():
            load_hf_weights(learner, p)
        else:
            raise ConfigError(f"run.init_checkpoint={path} is neither a moe_rl checkpoint nor a Hugging Face directory")
        learner.step = 0

    def _start_sampler(self, resume_from: Path | None) -> None:
        """The sampler's Hugging Face directory from the weights the learner starts with."""
        from moe_rl.convert import megatron_to_hf
        from moe_rl.sampler import make_sampler

        cfg = self.cfg
        src = resume_from or (Path(cfg.run.init_checkpoint) if cfg.run.init_checkpoint else None)
        hf_dir = self.run_dir / "sampler_hf"
        if src is not None and (src / "config.json").is_file():
            hf_dir = src
        elif src is not None:
            megatron_to_hf(src, hf_dir, force=True, tokenizer=cfg.task.tokenizer or None)
        else:
            raise ConfigError("run.init_checkpoint is required (the sampler needs starting weights)")
        s = cfg.sampler
        opts: dict[str, Any] = {}
        if s.backend == "vllm":
            opts = {"in_process": s.in_process, "kv_cache_gib": s.vllm_kv_cache_gib,
                    "gpu_memory_utilization": s.gpu_memory_utilization}
        self.sampler = make_sampler(s.backend, hf_dir, precision=s.precision, seed=cfg.run.seed,
                                    eos_token_id=self.tok.eos_id, **opts)

    def _check_sampler_routing(self) -> None:
        returns = bool(getattr(self.sampler, "returns_routed_experts", False)) if self.rank == 0 else False
        returns = self.learner.broadcast(returns)
        self.sampler_returns_routing = returns
        if self.cfg.rl.replay == "R3" and not returns:
            raise ConfigError(
                f"rl.replay=R3 needs the sampler's routed experts; sampler.backend={self.cfg.sampler.backend} "
                "does not return them here (vLLM on CPU cannot); use sampler.backend=transformers"
            )

    def _start_logging(self) -> None:
        lg = self.cfg.logging
        if lg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tb"), purge_step=self.start_step + 1)
        path = self.run_dir / "metrics.jsonl"
        if path.exists():  # keep the lines up to the step we resume from
            kept = []
            for line in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    row = json.loads(line)
                    if row.get("step", 0) <= self.start_step:
                        kept.append(line)
                        self.history.append(row)
            atomic_write_text(path, "".join(k + "\n" for k in kept))
        if self.start_step == 0:
            self.history = []
            if path.exists():
                path.unlink()

    # ------------------------------------------------------------------ one step

    def _problems(self, step: int, draw: int) -> list[Problem]:
        rng = np.random.default_rng([self.cfg.run.seed, step, draw])
        return self.task.sample(self.cfg.rl.prompts_per_step, rng)

    def _generate(self, step: int, draw: int, timings: dict[str, float]) -> list[_Group]:
        """One draw of `prompts_per_step` problems, G responses each, scored."""
        cfg, G = self.cfg, self.cfg.rl.group_size
        problems = self._problems(step, draw)
        prompt_ids = [self.tok.encode(p.prompt) for p in problems]
        with _timer(timings, "sample"):
            ro = self.sampler.generate(prompt_ids, n=G, max_new_tokens=cfg.sampler.max_new_tokens,
                                       temperature=cfg.sampler.temperature, top_p=cfg.sampler.top_p,
                                       seed=cfg.run.seed * 1_000_003 + step * 101 + draw)
        with _timer(timings, "reward"):
            texts = [self.tok.decode(r) for r in ro.response_token_ids]
            rewards = self.task.rewards([problems[i] for i in ro.prompt_index], texts)
        groups = []
        for i, ids in enumerate(prompt_ids):
            sl = slice(i * G, (i + 1) * G)
            groups.append(_Group(ids, ro.response_token_ids[sl], ro.logprobs[sl], texts[sl], rewards[sl],
                                 ro.finish_reasons[sl],
                                 ro.routed_experts[sl] if ro.routed_experts is not None else None))
        return groups

    def _sample(self, step: int, timings: dict[str, float]) -> Rollout:
        """Rank 0: generate and score groups (dynamic sampling: keep drawing until
        `prompts_per_step` groups with a reward spread are found, or `max_draws`), then
        shape rewards, compute advantages and pack the batch."""
        cfg, G = self.cfg, self.cfg.rl.group_size
        kept: list[_Group] = []
        drawn: list[_Group] = []
        draws = 0
        while draws < (cfg.rl.max_draws if cfg.rl.dynamic_sampling else 1):
            groups = self._generate(step, draws, timings)
            draws += 1
            drawn += groups
            kept += [g for g in groups if not cfg.rl.dynamic_sampling or len(set(g.rewards)) > 1]
            if len(kept) >= cfg.rl.prompts_per_step:
                break
        if not kept:  # no group with signal in any draw: the last draw trains with zero advantages
            log.warning("step %d: every group had equal rewards in %d draws", step, draws)
            kept = groups
        kept = kept[: cfg.rl.prompts_per_step]
        with _timer(timings, "reward"):
            rewards_NG = torch.tensor([g.rewards for g in kept], dtype=torch.float32)
            lengths_NG = torch.tensor([[len(r) for r in g.responses] for g in kept], dtype=torch.float32)
            shaped_NG = rewards_NG
            if cfg.rl.overlong_max_len:
                shaped_NG = rewards_NG + overlong_penalty(lengths_NG, cfg.rl.overlong_max_len, cfg.rl.overlong_cache)
            adv_NG = compute_advantages(cfg.rl.advantage, shaped_NG)
            T = cfg.sampler.max_new_tokens
            batch = TokenBatch.from_lists([g.prompt for g in kept for _ in range(G)],
                                          [r for g in kept for r in g.responses], pad_id=self.tok.pad_id,
                                          response_width=T, seq_multiple=cfg.parallel.tensor_model_parallel_size)
            logp_BT = torch.zeros(batch.batch_size, T)
            for b, lp in enumerate(lp for g in kept for lp in g.logprobs):
                logp_BT[b, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
            routing = None
            if kept[0].routed is not None:
                routed = [a for g in kept for a in g.routed]
                moe_layers = list(range(cfg.model.num_dense_layers, cfg.model.num_layers))
                routing = align_sampler_routing(routed, batch, cfg.model.num_experts, moe_layers)
            all_rewards = torch.tensor([g.rewards for g in drawn], dtype=torch.float32)
            finish = [f for g in kept for f in g.finish]
            stats = {
                "reward/mean": float(rewards_NG.mean()),
                "reward/std": float(rewards_NG.std()) if rewards_NG.numel() > 1 else 0.0,
                "reward/solved_frac": float((rewards_NG == 1).float().mean()),
                "reward/mean_all_draws": float(all_rewards.mean()),
                "response/length_mean": float(lengths_NG.mean()),
                "response/length_max": float(lengths_NG.max()),
                "response/truncated_frac": sum(f == "length" for f in finish) / max(len(finish), 1),
                "sampling/draws": float(draws),
                "sampling/groups": float(len(kept)),
                "sampling/groups_with_signal_frac": float(filter_groups(all_rewards).float().mean()),
                "advantage/abs_mean": float(adv_NG.abs().mean()),
            }
        return Rollout(batch, rewards_NG.flatten(), adv_NG.flatten(), logp_BT,
                       [t for g in kept for t in g.texts], routing, stats)

    def _loss_fn(self, mini: TokenBatch, norms: dict[str, float]):
        from moe_rl.learner import MicroBatchLoss

        cfg = self.cfg
        spec = OBJECTIVES[cfg.rl.objective]
        hp = dict(cfg.rl.objective_args)
        hp.update(rollout_correction=cfg.rl.rollout_correction, kl_coef=cfg.rl.kl_coef,
                  kl_estimator=cfg.rl.kl_estimator, max_response_length=cfg.sampler.max_new_tokens, **norms)
        hp.update({k: v for k, v in cfg.rl.rollout_correction_args.items()})

        def loss_fn(logp_BT: torch.Tensor, mb) -> MicroBatchLoss:
            e = mb.extras
            pb = PolicyBatch(
                logprobs=logp_BT,
                old_logprobs=e["old_logp_BT"],
                advantages=e["adv_B"],
                response_mask=mb.batch.response_mask(),
                rollout_logprobs=e["rollout_logp_BT"] if cfg.rl.rollout_correction != "none" else None,
                ref_logprobs=e.get("ref_logp_BT"),
                router_shift=mb.aux.get("router_shift_BT") if spec.needs_router_shift else None,
            )
            out = policy_loss(cfg.rl.objective, pb, **hp)
            weight = out.num_sequences if spec.level == "sequence" else out.num_tokens
            metrics = {f"policy/{k}": v for k, v in out.metrics.items()}
            metrics["policy/token_ratio_std"] = _token_ratio_std(logp_BT.detach(), e["old_logp_BT"], pb.response_mask)
            return MicroBatchLoss(out.loss, metrics, weight)

        return loss_fn

    def step(self, step: int) -> dict[str, float]:
        from moe_rl.learner import ReplayIds, RoutingPlan
        from moe_rl.learner.export import hf_named_tensors
        from moe_rl.learner.routing import sampler_disagreement

        cfg, timings = self.cfg, {}
        t_step = time.perf_counter()
        rollout = self._sample(step, timings) if self.rank == 0 else None
        with _timer(timings, "broadcast"):
            rollout = self.learner.broadcast(rollout)
        batch = rollout.batch
        mask_BT = batch.response_mask()
        sampler_replay = None
        if rollout.sampler_routing is not None:
            ids, valid = rollout.sampler_routing
            sampler_replay = ReplayIds(torch.arange(batch.batch_size), ids, valid)
        with _timer(timings, "old_logprob"):
            score = self.learner.score(batch, cfg.sampler.temperature, RoutingPlan(
                capture=self.needs_routing,
                replay=_stage_slice(sampler_replay, self.learner.taps.layers) if cfg.rl.replay == "R3" else None,
            ))
            old_logp = score.logp_BT
            ref_logp = self.ref.logprobs(batch, cfg.sampler.temperature) if self.ref is not None else None
        metrics: dict[str, float] = dict(rollout.stats)
        metrics.update(compute_mismatch(rollout.rollout_logp_BT, old_logp, mask_BT, check_values=False).summary())
        if sampler_replay is not None and score.record is not None:
            scored = batch.scored_positions()[score.record.rows]
            metrics.update(sampler_disagreement(score.record, _stage_slice(sampler_replay, score.record.layers),
                                                scored, self.layout))
        extras = {"old_logp_BT": old_logp, "adv_B": rollout.adv_B, "rollout_logp_BT": rollout.rollout_logp_BT}
        if ref_logp is not None:
            extras["ref_logp_BT"] = ref_logp
        replay = None
        if cfg.rl.replay == "R2":
            replay = ReplayIds.from_record(score.record)
        elif cfg.rl.replay == "R3":
            replay = _stage_slice(sampler_replay, score.record.layers)
        plan = RoutingPlan(old=score.record, replay=replay, gamma_min=self._gamma_min()) if self.needs_routing \
            else RoutingPlan()
        updates = []
        with _timer(timings, "update"):
            for epoch in range(cfg.rl.epochs):
                for rows in minibatch_rows(batch.batch_size, cfg.rl.num_minibatches, self.layout.dp,
                                           seed=cfg.run.seed * 7919 + step * 31 + epoch):
                    mini = batch.select(rows)
                    norms = {"token_normalizer": float(mini.response_lens_B.sum()),
                             "seq_normalizer": float((mini.response_lens_B > 0).sum()),
                             "num_sequences_total": float(mini.batch_size)}
                    sub = {k: v[rows] for k, v in extras.items()}
                    out = self.learner.train_step(mini, self._loss_fn(mini, norms), sub,
                                                  cfg.sampler.temperature, plan, row_ids=rows)
                    updates.append({k if "/" in k else f"learner/{k}": v for k, v in out.items()})
        metrics.update(_mean_metrics(updates))
        metrics["policy/updates"] = float(len(updates))
        with _timer(timings, "sync"):
            stream = hf_named_tensors(self.learner)
            if self.rank == 0:
                self.sampler.update_weights(stream)
            else:
                for _ in stream:
                    pass
        timings["step"] = time.perf_counter() - t_step
        timings["other"] = timings["step"] - sum(v for k, v in timings.items() if k != "step")
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        metrics["step"] = step
        return metrics

    def _gamma_min(self) -> float:
        if OBJECTIVES[self.cfg.rl.objective].needs_router_shift:
            return float(make_hparams(self.cfg.rl.objective, **self.cfg.rl.objective_args).gamma_min)
        return 0.0

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        self.setup()
        cfg = self.cfg
        t0 = time.perf_counter()
        bar = None
        if self.rank == 0 and cfg.logging.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.run.steps, initial=self.start_step, desc=cfg.run.name, unit="step", dynamic_ncols=True)
        try:
            for step in range(self.start_step + 1, cfg.run.steps + 1):
                metrics = self.step(step)
                if self.rank == 0:
                    self._log(step, metrics)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(_postfix(metrics), refresh=False)
                if (cfg.run.save_every and step % cfg.run.save_every == 0) or step == cfg.run.steps:
                    self._save(step)
        finally:
            if bar is not None:
                bar.close()
        summary = self._summary(time.perf_counter() - t0) if self.rank == 0 else {}
        self.close()
        return summary

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        row = {k: (float(v) if isinstance(v, float | int) else v) for k, v in metrics.items()}
        self.history.append(row)
        if self.cfg.logging.jsonl:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, float) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
            flips = [row.get(f"routing/flip_rate_layer{i}") for i in range(self.learner.taps.num_moe_layers)]
            if all(f is not None for f in flips):
                self.flip_history.append(flips)
                every = self.cfg.logging.heatmap_every
                if every and step % every == 0 and len(self.flip_history) > 1:
                    from moe_rl.routing.heatmap import heatmap_image

                    img = heatmap_image(np.array(self.flip_history), title="top-k flip rate (old vs current)",
                                        stat_label="flip rate")
                    self.writer.add_image("routing/flip_rate_heatmap", img, step, dataformats="HWC")
            self.writer.flush()

    def _save(self, step: int) -> None:
        from moe_rl.learner import save_checkpoint

        root = self.run_dir / "checkpoints"
        save_checkpoint(self.learner, root / f"step_{step:06d}", extra_meta={"trainer_step": step})
        if self.rank == 0:
            done = sorted(p for p in root.glob("step_*") if (p / "moe_rl.json").is_file())
            for old in done[:-KEEP_CHECKPOINTS]:
                shutil.rmtree(old, ignore_errors=True)

    def _summary(self, wall: float) -> dict[str, Any]:
        rewards = [h["reward/mean"] for h in self.history]
        step_times = [h["time/step"] for h in self.history if "time/step" in h]
        timing_keys = sorted({k for h in self.history for k in h if k.startswith("time/")})
        summary = {
            "steps": len(rewards),
            "reward_first10": statistics.fmean(rewards[:10]) if rewards else float("nan"),
            "reward_last10": statistics.fmean(rewards[-10:]) if rewards else float("nan"),
            "wall_seconds": wall,
            "objective": self.cfg.rl.objective,
            "replay": self.cfg.rl.replay,
            "rollout_correction": self.cfg.rl.rollout_correction,
            "num_minibatches": self.cfg.rl.num_minibatches,
            "world_size": self.world,
            "layout": self.layout.name,
            "median_step_seconds": statistics.median(step_times) if step_times else float("nan"),
            "median_timings": {k: statistics.median(h[k] for h in self.history if k in h) for k in timing_keys},
            "tensorboard": str(self.run_dir / "tb"),
        }
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        if self._layout_cm is not None:
            self._layout_cm.__exit__(None, None, None)
            self._layout_cm = None


def _token_ratio_std(logp_BT: torch.Tensor, old_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Std over valid tokens of the token-level ratio exp(logp - old): 0 on-policy, the
    spread the clip and the router shift act on off-policy."""
    r = torch.exp((logp_BT - old_BT).clamp(-20, 20))[mask_BT]
    return r.std(unbiased=False) if r.numel() else r.new_zeros(())


def _stage_slice(replay: Any, layers: list[int]) -> Any:
    """The sampler's routing restricted to the MoE layers this pipeline stage owns."""
    from moe_rl.learner import ReplayIds

    index = torch.tensor(layers, dtype=torch.long)
    return ReplayIds(replay.rows, replay.ids_RSLK[:, :, index], replay.valid_RS)


def _postfix(m: dict[str, float]) -> dict[str, str]:
    keys = [("reward", "reward/mean"), ("gamma", "routing/gamma_mean"), ("flip", "routing/flip_rate_mean"),
            ("clip", "policy/clip_frac"), ("k3", "mismatch/k3"), ("s/step", "time/step")]
    # (the learner's own metrics are logged as learner/loss, learner/grad_norm, learner/lr)
    return {short: f"{m[k]:.3g}" for short, k in keys if k in m}


def train(cfg: Config) -> dict[str, Any]:
    """Run a whole training job (what `python -m moe_rl.train` calls)."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    return Trainer(cfg).fit()
