"""docs/ablations/STRESS.md from the committed result files alone: the tables, tests
and answer of `stress_tables` per block, the reproducibility and warm-start checks, the
mechanism read before the collapses, the 3-seed contrast and the exploratory block.

    python -m moe_rl.ablations stress-report
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from moe_rl.ablations.collapse_stats import DROP, FLOOR, LAST
from moe_rl.ablations.settings import settings
from moe_rl.ablations.stress import RESULTS, sweep_files
from moe_rl.ablations.stress_explore import explore_runs, explore_section, explore_summary
from moe_rl.ablations.stress_plots import SURVIVORS
from moe_rl.ablations.stress_runs import CONTRAST_LR, MAIN_SEEDS, STAGE2_SETTINGS, regime, rounded
from moe_rl.ablations.stress_tables import (
    BASELINE,
    HARSH,
    Results,
    against_baseline,
    answer,
    detectable,
    load,
    merged,
    on_first_warm_start,
    setting_table,
    tests_table,
    verdicts,
    warm_start,
)
from moe_rl.runtime.atomic import atomic_write_text

ROOT_DOCS = RESULTS.parent
"""docs/ablations: the committed 3-seed report's results.json lives there."""


def reproducibility(results: Path) -> str:
    """The repeated run against main's, digest for digest, and the sweep's runs at the regime
    (earlier commits) against main's same seeds."""
    lines = []
    rep, main = load(results, "repeat").get(BASELINE, []), {r["seed"]: r for r in load(results, "main").get(BASELINE, [])}
    for r in rep:
        other = main.get(r["seed"])
        if other is None:
            lines.append(f"- repeat of {BASELINE} seed {r['seed']}: its main run has not finished yet.")
            continue
        same = r["metrics_sha256"] == other["metrics_sha256"]
        lines.append(f"- {BASELINE} seed {r['seed']} run twice at commit {r['commit']}: every logged number except "
                     f"wall times {'**identical** (equal sha256 over' if same else '**DIFFERS** (sha256 over'} "
                     f"{r['steps']} steps: {r['metrics_sha256'][:12]} vs {other['metrics_sha256'][:12]}).")
    lr, updates = regime(results)
    for s in sweep_files(results, updates).get(lr, []):
        m = main.get(s["seed"])
        if m is None:
            continue
        same = [rounded(x) for x in s["per_step"]["reward/mean"]] == m["per_step"]["reward/mean"]  # (main's: rounded)
        lines.append(f"- {BASELINE} seed {s['seed']}: the sweep's run (commit {s['commit']}) and main's (commit "
                     f"{m['commit']}) have {'the same' if same else '**different**'} per-step rewards.")
    return "\n".join(lines) + "\n" if lines else "No repeated run yet.\n"


def warm_starts(results: Path) -> str:
    """Which warm start each block's runs trained from, block by block (seeds per warm start)."""
    lines = []
    for block in sorted(p for p in results.iterdir() if p.is_dir() and p.name != "plots"):
        seeds: dict[str, set[int]] = {}
        for f in block.glob("*/seed*.json"):
            run = json.loads(f.read_text())
            seeds.setdefault(warm_start(run), set()).add(run["seed"])
        if not seeds:
            continue
        parts = [f"{w}: seed{'s' if len(s) > 1 else ''} {_span(sorted(s))}" for w, s in sorted(seeds.items())]
        lines.append(f"- `{block.name}`: " + "; ".join(parts) + (" (**two warm starts**)" if len(seeds) > 1 else ""))
    return "\n".join(lines) + "\n"


def _span(seeds: list[int]) -> str:
    """1,2,3,5 -> '1-3, 5'."""
    out, start = [], None
    for i, s in enumerate(seeds):
        start = s if start is None else start
        if i + 1 == len(seeds) or seeds[i + 1] != s + 1:
            out.append(f"{start}-{s}" if s != start else f"{s}")
            start = None
    return ", ".join(out)


def collapse_onset(rewards: list[float]) -> int | None:
    """The step (1-based) the collapse starts at: the first step from which every `LAST`-step
    window's mean reward (that step and the next LAST - 1) stays below the collapse line,
    max(FLOOR, first - DROP); None for a run that never stays below it."""
    line = max(FLOOR, rewards[0] - DROP)
    onset = None
    for i in range(len(rewards) - LAST + 1):
        below = statistics.fmean(rewards[i: i + LAST]) < line
        onset = (onset if onset is not None else i + 1) if below else None
    return onset


