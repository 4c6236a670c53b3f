"""`make bench`: run every bench/bench_*.py module's main() and list the result tables.

    python -m bench.run_all            # all benchmarks, full size
    python -m bench.run_all --quick    # smoke-sized
    python -m bench.run_all objectives learner   # a subset by name
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def available() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"subset of {available()}")
    ap.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")
    args = ap.parse_args()
    names = args.names or available()
    unknown = sorted(set(names) - set(available()))
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; available: {available()}")
    failed = []
    for name in names:
        t0 = time.perf_counter()
        print(f"== bench {name}", flush=True)
        try:
            importlib.import_module(f"bench.bench_{name}").main(quick=args.quick)
        except Exception as e:  # keep going: one broken benchmark should not hide the others
            failed.append(name)
            print(f"!! bench {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        print(f"== bench {name} done in {time.perf_counter() - t0:.1f}s", flush=True)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
