"""Host overhead of the learner, counted on a CPU: aten operations (each a kernel launch on a
GPU, views aside) and host-device synchronisation points per micro-batch and per step, for
this project's code and megatron-core's, under each routing setting the trainer runs.

A profile of the H100 learner (gpu_h100_profile.md) found 22.3k kernel launches and 478
stream synchronisations in two steps: the learner is host-bound. Counting needs no GPU: an
`OpCounter` (moe_rl_testing/op_counter.py) follows which tensors would live on the device and
charges every op to the Python frame that made it.

    python -m bench.cpu.bench_host_overhead              # full shape -> bench/results/host_overhead.*
    git archive ff4e69c | tar -x -C /tmp/base        # a baseline commit's tree, then
    python -m bench.cpu.bench_host_overhead --baseline-tree /tmp/base --baseline-label ff4e69c
    python -m bench.cpu.bench_host_overhead --quick      # tiny shape (smoke test)
    python -m bench.cpu.bench_host_overhead --report     # the tables again from the results file

Shape: Qwen3-30B-A3B's routing (128 experts, top-8) at a CPU-sized width and depth; one
step is the trainer's off-policy step: the old-logprob pass (`Learner.score`) then one
update (`Learner.update`) with the trainer's routing plans (`Learner.routing_plan`) and
loss (`PolicyLossFn`), after one uncounted warm-up step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from moe_rl_testing.bench_common import (
    RESULTS_DIR,
    markdown_table,
    run_module_worker,
    write_results,
)
from moe_rl_testing.host_overhead import FULL, QUICK, measure, per_mb, total

NAME = "host_overhead"
TREE_ENV = "HOST_OVERHEAD_TREE"
"""Where the worker takes moe_rl from, when counting another tree (the baseline)."""
def headline(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per setting: the update's per-micro-batch counts and the step's syncs."""
    out = {}
    for name, r in results.items():
        u, s = r["update"], r["score"]
        out[name] = {
            "project_ops_mb": per_mb(u, "op", "project"), "project_launches_mb": per_mb(u, "launch", "project"),
            "project_syncs_mb": per_mb(u, "sync", "project"), "megatron_ops_mb": per_mb(u, "op", "megatron"),
            "megatron_syncs_mb": per_mb(u, "sync", "megatron"),
            "score_project_ops_mb": per_mb(s, "op", "project"), "score_project_syncs_mb": per_mb(s, "sync", "project"),
            "step_syncs_project": total(s, "sync", owner="project") + total(u, "sync", owner="project"),
            "step_syncs_megatron": total(s, "sync", owner="megatron") + total(u, "sync", owner="megatron"),
            "step_syncs_all": total(s, "sync") + total(u, "sync"),
        }
    return out


def _pair(base: dict[str, Any] | None, now: dict[str, Any], key: str) -> str:
    v = now[key]
    text = f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"
    if base is None:
        return text
    b = base[key]
    return f"{b:.0f} -> {text}" if float(b).is_integer() else f"{b:.1f} -> {text}"


def report(current: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    from moe_rl_testing.op_counter import AREAS

    now = headline(current["results"])
    base = headline(baseline["results"]) if baseline else None
    keys = [("project_ops_mb", "project ops / mb"), ("project_launches_mb", "project launches / mb"),
            ("project_syncs_mb", "project syncs / mb"), ("megatron_ops_mb", "megatron ops / mb"),
            ("megatron_syncs_mb", "megatron syncs / mb"), ("score_project_ops_mb", "score: project ops / mb"),
            ("score_project_syncs_mb", "score: project syncs / mb"), ("step_syncs_project", "step syncs: project"),
            ("step_syncs_megatron", "step syncs: megatron"), ("step_syncs_all", "step syncs: all")]
    rows = [[label] + [_pair(base and base.get(s), now[s], k) for s in now] for k, label in keys]
    head = f"Update micro-batch (forward, loss, backward) unless marked score; {'baseline ' + baseline['commit'] + ' -> ' if baseline else ''}{current['commit']}.\n\n"
    text = head + markdown_table(["per update micro-batch", *now], rows)
    areas = [a for a, _ in AREAS] + ["other"]
    def area_ops(results: dict[str, Any] | None, name: str, area: str) -> dict[str, float] | None:
        return None if results is None else {"v": per_mb(results[name]["update"], "op", "project", area)}

    base_results = baseline["results"] if baseline else None
    area_rows = [[a] + [_pair(area_ops(base_results, s, a), area_ops(current["results"], s, a), "v") for s in now]
                 for a in areas]
    text += "\nProject ops per update micro-batch by area (CPU-only areas are not in the totals above):\n\n"
    text += markdown_table(["area", *now], area_rows)
    text += "\nSync points (both passes of the step; region mb = inside a micro-batch):\n\n"
    text += markdown_table(["setting", "region", "who", "where", "what", "count"], sync_rows(current["results"]))
    return text


def sync_rows(results: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for name, r in results.items():
        merged: dict[tuple, int] = {}
        for part in ("score", "update"):
            for s in r[part]["syncs"]:
                key = (s["region"], s["who"], s["where"], s["what"])
                merged[key] = merged.get(key, 0) + s["count"]
        rows += [[name, *k, n] for k, n in sorted(merged.items())]
    return rows


# ---------------------------------------------------------------------- running

def commit() -> str:
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout
    learner_code = ["moe_rl/learner", "moe_rl/routing", "moe_rl/objectives", "moe_rl/update.py",
                    "moe_rl/step_batch.py", "moe_rl/batch.py"]
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *learner_code], cwd=root, capture_output=True,
                           text=True).stdout.strip()
    return head.strip() + ("+changes" if dirty else "")


