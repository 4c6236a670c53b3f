"""The stress ablations (docs/ablations/STRESS_PLAN.md): the regime sweep of plain
off-policy GRPO, its pre-registered choice, and each finished run's result kept as a small
file in the repository, so the experiment spans sessions.

    python -m moe_rl.ablations stress-sweep --seeds 1-4      # GRPO at the plan's rates
    python -m moe_rl.ablations stress-sweep --lrs 2e-4,4e-4  # a subset

Runs go to `runs/ablations/stress/sweep/lr<lr>/grpo-off/seed<k>/` (the runner's layout:
resumable, two one-thread runs at a time); every finished run's outcomes and per-step metrics
go to `docs/ablations/stress/sweep/lr<lr>/seed<k>.json` (`record`), and
`docs/ablations/stress/SWEEP.md` is regenerated from those files alone (`write_stress_sweep`), with
the regime the plan's rule picks.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from moe_rl.ablations.collapse_stats import LAST, stress_collapsed
from moe_rl.ablations.runner import MARKER, ROOT, Run, ensure_base, run_all
from moe_rl.ablations.settings import OFF_POLICY_UPDATES
from moe_rl.runtime.atomic import atomic_write_text

SETTING = "grpo-off"
PLAN_LRS = (2e-4, 3e-4, 4e-4, 6e-4)
"""The pre-registered sweep's learning rates."""
RESULTS = ROOT / "docs" / "ablations" / "stress"
"""Where the committed per-run results and the reports go."""
KEPT = ("reward/mean", "policy/clip_frac", "policy/token_ratio_std", "routing/flip_rate_mean", "routing/gamma_p05",
        "routing/gamma_mean", "mismatch/k3")
"""Per-step metrics a result file keeps (the outcomes and the mechanism plots need them)."""


