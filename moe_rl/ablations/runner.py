"""Running the ablations: the warm start once, then every (setting, seed) in its own process.

Layout under `out` (default runs/ablations):
    base/                      the SFT warm start (`examples/ablation_sft.yaml`), made once
    <setting>/seed<k>/         one training run (the trainer's run directory)
    <setting>/seed<k>.log      its stdout/stderr
    <setting>/seed<k>/ablation.json   written last, when the run finished: the resume marker

Resumable: a run with its marker is never redone; a run directory without one (killed
half-way) is started again from scratch. Runs go `jobs` at a time, each process given an
equal share of the cores (small matmuls scale poorly across threads, so two one-thread
runs finish sooner than two two-thread runs one after the other).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from moe_rl.ablations.settings import settings
from moe_rl.runtime.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "ablations.yaml"
SFT_RECIPE = ROOT / "examples" / "ablation_sft.yaml"
OUT = Path("runs") / "ablations"
MARKER = "ablation.json"


@dataclass(frozen=True)
class Run:
    """One training run of the ablation grid."""

    setting: str
    seed: int
    overrides: tuple[str, ...] = ()
    """Extra overrides on top of the setting's (an lr sweep's learning rate, say)."""
    own: bool = False
    """The overrides are the whole setting (a study with settings of its own, not the grid's)."""

    def directory(self, out: Path) -> Path:
        return out / self.setting / f"seed{self.seed}"

    def done(self, out: Path) -> bool:
        return (self.directory(out) / MARKER).is_file()


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"))
    # each run decides torch.compile itself (off without a GPU: moe_rl.cli.compile_off_without_gpu)
    # each run is its own one-rank world: nothing inherited may point it at another's rendezvous
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def ensure_base(out: Path, base: Path | None, threads: int) -> Path:
    """The warm start: `base` if given, else `out/base`, made by SFT when missing."""
    if base is not None:
        if not (base / "moe_rl.json").is_file():
            raise SystemExit(f"--base {base}: not a moe_rl checkpoint (no moe_rl.json); leave --base out to "
                             f"make the warm start with {SFT_RECIPE.relative_to(ROOT)}")
        return base
    path = (out / "base").resolve()
    if (path / "moe_rl.json").is_file():
        return path
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "moe_rl.sft", "--config", str(SFT_RECIPE), f"sft.output={path}",
           f"run.output_dir={out.resolve()}", "run.name=base_sft", "run.overwrite=true"]
    print(f"== warm start: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(out / "base_sft.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(threads), cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"the warm start failed (exit {proc.returncode}); see {out / 'base_sft.log'}")
    print(f"== warm start: done in {time.perf_counter() - t0:.0f}s -> {path}", flush=True)
    return path


def train_one(run: Run, out: Path, base: Path, threads: int) -> tuple[Run, float | None]:
    """Train one run in a fresh process; (run, seconds) or (run, None) when it failed."""
    overrides = [*(() if run.own else settings()[run.setting]), *run.overrides]
    run_dir = run.directory(out)
    cmd = [sys.executable, "-m", "moe_rl.train", "--config", str(RECIPE), *overrides,
           f"run.seed={run.seed}", f"run.init_checkpoint={base}", f"run.name={run_dir.name}",
           f"run.output_dir={run_dir.parent.resolve()}", "logging.progress=false", "run.overwrite=true"]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = run_dir.parent / f"{run_dir.name}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(threads), cwd=ROOT)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        print(f"!! {run.setting} seed {run.seed}: exit {proc.returncode}, see {log_path}", flush=True)
        return run, None
    marker = {"setting": run.setting, "seed": run.seed, "overrides": overrides, "seconds": round(seconds, 1)}
    atomic_write_text(run_dir / MARKER, json.dumps(marker, indent=1) + "\n")
    print(f"== {run.setting} seed {run.seed}: {seconds:.0f}s", flush=True)
    return run, seconds


def run_all(runs: Iterable[Run], out: Path, base: Path | None = None, jobs: int = 2,
            on_done: Callable[[Run], None] | None = None) -> list[Run]:
    """Train every run not done yet, `jobs` at a time; returns the runs that failed.
    `on_done(run)` is called as each run finishes (recording its result before the next
    starts, so a stop loses nothing finished)."""
    cores = os.cpu_count() or 1
    jobs = max(1, min(jobs, cores))
    threads = max(1, cores // jobs)
    base_path = ensure_base(out, base, cores)
    todo = [r for r in runs if not r.done(out)]
    print(f"== {len(todo)} run(s) to train, {jobs} at a time, {threads} thread(s) each", flush=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda r: _train_and_report(r, out, base_path, threads, on_done), todo))
    failed = [r for r, s in results if s is None]
    print(f"== trained {len(todo) - len(failed)} run(s) in {time.perf_counter() - t0:.0f}s", flush=True)
    return failed


def _train_and_report(run: Run, out: Path, base: Path, threads: int,
                      on_done: Callable[[Run], None] | None) -> tuple[Run, float | None]:
    run, seconds = train_one(run, out, base, threads)
    if seconds is not None and on_done is not None:
        on_done(run)
    return run, seconds
