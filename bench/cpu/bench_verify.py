"""The cost of `sampler.verify_every=1` per weight push on the demo model: the engines' check
(the learner's probe scoring, each engine's, the comparison and, for the transformers
sampler, the tensor checksums) against the push itself.

    python -m bench.run_all verify            # 8 steps per sampler
    python -m bench.run_all verify --quick    # 2 steps, the transformers sampler only

Each sampler runs the shipped demo recipe (examples/tiny_rspo.yaml on the tiny base, one
process, colocated) with the check after every push, in a child process; per step the run
logs `sync/seconds` (the push: gather, buckets, loads; the checksums of the received tensors
are taken while loading, so they are in it) and `sync/verify_seconds` (the probe scored by
the learner and the engine, compared). The table gives their medians over the steps after
the first and the ratio verify / push.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import markdown_table, write_results

RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
BASE = ROOT / "moe_rl" / "assets" / "tiny_base"


def _run(backend: str, steps: int, out: Path) -> list[dict]:
    """One demo run with the check after every push; its metrics rows."""
    cmd = [sys.executable, "-m", "moe_rl.train", "--config", str(RECIPE), f"sampler.backend={backend}",
           "sampler.precision=fp32", "sampler.verify_every=1", f"run.steps={steps}", "run.save_every=0",
           "run.export_hf=false", "logging.progress=false", "logging.tensorboard=false",
           f"run.init_checkpoint={BASE}", f"run.output_dir={out}", f"run.name={backend}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (out / backend / "metrics.jsonl").read_text().splitlines()]


def measure(backend: str, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench_verify_") as tmp:
        rows = _run(backend, steps, Path(tmp))[1:]  # (the first push warms the engine's caches)
    push = statistics.median(r["sync/seconds"] for r in rows)
    verify = statistics.median(r["sync/verify_seconds"] for r in rows)
    return {"steps_measured": len(rows), "push_seconds": push, "verify_seconds": verify,
            "ratio": verify / push, "max_abs_diff": max(r["sync/verify_max_abs_diff"] for r in rows)}


def main(quick: bool = False) -> None:
    backends, steps = (["transformers"], 2) if quick else (["transformers", "vllm"], 8)
    results = {b: measure(b, steps) for b in backends}
    table = markdown_table(["sampler", "pushes", "push s (median)", "verify s (median)", "verify / push",
                            "max |diff|"],
                           [[b, r["steps_measured"], f"{r['push_seconds']:.3f}", f"{r['verify_seconds']:.3f}",
                             f"{r['ratio']:.2f}", f"{r['max_abs_diff']:.2g}"] for b, r in results.items()])
    notes = ("The demo model is tiny: a push moves a few MB, so the probe's fixed cost (two forward passes of "
             "4 short rows) weighs more here than it would on a real model, where the push grows with the "
             "weights and the probe does not.")
    print(write_results("verify", {"quick": quick, "steps": steps, "results": results}, table, notes))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    main(quick=ap.parse_args().quick)
