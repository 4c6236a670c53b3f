"""A run's metrics, step by step: metrics.jsonl (one JSON object per step), TensorBoard
events (scalars and the routing flip-rate heat map) and, with `logging.wandb`, Weights &
Biases under the same names. A resume keeps the rows up to the checkpoint it resumes and
moves the later ones aside (`metrics.jsonl.after-step-<n>-<time>`), never dropping them."""

from __future__ import annotations

import datetime
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_rl.config import LoggingConfig
from moe_rl.runtime.atomic import atomic_write_text

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from moe_rl.runtime.wandb_log import WandbRun

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def parse_rows(text: str) -> list[tuple[str, dict[str, Any] | None]]:
    """Each non-empty line of a metrics.jsonl with its row (None: not a JSON object, e.g.
    a line a kill cut short)."""
    out: list[tuple[str, dict[str, Any] | None]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        out.append((line, row if isinstance(row, dict) else None))
    return out


class MetricsLog:
    """The metrics' files of the run directory `path` (written by global rank 0); `recipe`
    (the resolved recipe's plain data) is the W&B run's config."""

    def __init__(self, logging_cfg: LoggingConfig, run_name: str, recipe: Mapping[str, Any], path: Path) -> None:
        self.logging, self.run_name, self.recipe, self.path = logging_cfg, run_name, recipe, path
        self.history: list[dict[str, Any]] = []
        self._flip_history: list[list[float]] = []
        self._writer: SummaryWriter | None = None
        self._tracker: WandbRun | None = None  # with logging.wandb

    def start(self, start_step: int, run_id: str | None) -> None:
        """Open TensorBoard, W&B (the run id's W&B run) and metrics.jsonl, keeping the lines
        up to `start_step` (resume)."""
        if self.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.path / "tb"), purge_step=start_step + 1)
        if self.logging.wandb:
            from moe_rl.runtime.wandb_log import WandbRun

            self._tracker = WandbRun.start(self.logging, self.run_name, dict(self.recipe), self.path, run_id)
        path = self.path / METRICS_FILE
        if path.exists():
            self.history = self._set_aside_rows_after(start_step)
        if start_step == 0:
            self.history = []
            if path.exists():
                path.unlink()

    def _set_aside_rows_after(self, start_step: int) -> list[dict[str, Any]]:
        """Keep metrics.jsonl's rows up to `start_step` (the checkpoint resumed); the rest
        (steps logged after that checkpoint, a line a kill cut short) move to
        `metrics.jsonl.after-step-<start_step>-<time>`, never dropped. Returns the kept rows."""
        path = self.path / METRICS_FILE
        kept, later = [], []
        for line, row in parse_rows(path.read_text()):
            if row is not None and row.get("step", 0) <= start_step:
                kept.append((line, row))
            else:
                later.append(line)
        if later:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            aside = path.with_name(f"{METRICS_FILE}.after-step-{start_step}-{stamp}")
            atomic_write_text(aside, "".join(line + "\n" for line in later))
            log.warning("%d rows of %s logged after step %d (the checkpoint resumed) were moved to %s",
                        len(later), METRICS_FILE, start_step, aside)
        atomic_write_text(path, "".join(line + "\n" for line, _ in kept))
        return [row for _, row in kept]

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append the step's metrics to metrics.jsonl, TensorBoard and W&B (the same names:
        each finite number but `step`, and the routing heat map)."""
        row = {k: (float(v) if isinstance(v, float | int) else v) for k, v in metrics.items()}
        self.history.append(row)
        if self.logging.jsonl:
            with open(self.path / METRICS_FILE, "a") as f:
                f.write(json.dumps(row) + "\n")
        if self._writer is None and self._tracker is None:
            return
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, float) and math.isfinite(v)}
        heatmap = self._heatmap(step, row)
        images = {"routing/flip_rate_heatmap": heatmap} if heatmap is not None else {}
        if self._writer is not None:
            for k, v in scalars.items():
                self._writer.add_scalar(k, v, step)
            for k, img in images.items():
                self._writer.add_image(k, img, step, dataformats="HWC")
            self._writer.flush()
        if self._tracker is not None:
            self._tracker.log(step, scalars, images)

    def _heatmap(self, step: int, row: dict[str, Any]) -> np.ndarray | None:
        """The routing flip-rate heat map (HWC uint8) when logging.heatmap_every says so."""
        # The MoE layers are the ones the row has a flip rate for (0, 1, ... without a gap).
        flips: list[float] = []
        while (f := row.get(f"routing/flip_rate_layer{len(flips)}")) is not None:
            flips.append(f)
        if not flips:
            return None
        self._flip_history.append(flips)
        every = self.logging.heatmap_every
        if not (every and step % every == 0 and len(self._flip_history) > 1):
            return None
        from moe_rl.routing.heatmap import heatmap_image

        return heatmap_image(np.array(self._flip_history), title="top-k flip rate (old vs current)",
                             stat_label="flip rate")

    def close(self, error: BaseException | None = None) -> None:
        """Close TensorBoard and W&B (`error`: what ended the run, None: it finished)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.finish(error)
