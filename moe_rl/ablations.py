"""Reproducible ablations: GRPO, GRPO+R2, GRPO+R3, GSPO, RSPO, each with and without TIS,
each on-policy (one update per rollout) and off-policy (4 mini-batch updates per rollout).

    python -m moe_rl.ablations run --all        # every setting (make ablations)
    python -m moe_rl.ablations run rspo-off     # one setting (make ablate-rspo-off)
    python -m moe_rl.ablations report           # runs/ablations/REPORT.md, results.json, plots
    python -m moe_rl.ablations list

Every setting runs `examples/ablations.yaml` (same model, base checkpoint, seeds, steps and
learning rate) with its own overrides, each in a fresh process, into
`runs/ablations/<name>/`. The sampler runs in bf16 while the learner runs in fp32, as rollouts
usually do, so there is a real sampler-learner gap for TIS to correct and for R3 to close;
it is the transformers backend for every setting, since R3 needs the sampler's routed
experts and vLLM cannot return them on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from moe_rl.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "ablations.yaml"
OUT = Path("runs") / "ablations"

OBJECTIVE_SETTINGS = {
    "grpo": ["rl.objective=grpo", "rl.replay=none"],
    "grpo-r2": ["rl.objective=grpo", "rl.replay=R2"],
    "grpo-r3": ["rl.objective=grpo", "rl.replay=R3"],
    "gspo": ["rl.objective=gspo", "rl.replay=none"],
    "rspo": ["rl.objective=rspo", "rl.replay=none"],
}
POLICY_REGIMES = {"on": ["rl.num_minibatches=1"], "off": ["rl.num_minibatches=4"]}
CORRECTIONS = {"": ["rl.rollout_correction=none"], "-tis": ["rl.rollout_correction=tis"]}


def settings() -> dict[str, list[str]]:
    """name -> overrides, e.g. 'grpo-r2-tis-off'."""
    out = {}
    for obj, o in OBJECTIVE_SETTINGS.items():
        for corr, c in CORRECTIONS.items():
            for regime, r in POLICY_REGIMES.items():
                out[f"{obj}{corr}-{regime}"] = [*o, *c, *r]
    return out


def run_one(name: str, extra: list[str], out: Path = OUT) -> Path:
    """Train one setting in a fresh process; returns its run directory."""
    overrides = settings()[name]
    run_dir = out / name
    # A setting is run whole: a run directory left by a killed attempt is moved aside.
    cmd = [sys.executable, "-m", "moe_rl.train", "--config", str(RECIPE), *overrides,
           f"run.name={name}", f"run.output_dir={out}", "logging.progress=false", "run.overwrite=true", *extra]
    env = dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"))
    t0 = time.perf_counter()
    print(f"== {name}: {' '.join(overrides)}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / f"{name}.log"  # beside the run directory, which the trainer owns
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"ablation {name} failed (exit {proc.returncode}); see {log_path}")
    print(f"== {name}: done in {time.perf_counter() - t0:.0f}s", flush=True)
    return run_dir


def _rows(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _mean(rows: list[dict[str, float]], key: str) -> float:
    vals = [r[key] for r in rows if key in r and math.isfinite(r[key])]
    return statistics.fmean(vals) if vals else float("nan")


def summarize(name: str, rows: list[dict[str, float]]) -> dict[str, Any]:
    """The report's columns for one run."""
    rewards = [r["reward/mean"] for r in rows]
    last = rows[-10:]
    return {
        "name": name,
        "steps": len(rows),
        "final_reward": statistics.fmean(rewards[-10:]) if rewards else float("nan"),
        "reward_auc": statistics.fmean(rewards) if rewards else float("nan"),
        "clip_frac": _mean(rows, "policy/clip_frac"),
        "token_ratio_std": _mean(rows, "policy/token_ratio_std"),
        "gamma_mean": _mean(rows, "routing/gamma_mean"),
        "gamma_min": min((r["routing/gamma_min"] for r in rows if "routing/gamma_min" in r), default=float("nan")),
        "flip_rate": _mean(rows, "routing/flip_rate_mean"),
        "sampler_learner_k3": _mean(rows, "mismatch/k3"),
        "sampler_disagree_any": _mean(rows, "routing/sampler_disagree_any"),
        "final_clip_frac": _mean(last, "policy/clip_frac"),
        "seconds_per_step": _mean(rows, "time/step"),
    }


