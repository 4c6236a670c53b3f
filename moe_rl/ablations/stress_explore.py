"""The stress ablations' exploratory block (docs/ablations/STRESS_PLAN.md, change 6): a rate
between the contrast's (where nothing but SAPO collapses) and the main regime's (where every
off-policy setting does), chosen by the plan's stated rule from a small GRPO sweep, then the
stage-2 settings at 10 seeds there. Tested apart from the pre-registered blocks.

Blocks, in order (each a result directory under `docs/ablations/stress/`):
    explore-repeat        off-policy GRPO seed 1 at the main regime, on this block's commit:
                          its digest against main's says whether the numerics moved
    explore-sweep-<lr>    off-policy GRPO seeds 1-4 at 2.5e-4, then (by the rule) 2.75e-4 or 2.25e-4
    explore-<lr>          GRPO, GSPO, GRPO+R3, RSPO post-clip (off-policy), seeds 1-10, at the rate chosen
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moe_rl.ablations.settings import OFF_POLICY_UPDATES
from moe_rl.ablations.stress_tables import (
    BASELINE,
    Results,
    against_baseline,
    answer,
    answer_sentences,
    detectable,
    load,
    setting_table,
    tests_table,
    verdicts,
    warm_start,
)

FIRST_LR = 2.5e-4
BELOW_LR, ABOVE_LR = 2.25e-4, 2.75e-4
"""The second point: below when GRPO collapsed in all 4 seeds at FIRST_LR, above when in none."""
SWEEP_SEEDS = (1, 2, 3, 4)
SEEDS = tuple(range(1, 11))
SETTINGS = ("grpo-off", "gspo-off", "grpo-r3-off", "rspo-post-off")
PLANNED = len(SETTINGS) * len(SEEDS)
"""The block's runs: its tables are provisional, and the answer leaves it out, until all have landed."""
REPEAT = "explore-repeat"
WARM_CHECK = "warm-start-check"
"""Off-policy GRPO seed 1 at the main regime on the main runs' commit but the remade warm start
(STRESS_PLAN.md, change 7): against main's run it isolates the warm start, against explore-repeat the code."""


def sweep_block(lr: float) -> str:
    return f"explore-sweep-{lr:g}"


def runs_block(lr: float) -> str:
    return f"explore-{lr:g}"


@dataclass(frozen=True)
class ExploreRate:
    """What the rule has read so far: the sweep points to run (in order), the rate chosen
    (None while undecided or when none qualifies), and whether the rule has concluded."""

    sweep_lrs: tuple[float, ...]
    lr: float | None
    concluded: bool


def _collapses(results: Path, lr: float) -> tuple[int, int]:
    files = list((results / sweep_block(lr) / "grpo-off").glob("seed*.json"))
    return sum(json.loads(p.read_text())["collapsed"] for p in files), len(files)


def explore_rate(results: Path) -> ExploreRate:
    """The plan's rule on the committed sweep files: a point qualifies when 1-3 of GRPO's 4
    seeds collapse; the first point decides where the second goes; two points at most."""
    c, n = _collapses(results, FIRST_LR)
    if n < len(SWEEP_SEEDS):
        return ExploreRate((FIRST_LR,), None, False)
    if 0 < c < n:
        return ExploreRate((FIRST_LR,), FIRST_LR, True)
    second = BELOW_LR if c == n else ABOVE_LR
    c2, n2 = _collapses(results, second)
    if n2 < len(SWEEP_SEEDS):
        return ExploreRate((FIRST_LR, second), None, False)
    return ExploreRate((FIRST_LR, second), second if 0 < c2 < n2 else None, True)


def explore_specs(results: Path, main_lr: float) -> list[tuple[str, float, tuple[str, ...], tuple[int, ...]]]:
    """The exploratory blocks as far as the rule has got: (block name, lr, settings, seeds)."""
    rate = explore_rate(results)
    out: list[tuple[str, float, tuple[str, ...], tuple[int, ...]]] = [(REPEAT, main_lr, ("grpo-off",), (1,))]
    out += [(sweep_block(lr), lr, ("grpo-off",), SWEEP_SEEDS) for lr in rate.sweep_lrs]
    if rate.lr is not None:
        out.append((runs_block(rate.lr), rate.lr, SETTINGS, SEEDS))
    return out


def _same(a: dict, b: dict) -> str:
    return ("**identical** (equal sha256 of every untimed number)" if a["metrics_sha256"] == b["metrics_sha256"]
            else f"**DIFFERS** ({a['metrics_sha256'][:12]} vs {b['metrics_sha256'][:12]})")


