"""Learner fwd+bwd time and tokens/s of the tiny MoE at 1 process and at 2 processes
(TP2, EP2, PP2), on the demo's RL batch (128 sequences, 12-token prompts, <=16-token
responses). 2 CPU cores in all: 1 process uses 2 threads, 2 processes 1 thread each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import markdown_table, write_results

WORKER = ROOT / "moe_rl_testing" / "workers" / "learner_bench_worker.py"
LAYOUTS = {
    "1 process": (1, []),
    "TP2": (2, ["parallel.tensor_model_parallel_size=2"]),
    "EP2": (2, ["parallel.expert_model_parallel_size=2"]),
    "PP2": (2, ["parallel.pipeline_model_parallel_size=2"]),
}


def run_worker(nproc: int, mode: str, overrides: list[str], quick: bool = False) -> dict:
    """The worker's result; `quick` (make bench-smoke): 3 timed passes of each kind after 1
    warm-up instead of 15 after 3."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, 2 // nproc)), TORCHDYNAMO_DISABLE="1",
                   PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(WORKER), str(out), mode, *(["--iters=3", "--warmup=1"] if quick else []), *overrides]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def main(quick: bool = False) -> None:
    layouts = {"1 process": LAYOUTS["1 process"]} if quick else LAYOUTS
    results = {name: run_worker(n, "learner", ov, quick) for name, (n, ov) in layouts.items()}
    rows = [[name, r["layout"], r["threads_per_rank"], r["batch"]["tokens"], r["fwd_bwd_step_s"] * 1e3,
             r["tokens_per_s"], r["fwd_only_s"] * 1e3] for name, r in results.items()]
    table = markdown_table(["layout", "megatron layout", "threads/rank", "tokens", "fwd+bwd+Adam ms",
                            "tokens/s", "fwd-only ms"], rows)
    notes = ("Median of 15 train steps (forward, backward, grad all-reduce, clip, Adam) after 3 warm-up "
             "steps. On 2 cores the 2-process layouts split the same two cores; gloo collectives and "
             "megatron's per-layer Python overhead dominate at this size, so they show the "
             "communication cost of each layout, not a speed-up. GPU (Transformer Engine, bf16) numbers: "
             "no GPU was lent to this task (see README).")
    write_results("learner", {"results": results}, table, notes)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
