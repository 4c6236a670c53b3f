"""The stress ablations' statistics as the report prints them: each setting's
collapses, rewards and intervals, the pre-registered tests against off-policy GRPO with Holm's
correction, what the seeds can detect, and the plain-language answer the numbers write. Shared
by the report's pre-registered sections and its exploratory one (`stress_explore`).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from scipy import stats as sps

from moe_rl.ablations import stats
from moe_rl.ablations.collapse_stats import (
    fisher,
    fisher_power,
    min_detectable_rate,
    rate_difference_interval,
    wilson,
)
from moe_rl.ablations.settings import settings

BASELINE = "grpo-off"
ALPHA = 0.05
OUTCOMES = (("final_reward", "final reward"), ("reward_auc", "reward AUC"))
Results = dict[str, list[dict[str, Any]]]
"""setting -> its runs' result files, by seed."""
FIRST_WARM_START = "first (not recorded)"
"""The warm start of the runs whose result files predate the `warm_start` field (STRESS_PLAN.md, change 7)."""
HARSH = 0.8
"""A regime in which every off-policy setting collapses at least this often ranks nothing."""


def load(results: Path, block: str) -> Results:
    out: Results = {}
    for name in settings():
        files = [json.loads(p.read_text()) for p in (results / block / name).glob("seed*.json")]
        if files:
            out[name] = sorted(files, key=lambda f: f["seed"])
    return out


def merged(results: Path, max_seed: int | None = None) -> Results:
    """Main and stage-2 runs per setting (the plan tests over all the seeds a setting has)."""
    out = load(results, "main")
    for name, runs in load(results, "stage2").items():
        out[name] = sorted(out.get(name, []) + runs, key=lambda f: f["seed"])
    if max_seed is not None:
        out = {n: [r for r in rs if r["seed"] <= max_seed] for n, rs in out.items()}
    return {n: rs for n, rs in out.items() if rs}


def _ci(iv: dict[str, float] | tuple[float, float], fmt: str = "{:.3f}") -> str:
    lo, hi = (iv["lo"], iv["hi"]) if isinstance(iv, dict) else iv
    return "-" if math.isnan(lo) else f"[{fmt.format(lo)}, {fmt.format(hi)}]"


def _p(p: float) -> str:
    return "-" if math.isnan(p) else (f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}")


def setting_table(res: Results) -> str:
    rows = ["| setting | seeds | collapses | collapse rate [95% Wilson] | final reward [95% t] | reward AUC [95% t] "
            "| first-step reward |", "|---|---|---|---|---|---|---|"]
    for name, runs in res.items():
        n, c = len(runs), sum(r["collapsed"] for r in runs)
        fin = stats.interval([r["final_reward"] for r in runs])
        auc = stats.interval([r["reward_auc"] for r in runs])
        first = statistics.fmean(r["first_reward"] for r in runs)
        rows.append(f"| {name} | {n} | {c}/{n} | {c / n:.2f} {_ci(wilson(c, n, 1.959964))} | {fin['mean']:.3f} "
                    f"{_ci(fin)} | {auc['mean']:.3f} {_ci(auc)} | {first:.3f} |")
    return "\n".join(rows) + "\n"


def against_baseline(res: Results) -> list[dict[str, Any]]:
    """Every setting against off-policy GRPO: collapse rates (Fisher, Newcombe) and the two
    reward outcomes (Welch), each family Holm-corrected over the comparisons made."""
    base = res.get(BASELINE, [])
    if not base:
        return []
    b_c, b_n = sum(r["collapsed"] for r in base), len(base)
    out = []
    for name, runs in res.items():
        if name == BASELINE:
            continue
        c, n = sum(r["collapsed"] for r in runs), len(runs)
        row = {"setting": name, "n": n, "collapses": c, "rate_diff": c / n - b_c / b_n,
               "rate_ci": rate_difference_interval(c, n, b_c, b_n), "fisher_p": fisher(c, n, b_c, b_n)}
        for key, _ in OUTCOMES:
            a, b = [r[key] for r in runs], [r[key] for r in base]
            row[key] = {"diff": statistics.fmean(a) - statistics.fmean(b), "ci": stats.welch_interval(a, b),
                        "p": stats.welch(a, b)}
        out.append(row)
    for family, get in (("fisher", lambda r: r["fisher_p"]),
                        *((k, lambda r, k=k: r[k]["p"]) for k, _ in OUTCOMES)):
        adj = stats.holm_adjusted({r["setting"]: get(r) for r in out})
        for r in out:
            r[f"{family}_holm"] = adj[r["setting"]]
    return out


