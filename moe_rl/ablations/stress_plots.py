"""The stress report's plots: collapse rates per setting, a collapsing GRPO seed
beside surviving RSPO / GSPO / R3 seeds step by step (in the stress regime, and against the
contrast block's seeds at the gentler rate, where they survive), and the routing per layer in
the steps before a collapse against a survivor's last steps."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moe_rl.ablations.collapse_stats import wilson

Results = dict[str, list[dict[str, Any]]]
PANELS = (("reward/mean", "reward"), ("routing/flip_rate_mean", "top-k flip rate (mean over layers)"),
          ("routing/dlogr_mean", "|d log router prob| (mean over layers)"),
          ("routing/gamma_p05", "router-shift weight, 5th percentile"), ("policy/clip_frac", "clip fraction"),
          ("policy/ratio_max", "largest objective ratio (log; a sequence's for GSPO, RSPO)"))
SURVIVORS = ("rspo-post-off", "gspo-off", "grpo-r3-off")


def plot_all(res: Results, out: Path, window: Callable[[dict[str, Any]], list[int]],
             contrast: Results | None = None, rates: tuple[str, str] = ("", "")) -> list[Path]:
    """`contrast`: the gentler rate's runs (labelled with `rates`: the stress regime's and the
    contrast's learning rates) for a second mechanism plot."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    paths = [_rates(res, out / "collapse_rates.png"), _mechanism(res, out / "mechanism.png"),
             _layers(res, out / "layers.png", window)]
    grpo = _pick(res, "grpo-off", True)
    if contrast and grpo[0] is not None:
        stress_lr, gentle_lr = rates
        picks = [(grpo[0], f"{grpo[1]}, lr {stress_lr}"),
                 *((run, f"{label}, lr {gentle_lr}") for run, label in
                   (_pick(contrast, n, False) for n in ("grpo-off", *SURVIVORS)) if run is not None)]
        paths.append(_mechanism_plot(picks, out / "mechanism_contrast.png",
                                     f"A collapsing off-policy GRPO seed at lr {stress_lr} beside seeds at lr "
                                     f"{gentle_lr} (GRPO, RSPO post-clip, GSPO, GRPO+R3)"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    tmp.replace(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _rates(res: Results, path: Path) -> Path:
    import matplotlib.pyplot as plt

    names = list(res)
    rates, lo, hi = [], [], []
    for n in names:
        c, k = sum(r["collapsed"] for r in res[n]), len(res[n])
        a, b = wilson(c, k, 1.959964)
        rates.append(c / k)
        lo.append(max(0.0, c / k - a))  # (Wilson's bounds can cross the rate by rounding at 0 or k events)
        hi.append(max(0.0, b - c / k))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.bar(range(len(names)), rates, yerr=[lo, hi], capsize=3, color=["C3" if n == "grpo-off" else "C0" for n in names])
    ax.set_xticks(range(len(names)), [f"{n}\n({len(res[n])})" for n in names], rotation=60, fontsize=7)
    ax.set_ylabel("collapse rate (95% Wilson)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Collapses per setting (seeds in brackets)")
    return _save(fig, path)


def _pick(res: Results, name: str, collapsed: bool) -> tuple[dict[str, Any] | None, str]:
    runs = res.get(name, [])
    hit = [r for r in runs if r["collapsed"] == collapsed]
    if hit:
        return hit[0], f"{name} seed {hit[0]['seed']} ({'collapsed' if collapsed else 'survived'})"
    if not runs:
        return None, ""
    best = max(runs, key=lambda r: r["final_reward"]) if not collapsed else min(runs, key=lambda r: r["final_reward"])
    return best, f"{name} seed {best['seed']} ({'collapsed too' if best['collapsed'] else 'survived'})"


def _mechanism(res: Results, path: Path) -> Path:
    picks = [_pick(res, "grpo-off", True), *(_pick(res, n, False) for n in SURVIVORS)]
    survivors = sum(run is not None and not run["collapsed"] for run, _ in picks[1:])
    return _mechanism_plot(picks, path, "A collapsing off-policy GRPO seed beside RSPO (post-clip), GSPO and GRPO+R3: "
                           + (f"{survivors} of them a surviving seed" if survivors else
                              "none of them has a surviving seed yet (their best final reward shown)"))


def _mechanism_plot(picks: Sequence[tuple[dict[str, Any] | None, str]], path: Path, title: str) -> Path:
    """The runs of `picks` step by step, one panel per routing or policy metric (the first run red)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, panel) in zip(axes.flat, PANELS):
        for i, (run, label) in enumerate(picks):
            if run is None or key not in run["per_step"]:
                continue
            ys = run["per_step"][key]
            ax.plot(range(1, len(ys) + 1), [float("nan") if y is None else y for y in ys],
                    color=f"C{3 if i == 0 else (i - 1 if i < 4 else i)}", label=label, lw=1.4)
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        if key == "policy/ratio_max":
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def _layers(res: Results, path: Path, window: Callable[[dict[str, Any]], list[int]]) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, prefix, title in ((axes[0], "routing/dlogr_layer", "|d log router prob|"),
                              (axes[1], "routing/flip_rate_layer", "top-k flip rate")):
        for collapsed, color in ((True, "C3"), (False, "C0")):
            runs = [r for rs in res.values() for r in rs if r["collapsed"] == collapsed]
            layers = sorted({int(k[len(prefix):]) for r in runs for k in r["per_step"] if k.startswith(prefix)})
            if not runs or not layers:
                continue
            steps = [window(r) for r in runs]
            means = []
            for layer in layers:
                per_run = [statistics.fmean(v for i in st if (v := r["per_step"][f"{prefix}{layer}"][i]) is not None)
                           for r, st in zip(runs, steps) if f"{prefix}{layer}" in r["per_step"] and st]
                means.append(statistics.fmean(per_run) if per_run else float("nan"))
            label = f"{'collapsed' if collapsed else 'surviving'} runs ({len(runs)}): " + (
                "10 steps before the onset" if collapsed else "last 10 steps")
            ax.plot(layers, means, "o-", color=color, label=label)
        ax.set_xlabel("layer")
        ax.set_title(title + ", all settings", fontsize=9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)
