"""`make bench`: run every benchmark's main(): bench/cpu/bench_*.py, then bench/device/bench_*.py.

    python -m bench.run_all            # all benchmarks, full size -> bench/results/
    python -m bench.run_all --quick    # smoke-sized, into a temporary directory (make bench-smoke)
    python -m bench.run_all objectives learner   # a subset by name

Names are the module's without `bench_` (`objectives` is bench/cpu/bench_objectives.py).
A benchmark that needs a CUDA GPU says so (`NEEDS_CUDA = True` in its module) and is skipped
with one line on a machine without one. Any other failure is reported and the run exits 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from moe_rl_testing.bench_common import RESULTS_DIR, RESULTS_ENV

HERE = Path(__file__).resolve().parent
KINDS = ("cpu", "device")  # the folders whose bench_*.py modules `make bench` runs, in this order


def modules() -> dict[str, str]:
    """{name: module} of every benchmark, CPU ones first."""
    return {p.stem.removeprefix("bench_"): f"bench.{kind}.{p.stem}"
            for kind in KINDS for p in sorted((HERE / kind).glob("bench_*.py"))}


def available() -> list[str]:
    return list(modules())


def _run_one(name: str, quick: bool) -> bool:
    """One benchmark's main(); False when it failed (a GPU-only one on a CPU machine is skipped)."""
    t0 = time.perf_counter()
    module = importlib.import_module(modules()[name])
    if getattr(module, "NEEDS_CUDA", False) and not torch.cuda.is_available():
        print(f"== bench {name} skipped: needs a CUDA GPU", flush=True)
        return True
    print(f"== bench {name}", flush=True)
    try:
        module.main(quick=quick)
    except (Exception, SystemExit) as e:  # keep going: one broken benchmark should not hide the others
        print(f"!! bench {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return False
    print(f"== bench {name} done in {time.perf_counter() - t0:.1f}s", flush=True)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"subset of {available()}")
    ap.add_argument("--quick", action="store_true", help="small sizes, for smoke tests (results to a temporary "
                    "directory unless --results is given)")
    ap.add_argument("--results", type=Path, help=f"where the result files go (default {RESULTS_DIR})")
    args = ap.parse_args()
    names = args.names or available()
    unknown = sorted(set(names) - set(available()))
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; available: {available()}")
    with tempfile.TemporaryDirectory(prefix="bench_smoke_") as tmp:
        results = args.results or (Path(tmp) if args.quick else RESULTS_DIR)
        before = os.environ.get(RESULTS_ENV)
        os.environ[RESULTS_ENV] = str(results)  # (the benchmarks and their child processes write there)
        print(f"== results to {results}", flush=True)
        try:
            seconds: dict[str, float] = {}
            failed = []
            for name in names:
                t0 = time.perf_counter()
                if not _run_one(name, args.quick):
                    failed.append(name)
                seconds[name] = time.perf_counter() - t0
        finally:
            if before is None:
                os.environ.pop(RESULTS_ENV, None)
            else:
                os.environ[RESULTS_ENV] = before
    # (the longest first: what to shrink when `make bench-smoke` outgrows its 10 minutes in CI)
    total = sum(seconds.values())
    print(f"== {len(names)} benchmarks in {total:.0f}s ({total / 60:.1f} min): "
          + ", ".join(f"{n} {s:.0f}s" for n, s in sorted(seconds.items(), key=lambda kv: -kv[1])), flush=True)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