def _numerics_checks(repeat: dict, main: dict, warm_check: list[dict]) -> list[str]:
    """The repeat against main's same seed and, when the warm start was remade, which of the
    two (code, warm start) moved the numbers."""
    seed = f"{BASELINE} seed {repeat['seed']} at the main regime"
    lines = [f"- Code check: {seed} on commit {repeat['commit']} (warm start {warm_start(repeat)}) and main's (commit "
             f"{main['commit']}, warm start {warm_start(main)}): {_same(repeat, main)}"
             + ("." if repeat["metrics_sha256"] == main["metrics_sha256"] else
                ": these runs are not on the main runs' numerics.")]
    for w in warm_check:
        lines.append(f"- Warm-start check: {seed} on main's commit {w['commit']} and the warm start {warm_start(w)}: "
                     f"against main's run (same code, the other warm start) {_same(w, main)}; against the repeat "
                     f"above (commit {repeat['commit']}, the same warm start) {_same(w, repeat)}.")
    return lines


def explore_section(results: Path) -> str:
    """The report's exploratory section: the code check, the sweep and the rule's outcome, and
    at the chosen rate the plan's tables and tests (Holm over this block's comparisons)."""
    repeat = load(results, REPEAT).get(BASELINE, [])
    if not repeat:
        return "Not run yet (`make ablations-stress` runs it after the pre-registered blocks).\n"
    main = {r["seed"]: r for r in load(results, "main").get(BASELINE, [])}
    r, m = repeat[0], main.get(repeat[0]["seed"])
    lines = ["Exploratory (`STRESS_PLAN.md`, change 6): its rate was chosen after the pre-registered blocks were "
             "read, so its tests stand apart from theirs.\n"]
    if m is not None:
        lines += _numerics_checks(r, m, load(results, WARM_CHECK).get(BASELINE, []))
    rate = explore_rate(results)
    for lr in rate.sweep_lrs:
        c, n = _collapses(results, lr)
        lines.append(f"- Off-policy GRPO at lr {lr:g}: {c} of {n} seeds collapsed.")
    lines.append("- The rule: " + (f"lr {rate.lr:g}." if rate.lr is not None else
                                   "no rate between the two qualifies; no further run." if rate.concluded else
                                   "undecided until the sweep's seeds have finished."))
    text = "\n".join(lines) + "\n"
    if BASELINE not in (res := explore_runs(results, rate)) or rate.lr is None:  # (runs exist only at a chosen lr)
        return text
    if (done := _landed(res)) < PLANNED:
        text += (f"\n**Provisional**: {done} of the block's {PLANNED} runs have finished; the tables and tests "
                 "below are on what has landed, not the block's result.\n")
    rows = against_baseline(res)
    return (text + "\n" + setting_table(res) + "\n" + tests_table(rows, res[BASELINE]) + "\n"
            + answer(res, rows, len(rows), rate.lr, OFF_POLICY_UPDATES) + "\n" + detectable(res, len(rows)))


def _landed(res: Results) -> int:
    return sum(len(rs) for rs in res.values())


def explore_runs(results: Path, rate: ExploreRate | None = None) -> Results:
    """The runs at the rate the rule chose ({} while it has not chosen one)."""
    rate = rate or explore_rate(results)
    return load(results, runs_block(rate.lr)) if rate.lr is not None else {}


def explore_summary(results: Path) -> str:
    """For the report's answer, once the exploratory block is complete: what it found at the
    gentler rate, flagged as chosen after the pre-registered results were read ("" before)."""
    rate = explore_rate(results)
    res = explore_runs(results, rate)
    if BASELINE not in res or _landed(res) < PLANNED or rate.lr is None:  # (runs exist only at a chosen lr)
        return ""
    rows = against_baseline(res)
    base = res[BASELINE]
    counts = ", ".join(f"{r['setting']} {r['collapses']}/{r['n']}" for r in rows)
    tests = answer_sentences(res, rows, len(rows), rate.lr, OFF_POLICY_UPDATES)[1:]  # (the first: GRPO's count)
    claims = "; ".join(f"**{k}**: {v}" for k, v in verdicts(rows).items())
    return (f"\nThe gentler step, explored after these results were read (the section Exploratory below, on the "
            f"remade warm start; its tests stand apart): at lr {rate.lr:g} off-policy GRPO collapsed in "
            f"{sum(r['collapsed'] for r in base)} of {len(base)} seeds; {counts}. {' '.join(tests)} "
            f"Per claim there: {claims}.\n")
