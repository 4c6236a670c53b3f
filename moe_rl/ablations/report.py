"""REPORT.md, results.json and plots from whatever ablation runs exist under `out`.

Only finished runs (with their marker) count, so a report of a half-done `make ablations`
is a correct report of fewer seeds. Plots: one PNG per metric, one band per setting (the
per-step 95% interval over seeds around the mean; the min-max when a setting has two
seeds or fewer would make it meaningless), settings without TIS on the left, with TIS on
the right, the on-policy reference in both.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from moe_rl.ablations import stats
from moe_rl.ablations.runner import MARKER, RECIPE, SFT_RECIPE
from moe_rl.ablations.settings import REFERENCE, settings
from moe_rl.runtime.atomic import atomic_write_text

TARGET_FLIP = 0.10
TARGET_DISAGREE = 0.05

ROW_METRICS = [  # (results key, column title, format)
    ("final_reward", "final reward", "{:.3f}"), ("reward_auc", "reward AUC", "{:.3f}"),
    ("clip_frac", "clip frac", "{:.3f}"), ("token_ratio_std", "token-ratio std", "{:.3f}"),
    ("gamma_mean", "gamma mean", "{:.3f}"), ("gamma_p05", "gamma p05", "{:.3f}"),
    ("flip_rate", "top-k flip rate", "{:.3f}"), ("sampler_learner_k3", "sampler-learner k3", "{:.1e}"),
    ("sampler_disagree_max_layer", "sampler-learner routing disagree (worst layer)", "{:.3f}"),
]
PLOTS = [  # (metrics.jsonl key, y label, file)
    ("reward/mean", "reward (exact match, 5-step mean)", "reward.png"),
    ("routing/flip_rate_mean", "top-k flip rate, old vs current router", "flip_rate.png"),
    ("routing/gamma_mean", "router shift gamma (mean)", "gamma.png"),
    ("policy/clip_frac", "clip fraction", "clip_frac.png"),
    ("policy/token_ratio_std", "token ratio std", "token_ratio_std.png"),
    ("mismatch/k3", "sampler-learner k3", "k3.png"),
]


def load_runs(out: Path) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """setting -> seed -> metrics rows, finished runs only, in `settings()` order."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for name in settings():
        for marker in sorted((out / name).glob(f"seed*/{MARKER}")):
            seed = json.loads(marker.read_text())["seed"]
            lines = (marker.parent / "metrics.jsonl").read_text().splitlines()
            runs.setdefault(name, {})[seed] = [json.loads(line) for line in lines if line.strip()]
    return runs