MECHANISM = (("routing/flip_rate_mean", "top-k flip rate"), ("routing/dlogr_mean", "abs d log router prob"),
             ("routing/gamma_p05", "router-shift weight p05"), ("policy/clip_frac", "clip frac"),
             ("policy/ratio_max", "largest objective ratio"), ("policy/token_ratio_std", "token-ratio std"),
             ("policy/approx_kl", "approx KL"), ("learner/grad_norm", "grad norm"))
"""The routing and policy metrics read in the steps before a collapse (or a survivor's last steps)."""
WINDOW = 10


def window(run: dict[str, Any]) -> list[int]:
    """0-based step indices the mechanism reads: the `WINDOW` steps before the collapse's onset,
    or a surviving run's last `WINDOW`."""
    rewards = run["per_step"]["reward/mean"]
    onset = collapse_onset(rewards) if run["collapsed"] else None
    end = (onset - 1) if onset is not None else len(rewards)  # 0-based index of the onset step
    return list(range(max(0, end - WINDOW), end))


def window_mean(run: dict[str, Any], key: str, steps: list[int]) -> float:
    """`key`'s mean over the run's `steps` (its `window`); nan when it logs none there."""
    values = run["per_step"].get(key)
    xs = [values[i] for i in steps if values[i] is not None] if values is not None else []
    return statistics.fmean(xs) if xs else float("nan")


