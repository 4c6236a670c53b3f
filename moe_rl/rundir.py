"""A run directory's files: the resolved config, metrics.jsonl, TensorBoard events, the
routing heat map, checkpoint rotation and summary.json (written by global rank 0).

    runs/<name>/
      config.yaml        resolved recipe (what resume reads back)
      metrics.jsonl      one JSON object per step
      tb/                TensorBoard events (scalars, routing flip-rate heat map)
      rollouts/step_*.jsonl  whole rollouts, every `logging.rollouts_every` steps
      checkpoints/step_* megatron checkpoints, the newest KEEP_CHECKPOINTS kept
      summary.json       first/last rewards, median timings, where the logs are
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from moe_rl.atomic import atomic_write_text
from moe_rl.config import Config, save_config

log = logging.getLogger("moe_rl.trainer")

KEEP_CHECKPOINTS = 2


class RunDirectory:
    """The files of one run under `cfg.run_dir`."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.path = cfg.run_dir
        self.history: list[dict[str, Any]] = []
        self._flip_history: list[list[float]] = []
        self._writer = None
        self._num_moe_layers = cfg.model.num_layers - cfg.model.num_dense_layers

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def prepare(self, resuming: bool) -> None:
        """Create the directory and write the resolved config."""
        if not resuming and self.path.exists() and any(self.checkpoints.glob("step_*")):
            log.warning("%s holds checkpoints from an earlier run; starting fresh (run.resume=true continues it)",
                        self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.path / "config.yaml")

    def start_logging(self, start_step: int) -> None:
        """Open TensorBoard and metrics.jsonl, keeping the lines up to `start_step` (resume)."""
        if self.cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.path / "tb"), purge_step=start_step + 1)
        path = self.path / "metrics.jsonl"
        if path.exists():
            kept = []
            for line in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    row = json.loads(line)
                    if row.get("step", 0) <= start_step:
                        kept.append(line)
                        self.history.append(row)
            atomic_write_text(path, "".join(k + "\n" for k in kept))
        if start_step == 0:
            self.history = []
            if path.exists():
                path.unlink()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append the step's metrics to metrics.jsonl and TensorBoard."""
        row = {k: (float(v) if isinstance(v, float | int) else v) for k, v in metrics.items()}
        self.history.append(row)
        if self.cfg.logging.jsonl:
            with open(self.path / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        if self._writer is None:
            return
        for k, v in row.items():
            if k != "step" and isinstance(v, float) and math.isfinite(v):
                self._writer.add_scalar(k, v, step)
        self._log_heatmap(step, row)
        self._writer.flush()

    def _log_heatmap(self, step: int, row: dict[str, Any]) -> None:
        flips = [row.get(f"routing/flip_rate_layer{i}") for i in range(self._num_moe_layers)]
        if not all(f is not None for f in flips):
            return
        self._flip_history.append(flips)
        every = self.cfg.logging.heatmap_every
        if every and step % every == 0 and len(self._flip_history) > 1:
            from moe_rl.routing.heatmap import heatmap_image

            img = heatmap_image(np.array(self._flip_history), title="top-k flip rate (old vs current)",
                                stat_label="flip rate")
            self._writer.add_image("routing/flip_rate_heatmap", img, step, dataformats="HWC")

    def save_rollout(self, step: int, rollout: Any) -> None:
        """One JSON line per sequence of the step's training batch, when it is due."""
        every = self.cfg.logging.rollouts_every
        if not every or step % every:
            return
        b = rollout.batch
        lines = []
        for i in range(b.batch_size):
            p, r = int(b.prompt_lens_B[i]), int(b.response_lens_B[i])
            lines.append(json.dumps({
                "row": i, "prompt_ids": b.tokens_BS[i, :p].tolist(), "response_ids": b.tokens_BS[i, p:p + r].tolist(),
                "text": rollout.texts[i], "reward": float(rollout.rewards_B[i]), "advantage": float(rollout.adv_B[i]),
                "sampler_logprobs": rollout.rollout_logp_BT[i, :r].tolist()}))
        atomic_write_text(self.path / "rollouts" / f"step_{step:06d}.jsonl", "\n".join(lines) + "\n")

    def rotate_checkpoints(self) -> None:
        """Keep the newest KEEP_CHECKPOINTS complete checkpoints."""
        done = sorted(p for p in self.checkpoints.glob("step_*") if (p / "moe_rl.json").is_file())
        for old in done[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)

    def write_summary(self, wall_seconds: float, world_size: int, layout_name: str) -> dict[str, Any]:
        rewards = [h["reward/mean"] for h in self.history]
        step_times = [h["time/step"] for h in self.history if "time/step" in h]
        timing_keys = sorted({k for h in self.history for k in h if k.startswith("time/")})
        rl = self.cfg.rl
        summary = {
            "steps": len(rewards),
            "reward_first10": statistics.fmean(rewards[:10]) if rewards else float("nan"),
            "reward_last10": statistics.fmean(rewards[-10:]) if rewards else float("nan"),
            "wall_seconds": wall_seconds,
            "objective": rl.objective,
            "replay": rl.replay,
            "rollout_correction": rl.rollout_correction,
            "num_minibatches": rl.num_minibatches,
            "world_size": world_size,
            "layout": layout_name,
            "median_step_seconds": statistics.median(step_times) if step_times else float("nan"),
            "median_timings": {k: statistics.median(h[k] for h in self.history if k in h) for k in timing_keys},
            "tensorboard": str(self.path / "tb"),
        }
        atomic_write_text(self.path / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
