"""A run directory: claimed by one run, resumed or refused, its checkpoints rotated, its
config and summary written (by global rank 0); the metrics' logs are `metrics_log`'s.

    runs/<name>/
      run.json           the run's id: what owns this directory and its checkpoints
      .lock              held (flock) by the process running it
      config.yaml        resolved recipe, written once a start succeeded (what resume checks)
      metrics.jsonl      one JSON object per step
      tb/                TensorBoard events (scalars, routing flip-rate heat map)
      wandb/             Weights & Biases files, with logging.wandb (`moe_rl.runtime.wandb_log`)
      rollouts/step_*.jsonl  whole rollouts, every `logging.rollouts_every` steps (the RL program's)
      checkpoints/step_* megatron checkpoints, this run's newest KEEP_CHECKPOINTS kept
      summary.json       first/last rewards, median timings, where the logs are

A directory belongs to one run, and its logged steps are never dropped. A fresh start
(`run.resume=false`) where checkpoints or logged steps exist is refused, with the ways out:
`run.resume=true`, or `run.overwrite=true`, which moves the old run aside to
`<name>.overwritten-<time>` (never deletes it). `run.resume=true` in an empty directory
starts fresh (a launch script may always pass it); where steps were logged but no
checkpoint was saved it is refused; rows logged after the checkpoint it resumes from move
to `metrics.jsonl.after-step-<n>-<time>`. Each checkpoint
records the run id, and retention deletes only this run's older checkpoints. A resume whose
recipe differs from the saved one in anything but RESUME_MAY_CHANGE is refused, naming the
fields. Temp directories that kills left (`checkpoints/step_*.tmp-*`, `sampler_hf.tmp-*`)
are removed at start, under the lock, so they can only be this run's.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import uuid
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moe_rl.checkpoints import CONFIG_FILE
from moe_rl.checkpoints.directories import (
    is_checkpoint,
    is_complete,
    latest_checkpoint,
    read_meta,
    step_dirs,
)
from moe_rl.checkpoints.errors import TRUST_HINT, CheckpointError
from moe_rl.checkpoints.temps import remove_file_temps, remove_temps
from moe_rl.config import (
    Config,
    ConfigError,
    LoggingConfig,
    RunConfig,
    load_saved_config,
    save_config,
    to_dict,
)
from moe_rl.loop.metrics_log import METRICS_FILE, MetricsLog, parse_rows
from moe_rl.runtime.atomic import atomic_write_text

log = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 2
RUN_FILE = "run.json"
LOCK_FILE = ".lock"
# What a resume may change: run length, checkpoint and evaluation cadence, where the
# directory is, the trust flags, the logging, the evaluation's size, SFT's stopping rule and
# output, the learner layout (a checkpoint loads at any layout) and the sampler's resources
# (per-prompt seeds make the rollouts independent of the number of engines). Everything
# else changes the run itself.
RESUME_MAY_CHANGE = (
    "run.steps", "run.save_every", "run.save_every_minutes", "run.async_save", "run.stop_grace_s",
    "run.max_skipped_updates", "sampler.max_restarts", "task.reward_timeout_s", "run.eval_every", "run.eval_k", "run.eval_max_problems", "run.resume",
    "run.overwrite", "run.trust_checkpoint", "run.name", "run.output_dir", "logging.", "sft.eval_problems",
    "sft.target_reward", "sft.output", "eval.", "dpo.eval_max_pairs", "rm.eval_max_pairs", "parallel.",
    "sampler.vllm_kv_cache_gib", "sampler.gpu_memory_utilization", "sampler.in_process",
    "sampler.tensor_parallel_size", "sampler.expert_parallel", "sampler.sleep_between_steps", "sampler.placement",
    "sampler.engine_ranks", "sampler.weight_sync_bucket_mib", "sampler.generate_timeout_s", "sampler.sync",
    "sampler.full_sync_every",
)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out


def config_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """`key (old -> new)` for every field of two recipes' plain data (`to_dict`) that differs
    and may not change on resume."""
    a, b = _flatten(dict(saved)), _flatten(dict(now))
    keys = sorted(set(a) | set(b))
    return [f"{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in keys
            if a.get(k) != b.get(k) and not k.startswith(RESUME_MAY_CHANGE)]


def read_saved_config(path: Path) -> Config:
    """A config.yaml written by an earlier start, read safely and strictly."""
    import yaml

    try:
        return load_saved_config(path)
    except (ConfigError, ValueError, OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path} cannot be read back ({' '.join(str(e).split())}); "
                          "restore it, or start a new run under another run.name") from e


class RunDirectory:
    """The files of one run under `run.output_dir / run.name`.

    `recipe`: the resolved recipe's plain data (`moe_rl.config.to_dict`), what config.yaml
    holds and a resume is compared against; the directory reads no field of it."""

    def __init__(self, run: RunConfig, logging_cfg: LoggingConfig, recipe: Mapping[str, Any]) -> None:
        self.run, self.recipe = run, recipe
        self.path = run.run_dir
        self.metrics = MetricsLog(logging_cfg, run.name, recipe, self.path)
        self.run_id: str | None = None
        self._lock_fd: int | None = None

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def prepare(self, resume: bool, rank: int = 0, *, needs_init: bool = True) -> Path | None:
        """Before any model is built, on every rank: claim the directory for this run
        (refusing another run's, and a fresh start or a resume that would lose logged steps),
        and return the checkpoint to resume from (None: a fresh start). Rank 0 alone changes
        files (moves an old run aside when asked, removes stale temps, takes the lock);
        config.yaml and run.json are written by `start_logging`, once the start succeeded.
        `needs_init`: a fresh start needs run.init_checkpoint (false for a program that starts
        from random weights, SFT)."""
        run = self.run
        if not resume and (self._old_checkpoints() or self.logged_steps()):
            if not run.overwrite:
                raise ConfigError(self._fresh_start_refusal())
            if rank == 0:
                self._move_aside()
        resume_from = self._resume_point() if resume else None
        if resume_from is not None:
            self._check_resume_config(resume_from)
        elif resume:
            self._check_nothing_to_resume(rank, needs_init)
        owner = self._owner() if resume else None
        self.run_id = owner or (read_meta(resume_from).get("run_id") if resume_from else None) or uuid.uuid4().hex
        if rank == 0:
            self._claim()
        return resume_from

    def _old_checkpoints(self) -> list[Path]:
        return [p for _, p in step_dirs(self.checkpoints) if is_checkpoint(p)]

    def logged_steps(self) -> list[int]:
        """The steps metrics.jsonl holds rows of (an earlier start's), in file order."""
        path = self.path / METRICS_FILE
        if not path.is_file():
            return []
        return [row["step"] for _, row in parse_rows(path.read_text()) if row is not None and "step" in row]

    def _fresh_start_refusal(self) -> str:
        aside = f"run.overwrite=true (moves it aside to {self.path.name}.overwritten-<time>, deleting nothing)"
        if self._old_checkpoints():
            return (f"{self.path} holds checkpoints of an earlier run; continue it with run.resume=true, or "
                    f"start over with {aside}, or choose another run.name")
        steps = self.logged_steps()
        return (f"{self.path} holds an earlier run ({len(steps)} steps in {METRICS_FILE}, no checkpoint); start "
                f"over with {aside}, or choose another run.name")

    def _check_nothing_to_resume(self, rank: int, needs_init: bool) -> None:
        """run.resume=true without a checkpoint: a fresh start, unless that would lose logged
        steps or there are no starting weights."""
        steps = self.logged_steps()
        if steps:
            raise ConfigError(
                f"run.resume=true but {self.path} has no checkpoint to continue from, only {len(steps)} logged "
                f"steps (up to step {max(steps)} in {METRICS_FILE}; run.save_every=0 saves only at the end); "
                f"start over with run.resume=false run.overwrite=true (moves them aside to "
                f"{self.path.name}.overwritten-<time>, deleting nothing), or choose another run.name")
        if needs_init and not self.run.init_checkpoint:
            raise ConfigError(f"run.resume=true but {self.path} has no checkpoint yet, and run.init_checkpoint is "
                              "empty; name the starting weights with run.init_checkpoint")
        if rank == 0:
            log.info("run.resume=true: nothing to resume in %s yet; starting a fresh run from %s", self.path,
                     self.run.init_checkpoint or "random weights")

    def _owner(self) -> str | None:
        try:
            return json.loads((self.path / RUN_FILE).read_text()).get("run_id")
        except (OSError, json.JSONDecodeError, AttributeError):
            return None

    def _resume_point(self) -> Path | None:
        """This run's newest complete checkpoint; a newer one without a manifest (written
        before checkpoints carried one) only when the user trusts it."""
        owner = self._owner()
        found = latest_checkpoint(self.path, owner)
        legacy = [p for s, p in step_dirs(self.checkpoints) if is_checkpoint(p) and not is_complete(p)
                  and (found is None or s > int(found.name.split("_")[1]))]
        if found is None and not legacy and self._old_checkpoints():
            raise CheckpointError(f"the checkpoints in {self.checkpoints} belong to another run than this "
                                  f"directory's ({self.path / RUN_FILE}); move them out, or delete {RUN_FILE} to "
                                  "adopt them")
        if not legacy:
            return found
        if self.run.trust_checkpoint:
            return legacy[-1]
        raise CheckpointError(f"newest checkpoint {legacy[-1]} has no manifest.json (saved by an older version, "
                              f"or not by moe_rl); to resume from it pass {TRUST_HINT}")

    def _check_resume_config(self, ckpt: Path) -> None:
        saved_path = ckpt / CONFIG_FILE
        if not saved_path.is_file():
            saved_path = self.path / CONFIG_FILE
        if not saved_path.is_file():
            return
        changes = config_changes(to_dict(read_saved_config(saved_path)), self.recipe)
        if changes:
            shown = ", ".join(changes[:4]) + (f" and {len(changes) - 4} more" if len(changes) > 4 else "")
            raise ConfigError(f"run.resume=true with a recipe that differs from the run's ({saved_path}) in {shown}; "
                              "resume with the saved values, or start a new run under another run.name")

    def _move_aside(self) -> None:
        """run.overwrite=true: the old run's whole directory goes to <name>.overwritten-<time>."""
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        dest = self.path.with_name(f"{self.path.name}.overwritten-{stamp}")
        n = 1
        while dest.exists():
            n += 1
            dest = self.path.with_name(f"{self.path.name}.overwritten-{stamp}-{n}")
        self._lock()
        self._unlock()
        os.replace(self.path, dest)
        log.warning("run.overwrite=true: the earlier run in %s was moved to %s", self.path, dest)

    def _claim(self) -> None:
        """Rank 0: the directory exists and is locked; what killed writes left is removed."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the run directory {self.path} ({e.strerror or e}); "
                              "choose a writable run.output_dir") from e
        self._lock()
        left = [*remove_temps(self.checkpoints, "step_*"), *remove_temps(self.path, "sampler_hf"),
                *remove_file_temps(self.path), *remove_file_temps(self.path / "rollouts")]
        for p in left:
            log.info("cleaned up %s (left by an interrupted write)", p)

    def _lock(self) -> None:
        import fcntl

        if self._lock_fd is not None:
            return
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(f"{self.path} is in use by another running process; wait for it to finish, "
                              "or choose another run.name") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        self._release = weakref.finalize(self, os.close, fd)  # also when a failed start drops us

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            self._release()
            self._lock_fd = None

    def start_logging(self, start_step: int) -> None:
        """The start succeeded: write config.yaml and run.json, then open the metrics' logs
        (`MetricsLog`), keeping metrics.jsonl's lines up to `start_step` (resume)."""
        save_config(self.recipe, self.path / CONFIG_FILE)
        if self._owner() != self.run_id:
            atomic_write_text(self.path / RUN_FILE, json.dumps({"run_id": self.run_id}) + "\n")
        self.metrics.start(start_step, self.run_id)

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every step's metrics logged so far (a resume's kept rows first)."""
        return self.metrics.history

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """The step's metrics to metrics.jsonl, TensorBoard and W&B (`MetricsLog.log`)."""
        self.metrics.log(step, metrics)

    def rotate_checkpoints(self) -> None:
        """Keep this run's newest KEEP_CHECKPOINTS complete checkpoints; never touch another
        run's (or one whose run id cannot be read)."""
        mine = []
        for _, p in step_dirs(self.checkpoints):
            with contextlib.suppress(CheckpointError):
                if is_complete(p) and read_meta(p).get("run_id") == self.run_id:
                    mine.append(p)
        for old in mine[:-KEEP_CHECKPOINTS]:
            doomed = old.with_name(f"{old.name}.deleting-{uuid.uuid4().hex[:8]}")
            os.replace(old, doomed)  # invisible at once; a kill during the removal leaves only this
            shutil.rmtree(doomed, ignore_errors=True)

    def write_summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """summary.json (atomically): what the program reports about the finished run."""
        atomic_write_text(self.path / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    def close(self, error: BaseException | None = None) -> None:
        """Close the logs and release the directory (every way out of the loop); `error`:
        what ended the run (None: it finished), which W&B records as the run's exit."""
        try:
            self.metrics.close(error)
        finally:
            self._unlock()
