"""The mismatch study's runs (docs/ablations/MISMATCH_PLAN.md): on-policy GRPO under a
low-precision sampler, the fp32 control, R3 and the rollout corrections, each finished run
kept as a small committed result file so the study spans sessions.

    python -m moe_rl.ablations mismatch --commit          # everything missing, in the plan's order
    python -m moe_rl.ablations mismatch --block main --settings grpo,grpo-r3 --seeds 11-12

Blocks, each unlocked by the files of the one before (runs under
`runs/ablations/mismatch/<block>/<setting>/seed<k>/`, results under
`docs/ablations/mismatch/<block>/<setting>/seed<k>.json`):
    pilot-lr         GRPO with an fp32 sampler at each pilot rate, seeds 1-4
    pilot-precision  GRPO with a bf16 and an fp8_emulated sampler at the chosen rate, seeds 1-2,
                     rollouts dumped every 10 steps (their ratios fix the thresholds)
    repeat           `grpo` seed 1 again: main's digest must match
    main             the 8 settings, seeds 1-10 (seed-major: a stop leaves whole seeds)
    stage2           seeds 11-20 of the settings the plan's rule sends there
The pilot's choices (`pilot_choices`) are computed from the pilot's result files alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from moe_rl.ablations import mismatch_rules as rules
from moe_rl.ablations.result_commits import ResultCommits
from moe_rl.ablations.runner import MARKER, ROOT, Run, ensure_base, run_all
from moe_rl.ablations.stress import code_commit
from moe_rl.ablations.stress_runs import metrics_digest, rounded, warm_start_id
from moe_rl.runtime.atomic import atomic_write_text

RESULTS = ROOT / "docs" / "ablations" / "mismatch"
LR_SEEDS = (1, 2, 3, 4)
PRECISION_SEEDS = (1, 2)
DUMP_EVERY = 10
MAIN_SEEDS = tuple(range(1, 11))
STAGE2_SEEDS = tuple(range(11, 21))
REFERENCE = "grpo"
CONTROL = "grpo-fp32"
ON_POLICY = ("rl.objective=grpo", "rl.replay=none", "rl.rollout_correction=none", "rl.num_minibatches=1",
             "rl.epochs=1", "rl.old_logprobs=learner")
"""What every run of the study shares on top of examples/ablations.yaml."""
KEPT_PREFIXES = ("reward/mean", "learner/grad_norm", "policy/", "mismatch/k3", "mismatch/frac_dlogp_gt_ln2",
                 "mismatch/chi2_token", "routing/sampler_disagree_any", "routing/sampler_used_disagree_any",
                 "response/length_mean")
"""Per-step metrics a result file keeps (the outcomes, the mechanism and the descriptive plots)."""


def method_overrides(t: dict[str, float]) -> dict[str, list[str]]:
    """The main block's settings: what each changes from `grpo`, with the pilot's thresholds `t`."""
    args = "rl.rollout_correction_args"
    return {
        REFERENCE: [],
        CONTROL: ["sampler.precision=fp32"],
        "grpo-r3": ["rl.replay=R3"],
        "grpo-tis": ["rl.rollout_correction=is_rs", f"{args}.is_level=token", f"{args}.tis_cap={t['tis_cap']!r}"],
        "grpo-georej-veto": ["rl.rollout_correction=is_rs", f"{args}.rs_level=geometric",
                             f"{args}.rs_high={t['geo_high']!r}", f"{args}.veto_below={t['veto_below']!r}"],
        "grpo-opsm": [f"rl.opsm_delta={t['opsm_delta']!r}"],
        "grpo-bypass": ["rl.old_logprobs=sampler"],
        "gspo-bypass": ["rl.objective=gspo", "rl.old_logprobs=sampler"],
    }


SETTINGS = tuple(method_overrides({"tis_cap": 2.0, "geo_high": 1.1, "veto_below": 0.01, "opsm_delta": 0.1}))
"""The main block's setting names, in the report's order."""


@dataclass(frozen=True)
class Block:
    """One group of runs and the result directory they share."""

    name: str
    runs: tuple[Run, ...]


def _run(setting: str, seed: int, *overrides: str) -> Run:
    return Run(setting, seed, (*ON_POLICY, *overrides), own=True)


def mismatch_result_path(results: Path, block: str, run: Run) -> Path:
    return results / block / run.setting / f"seed{run.seed}.json"


def read_block(results: Path, block: str) -> dict[str, list[dict[str, Any]]]:
    """setting -> its result files' contents (seed order) in `block`."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted((results / block).glob("*/seed*.json"), key=lambda p: (p.parent.name, int(p.stem[4:]))):
        out.setdefault(path.parent.name, []).append(json.loads(path.read_text()))
    return out


def lr_setting(lr: float) -> str:
    return f"grpo-fp32-lr{lr:g}"