def worker(out: str, quick: bool) -> None:
    tree = os.environ.get(TREE_ENV)
    if tree:  # (the learner code of another tree, counted by this tree's counter)
        sys.path.insert(0, tree)
    from moe_rl.learner import init_distributed

    init_distributed()
    torch.set_num_threads(1)
    results = measure(QUICK if quick else FULL)
    Path(out).write_text(json.dumps(results))


def counted(quick: bool, tree: str | None = None) -> dict[str, Any]:
    """Every setting's counts, in a fresh one-process torchrun (of `tree`'s moe_rl if given)."""
    env_before = os.environ.pop(TREE_ENV, None)
    if tree:
        os.environ[TREE_ENV] = str(Path(tree).resolve())
    try:
        return run_module_worker("bench.cpu.bench_host_overhead", *(["--quick"] if quick else []), threads=1)
    finally:
        os.environ.pop(TREE_ENV, None)
        if env_before is not None:
            os.environ[TREE_ENV] = env_before


def main(quick: bool = False, baseline_tree: str | None = None, baseline_label: str = "",
         results_dir: Path | None = None, report_only: bool = False) -> None:
    """Count this tree's learner (and, with `baseline_tree`, that tree's as the baseline rows;
    else the baseline rows already in the results file are kept). `report_only`: rewrite the
    tables from the results file, counting nothing."""
    shape = QUICK if quick else FULL
    previous = (results_dir or RESULTS_DIR) / f"{NAME}.json"
    saved = json.loads(previous.read_text()) if previous.exists() and not quick else {}
    if report_only:
        current, kept = saved["current"], saved.get("baseline")
    else:
        current = {"commit": commit(), "shape": shape, "results": counted(quick)}
        kept = saved.get("baseline") if not baseline_tree else {
            "commit": baseline_label or str(baseline_tree), "shape": shape, "results": counted(quick, baseline_tree)}
    notes = ("Counted on a CPU by moe_rl_testing/op_counter.py (no GPU needed): ops are aten operations after "
             "autograd (views included; 'launches' leave views out), charged to the innermost Python frame "
             "outside torch (backward ops to the frame of their forward op). A sync is an op that would make "
             "the host wait for the GPU's queue if its input lived on the device. megatron-core's numbers are "
             "its CPU path (local layer spec, SequentialMLP over the experts), not Transformer Engine's. "
             "Baseline rows: the same counter run over the baseline commit's learner (`--baseline-tree`). "
             "On a GPU, bench/device/gpu_sync_check.py counts the waits torch's sync debug mode reports inside "
             "micro-batches (results/gpu_h200_syncs.json: none from the project in any setting on an H200, "
             "local layer spec; at the baseline commit an update that measures the router shift failed on a "
             "GPU: the router-shift weights were gathered on the host with a device index).")
    write_results(NAME, {"current": current, "baseline": kept}, report(current, kept), notes, results_dir)


def _arg(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(_arg("--worker"), "--quick" in sys.argv)
    else:
        main(quick="--quick" in sys.argv, baseline_tree=_arg("--baseline-tree"),
             baseline_label=_arg("--baseline-label") or "", report_only="--report" in sys.argv)