COLUMNS = [
    ("setting", "name", "{}"), ("final reward", "final_reward", "{:.3f}"), ("reward AUC", "reward_auc", "{:.3f}"),
    ("clip frac", "clip_frac", "{:.3g}"), ("token-ratio std", "token_ratio_std", "{:.3g}"),
    ("gamma mean", "gamma_mean", "{:.3f}"), ("gamma min", "gamma_min", "{:.3f}"),
    ("top-k flip rate", "flip_rate", "{:.3g}"), ("sampler-learner k3", "sampler_learner_k3", "{:.2e}"),
    ("routing disagree (any layer)", "sampler_disagree_any", "{:.3g}"), ("s/step", "seconds_per_step", "{:.2f}"),
]


def _fmt(fmt: str, v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "–"
    return fmt.format(v)


def report(out: Path = OUT) -> Path:
    """results.json, REPORT.md and PNG plots from whatever runs exist under `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in settings() if (out / n / "metrics.jsonl").is_file()]
    if not names:
        raise SystemExit(f"no ablation runs under {out}; run `python -m moe_rl.ablations run --all` first")
    runs = {n: _rows(out / n) for n in names}
    results = [summarize(n, runs[n]) for n in names]
    atomic_write_text(out / "results.json", json.dumps({"runs": results}, indent=2) + "\n")
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    for key, label, fname in [("reward/mean", "reward (exact match)", "reward.png"),
                              ("routing/flip_rate_mean", "top-k flip rate, old vs current router", "flip_rate.png"),
                              ("routing/gamma_mean", "router shift gamma (mean)", "gamma.png")]:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
        for ax, regime in zip(axes, POLICY_REGIMES):
            for n in names:
                if not n.endswith(f"-{regime}"):
                    continue
                xs = [r["step"] for r in runs[n] if key in r]
                ys = [r[key] for r in runs[n] if key in r]
                if len(ys) >= 5 and key == "reward/mean":  # 5-step moving average
                    ys = [statistics.fmean(ys[max(0, i - 4): i + 1]) for i in range(len(ys))]
                ax.plot(xs, ys, label=n.removesuffix(f"-{regime}"), ls="--" if "-tis" in n else "-")
            ax.set_title(f"{regime}-policy ({'1 update' if regime == 'on' else '4 mini-batch updates'} per rollout)")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel(label)
        axes[1].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(plots / fname, dpi=110)
        plt.close(fig)
    head = "| " + " | ".join(c for c, _, _ in COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    body = "".join("| " + " | ".join(_fmt(f, r[k]) for _, k, f in COLUMNS) + " |\n" for r in results)
    cfg_text = RECIPE.read_text()
    text = f"""# Ablations: GRPO / GRPO+R2 / GRPO+R3 / GSPO / RSPO x TIS x on/off-policy

Recipe `examples/ablations.yaml` (below), same seed and steps for every run; each setting's
overrides are in `moe_rl/ablations.py`. Sampler in bf16, learner in fp32 (a real
sampler-learner gap). Columns: final reward = mean of the last 10 steps; reward AUC = mean
over all steps; clip frac, token-ratio std, gamma, flip rate and k3 are means over steps
(gamma min: the smallest seen). Off-policy = 4 mini-batch updates per rollout, where the
router moves between the update that made the rollout's old logprobs and the later ones.

{head}{body}
![reward](plots/reward.png)
![flip rate](plots/flip_rate.png)
![gamma](plots/gamma.png)

<details><summary>recipe</summary>

```yaml
{cfg_text}```
</details>
"""
    atomic_write_text(out / "REPORT.md", text)
    return out / "REPORT.md"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_rl.ablations", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train settings")
    r.add_argument("names", nargs="*", help="settings to run (see `list`)")
    r.add_argument("--all", action="store_true", help="every setting")
    r.add_argument("--out", default=str(OUT), help="parent directory of the runs")
    r.add_argument("overrides", nargs="*", default=[], help=argparse.SUPPRESS)
    rep = sub.add_parser("report", help="write REPORT.md, results.json and plots")
    rep.add_argument("--out", default=str(OUT))
    sub.add_parser("list", help="list the settings")
    args, extra = ap.parse_known_args(argv)
    if args.cmd == "list":
        for n, o in settings().items():
            print(f"{n:22s} {' '.join(o)}")
        return 0
    if args.cmd == "report":
        print(report(Path(args.out)))
        return 0
    names = list(settings()) if args.all else args.names
    unknown = [n for n in names if n not in settings()]
    if unknown or not names:
        ap.error(f"unknown or no settings {unknown}; valid: {', '.join(settings())}")
    t0 = time.perf_counter()
    for n in names:
        run_one(n, extra, Path(args.out))
    print(f"ran {len(names)} settings in {time.perf_counter() - t0:.0f}s")
    print(report(Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