def outcomes(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's outcomes under the plan's definitions, from its metrics rows (every result
    file, sweep and stress runs alike, holds these)."""
    rewards = [float(r["reward/mean"]) for r in rows if "reward/mean" in r]
    tail = rewards[-LAST:]
    return {"steps": len(rewards), "first_reward": rewards[0] if rewards else None,
            "final_reward": sum(tail) / len(tail) if tail else None,
            "reward_auc": sum(rewards) / len(rewards) if rewards else None,
            "collapsed": stress_collapsed(rewards)}


def result(rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """One sweep run's result file: its outcomes and its kept metrics."""
    return {**meta, **outcomes(rows), "per_step": {k: [r.get(k) for r in rows] for k in KEPT}}


def block(updates: int) -> str:
    """The sweep's directory name for `updates` mini-batch updates per rollout (the plan's
    first block, 4, is `sweep`; its fallback, 8, `sweep-updates8`)."""
    return "sweep" if updates == OFF_POLICY_UPDATES else f"sweep-updates{updates}"


def stress_sweep_dir(out: Path, lr: float, updates: int = 4) -> Path:
    return out / "stress" / block(updates) / f"lr{lr:g}"


def record(run: Run, runs_dir: Path, results_dir: Path, meta: dict[str, Any]) -> Path | None:
    """Write a finished run's result file (None while the run has not finished)."""
    d = run.directory(runs_dir)
    if not (d / MARKER).is_file():
        return None
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    path = results_dir / f"seed{run.seed}.json"
    atomic_write_text(path, json.dumps(result(rows, {**meta, "seed": run.seed}), indent=1) + "\n")
    return path


def run_stress_sweep(out: Path, lrs: list[float], seeds: tuple[int, ...], base: Path | None, jobs: int,
              results: Path = RESULTS, updates: int = 4) -> list[Run]:
    """GRPO off-policy at each lr and seed with `updates` mini-batch updates per rollout
    (missing runs only), every finished run recorded."""
    base = ensure_base(out, base, os.cpu_count() or 1)
    commit = code_commit()
    failed: list[Run] = []
    for lr in lrs:
        runs = [Run(SETTING, s, (f"optimizer.lr={lr:g}", f"rl.num_minibatches={updates}")) for s in seeds]
        failed += run_all(runs, stress_sweep_dir(out, lr, updates), base, jobs)
        for r in runs:
            record(r, stress_sweep_dir(out, lr, updates), results / block(updates) / f"lr{lr:g}",
                   {"setting": SETTING, "lr": lr, "updates": updates, "commit": commit})
    return failed


def code_commit() -> str:
    """The commit the runs' code is at, `+dirty` when moe_rl/ or examples/ differ from it
    (taken when runs start: committing result files later moves HEAD, not the code they import)."""
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "moe_rl", "examples"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return (proc.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def pick_regime(collapses: dict[float, tuple[int, int]]) -> float | None:
    """The plan's rule: the smallest lr at which GRPO collapses in at least half and not all
    of its seeds ({lr: (collapses, seeds)}); None when no lr qualifies."""
    ok = [lr for lr, (c, n) in sorted(collapses.items()) if n and 2 * c >= n and c < n]
    return ok[0] if ok else None


def sweep_files(results: Path, updates: int) -> dict[float, list[dict[str, Any]]]:
    """The committed sweep result files of one block (`updates` per rollout), by lr ascending."""
    out = {}
    for lr_dir in sorted((results / block(updates)).glob("lr*"), key=lambda p: float(p.name[2:])):
        files = [json.loads(p.read_text()) for p in sorted(lr_dir.glob("seed*.json"))]
        if files:
            out[float(lr_dir.name[2:])] = files
    return out


def collapse_counts(files_by_lr: dict[float, list[dict[str, Any]]]) -> dict[float, tuple[int, int]]:
    """{lr: (collapsed runs, runs)}: what the plan's rule reads."""
    return {lr: (sum(f["collapsed"] for f in files), len(files)) for lr, files in files_by_lr.items()}


def _block_table(results: Path, updates: int) -> tuple[list[str], dict[float, tuple[int, int]]]:
    rows, by_lr = [], sweep_files(results, updates)
    collapses = collapse_counts(by_lr)
    for lr, files in by_lr.items():
        c = collapses[lr][0]
        means = {k: sum(f[k] for f in files) / len(files) for k in ("first_reward", "final_reward", "reward_auc")}
        rows.append(f"| {lr:g} | {len(files)} | {c}/{len(files)} | {means['first_reward']:.3f} | "
                    f"{means['final_reward']:.3f} | {means['reward_auc']:.3f} | "
                    + ", ".join(f"{f['final_reward']:.2f}" for f in files) + " |")
    return rows, collapses


def write_stress_sweep(results: Path = RESULTS) -> Path:
    """docs/ablations/stress/SWEEP.md from the committed result files alone: a table per block
    (4 updates per rollout, then the plan's fallback of 8) and the regime the rule picks."""
    commits = sorted({json.loads(p.read_text())["commit"] for p in results.glob("sweep*/lr*/seed*.json")})
    text = ("# Stress regime sweep: plain off-policy GRPO\n\n"
            "Pre-registered in `STRESS_PLAN.md`; written by `python -m moe_rl.ablations stress-sweep` from the "
            f"result files under `sweep*/` (runs made at commit {', '.join(commits) or '-'}). Collapse: the last "
            f"{LAST} steps' mean reward below 0.05 or more than 0.3 below the first step's.\n")
    pick = None
    for updates in (OFF_POLICY_UPDATES, 8):
        rows, collapses = _block_table(results, updates)
        if not rows:
            continue
        text += (f"\n## {updates} mini-batch updates per rollout\n\n"
                 "| lr | seeds | collapses | first-step reward | final reward | reward AUC | final reward per seed |\n"
                 "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
        if pick is None and pick_regime(collapses) is not None:
            pick = (pick_regime(collapses), updates)
    text += ("\n" + (f"The plan's rule (the smallest lr, at 4 updates first, with GRPO collapsing in at least half "
                      f"and not all seeds) picks **lr = {pick[0]:g} at {pick[1]} updates per rollout**.\n"
                      if pick is not None else
                      "No swept setting meets the plan's rule (collapses in at least half and not all seeds) yet.\n"))
    path = results / "SWEEP.md"
    atomic_write_text(path, text)
    return path