def pilot_lr_block() -> Block:
    return Block("pilot-lr", tuple(_run(lr_setting(lr), s, "sampler.precision=fp32", f"optimizer.lr={lr!r}",
                                        f"run.steps={rules.PILOT_STEPS}")
                                   for s in LR_SEEDS for lr in rules.PILOT_LRS))


def pilot_precision_block(lr: float) -> Block:
    return Block("pilot-precision", tuple(
        _run(f"grpo-{p}", s, f"sampler.precision={p}", f"optimizer.lr={lr!r}", f"run.steps={rules.PILOT_STEPS}",
             f"logging.rollouts_every={DUMP_EVERY}")
        for s in PRECISION_SEEDS for p in rules.PRECISIONS))


def pilot_choices(results: Path = RESULTS) -> dict[str, Any]:
    """What the pilot fixed, from its files: {} before the lr pilot is complete; the rate
    alone before the precision pilot is; then precision, horizon and thresholds too."""
    runs = read_block(results, "pilot-lr")
    if any(len(runs.get(lr_setting(lr), [])) < len(LR_SEEDS) for lr in rules.PILOT_LRS):
        return {}
    lr, qualified = rules.chosen_lr({lr: [r["collapsed"] for r in runs[lr_setting(lr)]] for lr in rules.PILOT_LRS})
    out: dict[str, Any] = {"lr": lr, "lr_qualified": qualified}
    prec = read_block(results, "pilot-precision")
    if any(len(prec.get(f"grpo-{p}", [])) < len(PRECISION_SEEDS) for p in rules.PRECISIONS):
        return out
    k3 = {p: rules.pooled_per_step([r["per_step"][rules.K3] for r in prec[f"grpo-{p}"]]) for p in rules.PRECISIONS}
    out["precision"] = rules.chosen_precision({p: rules.steps_mean(k3[p], 76, 100) for p in rules.PRECISIONS})
    out["steps"], out["horizon_rule"] = rules.horizon(k3[out["precision"]])
    chosen = prec[f"grpo-{out['precision']}"]
    out["thresholds"] = rules.thresholds([d for r in chosen for d in r["ratios"]["token_log_ratio"]],
                                         [m for r in chosen for m in r["ratios"]["seq_mean_log_ratio"]])
    return out


def main_runs(choices: dict[str, Any], names: list[str] | tuple[str, ...], seeds: tuple[int, ...]) -> tuple[Run, ...]:
    """`names` x `seeds` at the pilot's rate, precision and horizon (seed-major)."""
    common = (f"optimizer.lr={choices['lr']!r}", f"sampler.precision={choices['precision']}",
              f"run.steps={choices['steps']}")
    methods = method_overrides(choices["thresholds"])
    return tuple(_run(n, s, *common, *methods[n]) for s in seeds for n in names)


def blocks(results: Path = RESULTS) -> list[Block]:
    """The blocks the committed files unlock, in the plan's order."""
    out = [pilot_lr_block()]
    choices = pilot_choices(results)
    if "lr" in choices:
        out.append(pilot_precision_block(choices["lr"]))
    if "thresholds" in choices:
        out += [Block("repeat", main_runs(choices, [REFERENCE], (1,))),
                Block("main", main_runs(choices, SETTINGS, MAIN_SEEDS))]
        names = stage2_settings(results)
        if names:
            out.append(Block("stage2", main_runs(choices, names, STAGE2_SEEDS)))
    return out


def stage2_settings(results: Path = RESULTS) -> list[str]:
    """The settings the plan's stage-2 rule sends to seeds 11-20, once main is complete."""
    from moe_rl.ablations.stats import welch_interval

    main = read_block(results, "main")
    if any(len(main.get(n, [])) < len(MAIN_SEEDS) for n in SETTINGS):
        return []
    final = {n: [r["final_reward"] for r in main[n]] for n in SETTINGS}
    delta = rules.DELTA_PER_SD * rules.pooled_sd(list(final.values()))
    picked = [n for n in SETTINGS if n != REFERENCE
              and rules.needs_stage2(welch_interval(final[n], final[REFERENCE]), delta)]
    return [REFERENCE, *picked] if picked else []