def summarize(runs: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """setting -> {seeds, per_seed: {metric: [values]}, <metric>: interval, collapses}."""
    out = {}
    for name, by_seed in runs.items():
        per_run = [stats.summarize_run(rows) for rows in by_seed.values()]
        per_seed = {k: [r[k] for r in per_run] for k in per_run[0]}
        out[name] = {"seeds": sorted(by_seed), "per_seed": per_seed,
                     "collapses": int(sum(per_seed["collapsed"])),
                     **{k: stats.interval(v) for k, v in per_seed.items() if k != "collapsed"}}
    return out


def _cell(iv: dict[str, float], fmt: str) -> str:
    if not math.isfinite(iv["mean"]):
        return "–"
    if not math.isfinite(iv["lo"]):
        return fmt.format(iv["mean"])
    return f"{fmt.format(iv['mean'])} [{fmt.format(iv['lo'])}, {fmt.format(iv['hi'])}]"


def table(summary: dict[str, dict[str, Any]]) -> str:
    head = ["setting", "seeds", "collapses", *(t for _, t, _ in ROW_METRICS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in summary.items():
        cells = [name, str(len(s["seeds"])), f"{s['collapses']}/{len(s['seeds'])}",
                 *(_cell(s[k], f) for k, _, f in ROW_METRICS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def churn_section(summary: dict[str, dict[str, Any]]) -> str:
    """Whether the regime churns as the papers' does (targets from the routing-replay and RSPO studies)."""
    plain = {n: s for n, s in summary.items() if n.endswith("-off") and "-r2" not in n and "-r3" not in n}
    if not plain:
        return "No off-policy run without replay yet: routing churn not measured.\n"
    flip = max(s["flip_rate"]["mean"] for s in plain.values())
    flip_worst = max(s["flip_rate_max_layer"]["mean"] for s in plain.values())
    dis = max(s["sampler_disagree_max_layer"]["mean"] for s in summary.values())
    dis_step = max(s["sampler_disagree_worst_step"]["mean"] for s in summary.values())
    ok = lambda x, t: "meets" if x >= t else "MISSES"  # noqa: E731
    return (f"- top-k flip rate between the scoring pass's router and the router of each of the "
            f"{len(plain)} off-policy runs' updates without replay, mean over layers and steps: up to "
            f"{flip:.3f} (worst layer {flip_worst:.3f}); target >= {TARGET_FLIP:.2f}: {ok(flip, TARGET_FLIP)}\n"
            f"- sampler (bf16) vs learner (fp32) routing: tokens whose top-k set differs, worst layer, mean over "
            f"steps: up to {dis:.3f} (the worst single step and layer: {dis_step:.3f}, mean over seeds); "
            f"target >= {TARGET_DISAGREE:.2f}: {ok(dis, TARGET_DISAGREE)}\n")


def r3_section(summary: dict[str, dict[str, Any]]) -> str:
    rows = []
    for with_r3, without in (("grpo-r3-off", "grpo-off"), ("grpo-r3-tis-off", "grpo-tis-off")):
        if with_r3 in summary and without in summary:
            a, b = summary[with_r3], summary[without]
            used = max(a["per_seed"]["sampler_used_disagree_any"])
            rows.append(f"| {with_r3} vs {without} | {used:.3g} | {b['sampler_used_disagree_any']['mean']:.3f} | "
                        f"{_cell(a['sampler_learner_k3'], '{:.2e}')} | {_cell(b['sampler_learner_k3'], '{:.2e}')} |")
    if not rows:
        return "No R3 run with its no-replay pair yet.\n"
    return ("| pair | routing disagreement used by the learner, with R3 (max over seeds) | without |"
            " sampler-learner k3 with R3 | without |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


def pairs_section(summary: dict[str, dict[str, Any]], key: str, title: str) -> str:
    per_seed = {n: s["per_seed"][key] for n, s in summary.items() if len(s["seeds"]) >= 2}
    results = stats.compare(per_seed)
    sig = [r for r in results if r["significant"]]
    if not results:
        return f"{title}: fewer than two settings with two seeds or more; no comparison.\n"
    lines = [f"{title}: {len(results)} pairs compared, {len(sig)} differ at p < 0.05 (Welch; about "
             f"{0.05 * len(results):.1f} would by chance alone), {sum(r['holm'] for r in results)} after "
             f"Holm's correction."]
    lines += [f"- {r['a']} vs {r['b']}: {r['diff']:+.3f} (p = {r['p']:.2g}{', survives Holm' if r['holm'] else ''})"
              for r in sig]
    return "\n".join(lines) + "\n"


def _band(series: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Per step: mean and the 95% interval over seeds (min-max for fewer than 3 seeds)."""
    n = min(len(s) for s in series)
    mean, lo, hi = [], [], []
    for i in range(n):
        xs = [s[i] for s in series]
        iv = stats.interval(xs) if len(xs) >= 3 else {"mean": statistics.fmean(xs), "lo": min(xs), "hi": max(xs)}
        mean.append(iv["mean"])
        lo.append(iv["lo"])
        hi.append(iv["hi"])
    return mean, lo, hi


def plots(runs: dict[str, dict[int, list[dict[str, Any]]]], directory: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    names = []
    for key, label, fname in PLOTS:
        fig, axes = plt.subplots(1, 2, figsize=(14, 4.8), sharey=True)
        for ax, tis in zip(axes, (False, True)):
            for i, (name, by_seed) in enumerate(runs.items()):
                if name != REFERENCE and ("-tis" in name) != tis:
                    continue
                series = [[r[key] for r in rows if key in r] for rows in by_seed.values()]
                series = [stats.smoothed(s) if key == "reward/mean" else s for s in series if s]
                if not series:
                    continue
                mean, lo, hi = _band(series)
                steps = range(1, len(mean) + 1)
                color = "black" if name == REFERENCE else plt.get_cmap("tab20")(i % 20)
                ax.plot(steps, mean, label=name, color=color, lw=1.4)
                ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0)
            ax.set_title("with TIS" if tis else "without TIS")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
        if key == "reward/mean":  # a 3-seed t band can leave [0, 1]; the reward cannot
            axes[0].set_ylim(-0.02, 1.02)
        axes[0].set_ylabel(label)
        fig.tight_layout()
        fig.savefig(directory / fname, dpi=100)
        plt.close(fig)
        names.append(fname)
    return names


def sweep_section(out: Path) -> str:
    path = out / "lr_sweep" / "SWEEP.md"
    return path.read_text() if path.is_file() else "No learning-rate sweep under this directory.\n"


def report(out: Path) -> Path:
    """Write out/results.json, out/REPORT.md and out/plots/*.png; returns REPORT.md."""
    runs = load_runs(out)
    if not runs:
        raise SystemExit(f"no finished ablation runs under {out}; run `python -m moe_rl.ablations run --all` first")
    summary = summarize(runs)
    atomic_write_text(out / "results.json", json.dumps(summary, indent=1, default=float) + "\n")
    figures = plots(runs, out / "plots")
    seconds = [json.loads(m.read_text())["seconds"] for m in out.glob(f"*/seed*/{MARKER}")]
    text = f"""# Ablations: off-policy GRPO, GRPO+R2, GRPO+R3, GSPO, GMPO, RSPO x TIS, on-policy GRPO

Recipe `examples/ablations.yaml` (below) from the warm start of `examples/ablation_sft.yaml`,
every setting with the same seeds; each setting's overrides: `python -m moe_rl.ablations list`.
Sampler in bf16, learner in fp32. {len(seconds)} runs, {sum(seconds) / 60:.0f} CPU-process minutes.
Cells: mean [95% interval over seeds]. Final reward = mean of the last {stats.FINAL} steps;
reward AUC = mean over all steps; collapse = final reward below half the peak of the
{stats.SMOOTH}-step mean; clip frac, token-ratio std, gamma, flip rate, k3 and routing
disagreement are means over steps (gamma p05: the batch 5th percentile).

## Routing churn of this regime

{churn_section(summary)}
## Results

{table(summary)}
## Which differences exceed the seed spread

{pairs_section(summary, "final_reward", "Final reward")}
{pairs_section(summary, "reward_auc", "Reward AUC")}
## R3 checks

{r3_section(summary)}
## Learning rate

{sweep_section(out)}
## Plots

{"".join(f"![{f}](plots/{f})" + chr(10) for f in figures)}
<details><summary>recipes</summary>

```yaml
{RECIPE.read_text()}```

```yaml
{SFT_RECIPE.read_text()}```
</details>
"""
    atomic_write_text(out / "REPORT.md", text)
    return out / "REPORT.md"
