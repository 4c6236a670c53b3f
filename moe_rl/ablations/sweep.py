"""The learning-rate sweep that picks the ablations' step size.

    python -m moe_rl.ablations sweep --lrs 1e-4,3e-4,1e-3 --seeds 1,2

Runs plain off-policy GRPO (the setting the lr must stress but not kill) at each learning
rate into `out/lr_sweep/lr<lr>/grpo-off/seed<k>/` and writes `out/lr_sweep/SWEEP.md`, which
the ablation report includes. The rule it applies: the largest lr at which not every seed
collapses and the mean final reward is at most 0.05 below the first step's is "stressed,
not dead"; the report says which lr that is and the recipe's choice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from moe_rl.ablations import stats
from moe_rl.ablations.runner import MARKER, Run, ensure_base, run_all
from moe_rl.runtime.atomic import atomic_write_text

SETTING = "grpo-off"


def sweep_dir(out: Path, lr: float) -> Path:
    return out / "lr_sweep" / f"lr{lr:g}"


def run_sweep(out: Path, lrs: list[float], seeds: tuple[int, ...], base: Path | None, jobs: int) -> list[Run]:
    base = ensure_base(out, base, os.cpu_count() or 1)
    runs = {lr: [Run(SETTING, s, (f"optimizer.lr={lr:g}",)) for s in seeds] for lr in lrs}
    failed: list[Run] = []
    for lr in lrs:
        failed += run_all(runs[lr], sweep_dir(out, lr), base, jobs)
    return failed


def recipe_lr() -> float:
    """The learning rate the ablation recipe uses (the sweep's pick, by hand)."""
    from moe_rl.ablations.runner import RECIPE
    from moe_rl.config import load_config

    return load_config(RECIPE).optimizer.lr


def write_sweep(out: Path, lrs: list[float], chosen: float | None = None) -> Path:
    lines = ["| lr | seeds | collapses | first-step reward | final reward | reward AUC | peak (5-step mean) |",
             "|---|---|---|---|---|---|---|"]
    verdict: list[float] = []
    for lr in lrs:
        markers = sorted((sweep_dir(out, lr) / SETTING).glob(f"seed*/{MARKER}"))
        if not markers:
            continue
        runs = [[json.loads(x) for x in (m.parent / "metrics.jsonl").read_text().splitlines() if x.strip()]
                for m in markers]
        per = [stats.summarize_run(r) for r in runs]
        first = stats.interval([r[0]["reward/mean"] for r in runs])["mean"]
        iv = {k: stats.interval([p[k] for p in per]) for k in ("final_reward", "reward_auc", "peak_reward")}
        collapses = int(sum(p["collapsed"] for p in per))
        lines.append(f"| {lr:g} | {len(runs)} | {collapses}/{len(runs)} | {first:.3f} | "
                     + " | ".join(f"{iv[k]['mean']:.3f}" for k in ("final_reward", "reward_auc", "peak_reward")) + " |")
        if collapses < len(runs) and iv["final_reward"]["mean"] > first - 0.05:
            verdict.append(lr)
    text = ("Plain off-policy GRPO (`grpo-off`) at each learning rate "
            "(`python -m moe_rl.ablations sweep`):\n\n" + "\n".join(lines) + "\n\n")
    if verdict:
        text += (f"Largest lr where not every seed collapses and the mean final reward is at most 0.05 below "
                 f"the first step's: {max(verdict):g}.")
    else:
        text += "No swept lr kept off-policy GRPO alive in any seed."
    chosen = recipe_lr() if chosen is None else chosen
    text += f" The ablation recipe uses optimizer.lr={chosen:g}."
    path = out / "lr_sweep" / "SWEEP.md"
    atomic_write_text(path, text + "\n")
    return path