def dumped_ratios(run_dir: Path) -> dict[str, list[float]]:
    """Every dumped response token's d = learner - sampler log-prob, and each response's mean d."""
    tokens: list[float] = []
    means: list[float] = []
    for path in sorted((run_dir / "rollouts").glob("step_*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            d = [lp - sp for lp, sp in zip(row["learner_logprobs"], row["sampler_logprobs"], strict=True)]
            if d:
                tokens += d
                means.append(sum(d) / len(d))
    return {"token_log_ratio": [rounded(x) for x in tokens], "seq_mean_log_ratio": [rounded(x) for x in means]}


def mismatch_result(rows: list[dict[str, Any]], meta: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One run's result file: its outcomes, digest and kept per-step metrics (and, when it
    dumped rollouts, the measured ratios the thresholds come from)."""
    keys = sorted({k for r in rows for k in r if k.startswith(KEPT_PREFIXES)})
    out = {**meta, **rules.run_outcomes(rows), "metrics_sha256": metrics_digest(rows),
           "per_step": {k: [rounded(r.get(k)) for r in rows] for k in keys}}
    if (run_dir / "rollouts").is_dir():
        out["ratios"] = dumped_ratios(run_dir)
    return out


def record_run(run: Run, runs_dir: Path, results: Path, block: str, stamp: dict[str, str],
               commits: ResultCommits) -> None:
    """Write a finished run's result file and hand it to `commits` (committed in batches)."""
    d = run.directory(runs_dir)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    seconds = json.loads((d / MARKER).read_text()).get("seconds")
    meta = {"block": block, "setting": run.setting, "seed": run.seed, "overrides": list(run.overrides), **stamp,
            "seconds": seconds}
    out = mismatch_result(rows, meta, d)
    path = mismatch_result_path(results, block, run)
    atomic_write_text(path, json.dumps(out, separators=(",", ":")) + "\n")
    state = "collapsed" if out["collapsed"] else "kept training"
    commits.add(block, path, f"{run.setting} seed {run.seed} {state} (final reward {out['final_reward']:.3f}, "
                f"k3 {out['k3_end']:.2e})", bool(out["collapsed"]))


def missing_runs(results: Path, todo: list[Block]) -> int:
    return sum(not mismatch_result_path(results, b.name, r).is_file() for b in todo for r in b.runs)


def select(all_blocks: list[Block], block: str | None, names: list[str] | None,
           seeds: tuple[int, ...] | None) -> list[Block]:
    """All blocks, or one block restricted to `names` and `seeds` (a clear error otherwise)."""
    if block is None:
        if names or seeds:
            raise SystemExit("error: --settings/--seeds need --block (pilot-lr, pilot-precision, repeat, main, stage2)")
        return all_blocks
    found = {b.name: b for b in all_blocks}.get(block)
    if found is None:
        raise SystemExit(f"error: --block {block}: not unlocked yet or unknown; unlocked: "
                         f"{', '.join(b.name for b in all_blocks)}")
    order = list(dict.fromkeys(r.setting for r in found.runs))
    unknown = [n for n in names or [] if n not in order]
    if unknown:
        raise SystemExit(f"error: --settings {','.join(unknown)}: not in block {block}; valid: {', '.join(order)}")
    some = {r.setting: r for r in found.runs}
    picked_seeds = seeds or tuple(sorted({r.seed for r in found.runs}))
    return [Block(block, tuple(dataclasses.replace(some[n], seed=s) for s in picked_seeds for n in names or order))]


def run_study(out: Path, make_blocks: Callable[[], list[Block]], base: Path | None, jobs: int,
              results: Path = RESULTS, commit: bool = False) -> list[Run]:
    """Train what `make_blocks` names until nothing is missing; the plan is read again after
    every pass, since each block's files unlock the next. With nothing missing it builds
    nothing (not even the warm start) and returns at once."""
    if not missing_runs(results, make_blocks()):
        print("== mismatch: every planned run has landed", flush=True)
        return []
    base = ensure_base(out, base, os.cpu_count() or 1)
    stamp = {"commit": code_commit(), "warm_start": warm_start_id(base)}
    lock = threading.Lock()  # (runs finish on the runner's threads; their records go one at a time)
    commits = ResultCommits("mismatch", enabled=commit)

    def recorded(run: Run, runs_dir: Path, block: str) -> None:
        with lock:
            record_run(run, runs_dir, results, block, stamp, commits)

    try:
        return _run_passes(make_blocks, out, base, jobs, results, recorded, commits)
    finally:  # (a stop commits what landed before it)
        commits.flush()


def _run_passes(make_blocks: Callable[[], list[Block]], out: Path, base: Path, jobs: int, results: Path,
                recorded: Callable[..., None], commits: ResultCommits) -> list[Run]:
    """Passes over the plan's blocks until nothing is missing or a pass makes no progress."""
    while before := missing_runs(results, todo := make_blocks()):
        failed: list[Run] = []
        for blk in todo:
            runs_dir = out / "mismatch" / blk.name
            left = [r for r in blk.runs if not mismatch_result_path(results, blk.name, r).is_file()]
            if not left:
                continue
            print(f"== mismatch {blk.name}: {len(left)} of {len(blk.runs)} run(s) missing", flush=True)
            for r in left:  # finished earlier but not recorded (stopped between the two)
                if r.done(runs_dir):
                    recorded(r, runs_dir, blk.name)
            failed += run_all(left, runs_dir, base, jobs, on_done=partial(recorded, runs_dir=runs_dir, block=blk.name))
            commits.flush(blk.name)
        # (a pass that left its own blocks' runs missing made no progress: stop rather than
        # loop; the next pass's blocks may be more than this one's, since each unlocks the next)
        if failed or missing_runs(results, todo) >= before:
            return failed
    return []