def mechanism_table(res: Results) -> str:
    head = " | ".join(t for _, t in MECHANISM)
    lines = [f"| setting | runs | onset step (mean) | {head} |", "|---|---|---|" + "---|" * len(MECHANISM)]
    pooled = {"all settings": [r for runs in res.values() for r in runs]}
    steps = {id(r): window(r) for r in pooled["all settings"]}
    for name, runs in {**pooled, **res}.items():
        for collapsed in (True, False):
            group = [r for r in runs if r["collapsed"] == collapsed]
            if not group:
                continue
            onset = "-"
            if collapsed:
                onsets = [collapse_onset(r["per_step"]["reward/mean"]) for r in group]
                onset = f"{statistics.fmean(o for o in onsets if o is not None):.1f}"
            cells = [_finite_mean(window_mean(r, k, steps[id(r)]) for r in group) for k, _ in MECHANISM]
            state = "collapsed" if collapsed else "survived"
            lines.append(f"| {name} | {len(group)} {state} | {onset} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def objective_level(name: str) -> str:
    """'token' or 'sequence': the level of the ratio a setting's objective clips."""
    from moe_rl.objectives import OBJECTIVES

    objective = next(o.split("=", 1)[1] for o in settings()[name] if o.startswith("rl.objective="))
    return OBJECTIVES[objective].level


def mechanism_reading(res: Results, contrast: Results | None = None) -> str:
    """What the windows before the collapses say about the ratio mechanism, in words the
    numbers write: whether the objectives whose ratio is a per-sequence geometric mean (and so
    cannot be driven by one token's ratio) collapse as often as GRPO, and what separates the
    on-policy reference from off-policy GRPO."""
    seq = {n: rs for n, rs in res.items() if n.endswith("-off") and objective_level(n) == "sequence"}
    grpo = [r for r in res.get(BASELINE, []) if r["collapsed"]]
    runs = [r for rs in seq.values() for r in rs]
    if not runs or not grpo:
        return ""
    fallen = [r for r in runs if r["collapsed"]]

    def largest(group: list[dict[str, Any]]) -> float:
        return statistics.fmean(v for r in group if math.isfinite(v := window_mean(r, "policy/ratio_max", window(r))))

    out = [f"Before their collapses, off-policy GRPO's largest token ratio averaged {largest(grpo):.1f}; the "
           f"objectives whose ratio is a per-sequence geometric mean ({', '.join(sorted(seq))}) kept theirs at "
           + (f"{largest(fallen):.2f} and collapsed in {len(fallen)} of {len(runs)} runs." if fallen else
              f"{largest(runs):.2f} and never collapsed ({len(runs)} runs).")]
    if len(fallen) >= HARSH * len(runs):
        out.append("Bounding the ratio did not prevent the collapse: whatever drives it here, methods without "
                   "volatile ratios in their objective fall as often, so this regime cannot test the design "
                   "documents' ratio mechanism.")
    gentle = [r for r in (contrast or {}).get(BASELINE, []) if not r["collapsed"]]
    if gentle:
        def span(group: list[dict[str, Any]]) -> str:
            # a run that collapses from its first step has no steps before the onset to read
            xs = [x for r in group if math.isfinite(x := window_mean(r, "policy/ratio_max", window(r)))]
            left_out = f"; {len(group) - len(xs)} collapsing from step 1 left out" if len(xs) < len(group) else ""
            return (f"{statistics.fmean(xs):.1f} ({min(xs):.1f}-{max(xs):.1f} per run{left_out})" if xs else
                    "nothing to read (every run collapsed from step 1)")

        out.append(f"Off-policy GRPO's seeds that kept training at lr {CONTRAST_LR:g} saw a largest token ratio of "
                   f"{span(gentle)} over their last {WINDOW} steps, against {span(grpo)} before the collapses.")
    on = res.get("grpo-on", [])
    if on:
        out.append(f"On-policy GRPO (every ratio 1, and one optimizer step per rollout where the off-policy "
                   f"settings take 4) collapsed in {sum(r['collapsed'] for r in on)} of {len(on)}: it differs from "
                   "off-policy GRPO in both, so these runs cannot say which of the two spares it.")
    return " ".join(out) + "\n"


def _finite_mean(xs: Any) -> str:
    """Mean over the runs that log the metric (on-policy runs log no routing shift): '-' if none."""
    kept = [x for x in xs if math.isfinite(x)]
    return f"{statistics.fmean(kept):.3g}" if kept else "-"


def contrast_section(results: Path) -> str:
    res = load(results, "contrast")
    if not res:
        return "The contrast block has not run yet.\n"
    fell = [f"{n} ({sum(r['collapsed'] for r in rs)}/{len(rs)})" for n, rs in res.items() if any(r["collapsed"] for r in rs)]
    runs = sum(len(rs) for rs in res.values())
    text = (f"At lr {CONTRAST_LR:g} ({runs} runs) " + (f"collapses came only in {', '.join(fell)}; every other setting kept "
            "training in every seed." if fell else "no run collapsed.") + "\n\n" + setting_table(res))
    old = ROOT_DOCS / "results.json"
    if old.is_file() and BASELINE in res:
        before = json.loads(old.read_text()).get(BASELINE, {}).get("per_seed", {}).get("final_reward", [])
        now = [statistics.fmean(r["per_step"]["reward/mean"][-10:]) for r in res[BASELINE]]
        text += (f"\nThe committed 3-seed report (`REPORT.md`, final reward = mean of the last 10 steps) had {BASELINE} "
                 f"at {', '.join(f'{x:.3f}' for x in before)}; the same measure on this code: "
                 f"{', '.join(f'{x:.3f}' for x in now)}"
                 + (" (unchanged).\n" if [round(x, 6) for x in before] == [round(x, 6) for x in now] else
                    " (changed: the learner's numerics or the warm start moved since; this block is the contrast "
                    "to read).\n"))
    return text


def write_stress_report(results: Path = RESULTS, plots: bool = True) -> Path:
    """STRESS.md and (unless `plots` is False: the text alone, as the report's tests read it) its
    plots, from the result files under `results`."""
    from moe_rl.ablations.stress_plots import plot_all

    lr, updates = regime(results)
    res = merged(results)
    stage1 = merged(results, max(MAIN_SEEDS))
    main_done = sum(len(v) for v in load(results, "main").values())
    commits = sorted({r["commit"] for runs in res.values() for r in runs})
    warm = sorted({warm_start(r) for runs in res.values() for r in runs})
    parts = [f"# Stress ablations: under routing churn that collapses GRPO, which method keeps training?\n\n"
             f"Pre-registered in [`STRESS_PLAN.md`](STRESS_PLAN.md), regime from [`stress/SWEEP.md`](stress/SWEEP.md): "
             f"**lr {lr:g}, {updates} mini-batch updates per rollout** (the plan's step 3). Written by "
             f"`python -m moe_rl.ablations stress-report` from the result files under `stress/` alone; runs made at "
             f"commit {', '.join(commits) or '-'}, from the warm start{'s' if len(warm) > 1 else ''} "
             f"{', '.join(warm) or '-'} (per block under Reproducibility). Collapse: the last {LAST} steps' mean reward below {FLOOR} or more "
             f"than {DROP} below the first step's. Main runs finished: {main_done} of {len(settings()) * len(MAIN_SEEDS)}"
             + (" (**provisional**: the plan's tests are on 10 seeds per setting).\n" if main_done < 170 else ".\n")]
    if BASELINE in stage1:
        rows = against_baseline(stage1)
        m = len(rows)
        parts += ["\n## The answer\n\n", answer(stage1, rows, m, lr, updates), "\n",
                  mechanism_reading(res, load(results, "contrast")),
                  "\nPer claim of the design documents: "
                  + "; ".join(f"**{k}**: {v}" for k, v in verdicts(rows).items()) + ".\n",
                  explore_summary(results),
                  f"\n## Per setting (seeds 1-{max(MAIN_SEEDS)})\n\n", setting_table(stage1),
                  "\n![collapse rates](stress/plots/collapse_rates.png)\n",
                  "\n## Tests against off-policy GRPO (pre-registered)\n\n", tests_table(rows, stage1[BASELINE]),
                  "\n## What these seeds can detect\n\n", detectable(stage1, m)]
        if any(len(v) > len(stage1.get(k, [])) for k, v in res.items()):
            rows2 = against_baseline(res)
            parts += [f"\n## Stage 2: all seeds (1-20 for {', '.join(STAGE2_SETTINGS)})\n\n", setting_table(res),
                      "\n", tests_table(rows2, res[BASELINE]), "\n", answer(res, rows2, len(rows2), lr, updates)]
            first = on_first_warm_start(res)
            if first != res and BASELINE in first:
                rows3 = against_baseline(first)
                parts += ["\nSome of these seeds ran on a remade warm start (see Reproducibility). The same tests on "
                          "the first warm start's seeds alone:\n\n", setting_table(first), "\n",
                          tests_table(rows3, first[BASELINE]), "\n", answer(first, rows3, len(rows3), lr, updates)]
        parts += ["\n## The mechanism (descriptive)\n\n",
                  f"Means over each run's {WINDOW} steps before its collapse's onset (the first step from which every "
                  f"{LAST}-step window's mean reward stays below the collapse line; fewer steps when the onset "
                  f"comes before step {WINDOW + 1}), or a surviving run's last {WINDOW} steps. The largest objective "
                  "ratio is a token's for GRPO and SAPO and a sequence's (a geometric mean over its tokens) for GSPO, "
                  "GMPO and RSPO; the token-ratio std is over tokens for every setting.\n\n", mechanism_table(res),
                  "\n![mechanism](stress/plots/mechanism.png)\n\n![per layer](stress/plots/layers.png)\n"]
        if contrast := load(results, "contrast"):
            def alive(rs: Results, names: tuple[str, ...]) -> str:
                return ", ".join(f"{n} {sum(not r['collapsed'] for r in rs[n])}/{len(rs[n])}" for n in names if n in rs)

            parts += [f"\nSeeds that kept training, at lr {lr:g}: {alive(res, SURVIVORS)}; at the contrast's lr "
                      f"{CONTRAST_LR:g}: {alive(contrast, (BASELINE, *SURVIVORS))}. The same collapsing GRPO seed "
                      "beside the contrast's seeds:\n\n![mechanism against the contrast](stress/plots/mechanism_contrast.png)\n"]
        if plots:
            plot_all(res, results / "plots", window, load(results, "contrast"), (f"{lr:g}", f"{CONTRAST_LR:g}"))
    parts += ["\n## Reproducibility\n\n", reproducibility(results),
              "\nThe warm start each block's runs trained from (an id over the SFT checkpoint's file hashes; "
              "STRESS_PLAN.md, change 7):\n\n", warm_starts(results),
              "\n## The contrast: every setting at the comfortable lr (2e-4), 3 seeds, same code\n\n",
              contrast_section(results), "\n## Exploratory: between the two rates\n\n", explore_section(results)]
    if explored := explore_runs(results):  # (collapsing and surviving seeds of one setting at one rate)
        parts += ["\nThe mechanism there (descriptive; the windows as in the main block's):\n\n", mechanism_table(explored)]
    path = results.parent / "STRESS.md"
    atomic_write_text(path, "".join(parts))
    return path