def tests_table(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> str:
    b_c, b_n = sum(r["collapsed"] for r in base), len(base)
    lines = [f"Against {BASELINE} ({b_c}/{b_n} collapsed); Holm over the {len(rows)} comparisons of each outcome; "
             "**bold**: Holm-adjusted p <= 0.05.\n",
             "| setting | collapses | rate difference [95% Newcombe] | Fisher p | Holm p | final reward diff [95% Welch] "
             "| Welch p | Holm p | AUC diff [95% Welch] | Welch p | Holm p |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["setting"], f"{r['collapses']}/{r['n']}", f"{r['rate_diff']:+.2f} {_ci(r['rate_ci'], '{:+.2f}')}",
                 _p(r["fisher_p"]), _bold(r["fisher_holm"])]
        for key, _ in OUTCOMES:
            cells += [f"{r[key]['diff']:+.3f} {_ci(r[key]['ci'], '{:+.3f}')}", _p(r[key]["p"]), _bold(r[f"{key}_holm"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _bold(p: float) -> str:
    return f"**{_p(p)}**" if p <= ALPHA else _p(p)


def seeds_needed(p_base: float, p_other: float, alpha: float, power: float = 0.8, most: int = 60) -> int | None:
    """Seeds per side at which Fisher's test reaches `power` for these true rates (None: over `most`)."""
    for n in range(5, most + 1, 5):
        if fisher_power(n, n, p_base, p_other, alpha) >= power:
            return n
    return None


def detectable(res: Results, m: int) -> str:
    """The minimum detectable differences at the seeds the settings have."""
    base = res[BASELINE]
    n = len(base)
    p_g = sum(r["collapsed"] for r in base) / n
    first = ALPHA / max(m, 1)
    lines = [f"- Collapse rate, {n} seeds a side, Fisher two-sided, 80% power: against a method that never "
             f"collapses, GRPO's rate must be at least **{_mdr(n, first)}** at Holm's first threshold "
             f"({ALPHA}/{m}) and {_mdr(n, ALPHA)} uncorrected; observed GRPO rate {p_g:.2f}, whose power against "
             f"a never-collapsing method is {fisher_power(n, n, p_g, 0.0, first):.2f} at Holm's first threshold."]
    finals = [r["final_reward"] for r in base]
    if len(finals) >= 2:
        sd = statistics.stdev(finals)
        z = sps.norm.ppf(1 - first / 2) + sps.norm.ppf(0.8)
        lines.append(f"- Final reward, Welch, 80% power at Holm's first threshold (normal approximation, both sides "
                     f"with GRPO's seed sd {sd:.3f}): a difference of about **{z * sd * math.sqrt(2 / n):.3f}**.")
    return "\n".join(lines) + "\n"


def _mdr(n: int, alpha: float) -> str:
    r = min_detectable_rate(n, alpha)
    return "not reachable" if math.isnan(r) else f"{r:.2f}"


def warm_start(run: dict[str, Any]) -> str:
    return run.get("warm_start") or FIRST_WARM_START


def on_first_warm_start(res: Results) -> Results:
    """Only the runs on the first warm start: the pre-registered blocks' own condition."""
    out = {n: [r for r in rs if warm_start(r) == FIRST_WARM_START] for n, rs in res.items()}
    return {n: rs for n, rs in out.items() if rs}


def answer(res: Results, rows: list[dict[str, Any]], m: int, lr: float, updates: int) -> str:
    return " ".join(answer_sentences(res, rows, m, lr, updates)) + "\n"


def answer_sentences(res: Results, rows: list[dict[str, Any]], m: int, lr: float, updates: int) -> list[str]:
    """The answer's sentences: GRPO's collapse count first, then what the tests separate."""
    base = res[BASELINE]
    n, c = len(base), sum(r["collapsed"] for r in base)
    sig = [r for r in rows if r["fisher_holm"] <= ALPHA and r["rate_diff"] < 0]
    worse = [r for r in rows if r["fisher_holm"] <= ALPHA and r["rate_diff"] > 0]
    lower = [r for r in rows if r not in sig and r["rate_diff"] < 0]
    reward_sig = [r for r in rows if r["final_reward_holm"] <= ALPHA and r["final_reward"]["diff"] > 0]
    out = [f"At lr {lr:g} with {updates} mini-batch updates per rollout, off-policy GRPO collapsed in {c} of {n} seeds."]
    if sig:
        out.append("These settings collapse less often than GRPO after Holm's correction: "
                   + "; ".join(f"{r['setting']} ({r['collapses']}/{r['n']}, Holm p {_p(r['fisher_holm'])})" for r in sig)
                   + ".")
    else:
        best = min(rows, key=lambda r: r["collapses"] / r["n"]) if rows else None
        if best is not None:
            p_best = best["collapses"] / best["n"]
            need = seeds_needed(c / n, p_best, ALPHA / max(m, 1))
            out.append(f"No setting's collapse rate separates from GRPO's after Holm's correction. The lowest is "
                       f"{best['setting']} ({best['collapses']}/{best['n']}); if the true rates were the observed "
                       f"{c / n:.2f} and {p_best:.2f}, Fisher's test at Holm's first threshold would reach 80% power "
                       + (f"at about {need} seeds per side." if need else "only beyond 60 seeds per side: "
                          "a harsher regime, not more seeds, is what would separate them."))
    if lower:
        out.append("Fewer collapses than GRPO but not separable at these seeds: "
                   + ", ".join(f"{r['setting']} ({r['collapses']}/{r['n']})" for r in lower) + ".")
    if worse:
        out.append("More collapses than GRPO after Holm: " + ", ".join(r["setting"] for r in worse) + ".")
    off = [r for r in rows if r["setting"].endswith("-off")]
    if off and min(r["collapses"] / r["n"] for r in off) >= HARSH:
        least = min(r["collapses"] / r["n"] for r in off)
        how = "every one of its seeds" if least == 1 else f"at least {least:.0%} of its seeds"
        out.append(f"Every off-policy setting collapsed in {how}: in this regime none of "
                   "the methods keeps training, so it cannot rank them; the question lives at a gentler step (a "
                   "learning rate between the sweep's last surviving rate and this one), which these runs do not "
                   "cover.")
    if reward_sig:
        out.append("Higher final reward than GRPO after Holm: "
                   + ", ".join(f"{r['setting']} ({r['final_reward']['diff']:+.3f})" for r in reward_sig) + ".")
    return out


def verdicts(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Per design-document claim, what the tests say (for the README and the answer)."""
    by = {r["setting"]: r for r in rows}
    claims = {"GSPO": ["gspo-off", "gspo-tis-off"], "RSPO": ["rspo-post-off", "rspo-pre-off", "rspo-post-tis-off",
              "rspo-pre-tis-off"], "R2": ["grpo-r2-off", "grpo-r2-tis-off"], "R3": ["grpo-r3-off", "grpo-r3-tis-off"]}
    out = {}
    for claim, names in claims.items():
        have = [by[n] for n in names if n in by]
        if not have:
            continue
        sep = [r["setting"] for r in have if r["fisher_holm"] <= ALPHA and r["rate_diff"] < 0]
        out[claim] = (f"fewer collapses than GRPO (Holm): {', '.join(sep)}" if sep else
                      "not separable from GRPO on collapses at these seeds")
    return out
