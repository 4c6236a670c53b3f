"""python -m moe_rl.ablations: see the package docstring."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import moe_rl.ablations as pkg
from moe_rl.ablations.mismatch_study import RESULTS as MISMATCH_RESULTS
from moe_rl.ablations.runner import OUT, RECIPE, ROOT, Run, run_all
from moe_rl.ablations.settings import DEFAULT_SEEDS, parse_seeds, settings
from moe_rl.ablations.stress import PLAN_LRS, RESULTS


def _seeds(text: str | None) -> tuple[int, ...]:
    try:
        return parse_seeds(text) if text else DEFAULT_SEEDS
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def _lrs(text: str) -> list[float]:
    try:
        lrs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --lrs {text!r}: give numbers, e.g. 1e-4,3e-4,1e-3") from None
    if not lrs or any(lr <= 0 for lr in lrs):
        raise SystemExit(f"error: --lrs {text!r}: give positive learning rates, e.g. 1e-4,3e-4,1e-3")
    return lrs


def recipe_model() -> str:
    """The ablation model as the recipe builds it, so that --help cannot drift from it."""
    from moe_rl.config import load_config

    m = load_config(RECIPE).model
    return (f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_experts} experts top-{m.moe_router_topk} "
            f"(expert FFN {m.moe_ffn_hidden_size})")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m moe_rl.ablations", description=pkg.__doc__,
                                 epilog=f"Model ({RECIPE.relative_to(ROOT)}): {recipe_model()}.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, default=OUT, help="parent directory of the runs (default runs/ablations)")
    common.add_argument("--seeds", help="comma-separated seeds or ranges (default 1,2,3)")
    common.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2, at most the cores)")
    common.add_argument("--base", type=Path, help="warm-start checkpoint (default: made by SFT under --out)")
    r = sub.add_parser("run", parents=[common], help="train settings (skips finished runs)")
    r.add_argument("names", nargs="*", help="settings to run (see `list`)")
    r.add_argument("--all", action="store_true", help="every setting")
    s = sub.add_parser("sweep", parents=[common], help="plain off-policy GRPO at several learning rates")
    s.add_argument("--lrs", default="1e-4,2e-4,4e-4",
                   help="comma-separated learning rates (default 1e-4,2e-4,4e-4: docs/ablations/lr_sweep.md)")
    st = sub.add_parser("stress-sweep", parents=[common],
                        help="the stress study's regime sweep: off-policy GRPO at the plan's rates (docs/ablations/STRESS_PLAN.md)")
    st.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in PLAN_LRS), help="comma-separated learning rates")
    st.add_argument("--updates", type=int, default=4, choices=(4, 8),
                    help="mini-batch updates per rollout: 4, or the plan's fallback 8")
    sr = sub.add_parser("stress", parents=[common],
                        help="the stress study's runs at the swept regime: repeat, main, stage2, contrast (what is missing)")
    sr.add_argument("--block", choices=("repeat", "main", "stage2", "contrast", "explore"),
                    help="one block only (default: all, in the plan's order; explore: the exploratory blocks "
                         "the plan's change 6 adds, as far as its rule has got)")
    sr.add_argument("--settings", help="comma-separated settings of --block (default: the block's)")
    sr.add_argument("--commit", action="store_true", help="git-commit the result files in batches as they land "
                    "(4 a commit, the rest at a block's end)")
    sr.add_argument("--mix-warm-starts", action="store_true",
                    help="add runs to a block whose runs trained from another warm start (refused without it; "
                         "the report tells the two apart)")
    sr.add_argument("--results", type=Path, default=RESULTS,
                    help="where the result files go (default docs/ablations/stress of this checkout; another "
                         "checkout's lets the runs import a fixed commit while work goes on in that one)")
    mm = sub.add_parser("mismatch", parents=[common],
                        help="the mismatch study's runs: pilot, repeat, main, stage 2, what is missing "
                             "(docs/ablations/MISMATCH_PLAN.md)")
    mm.add_argument("--block", choices=("pilot-lr", "pilot-precision", "repeat", "main", "stage2"),
                    help="one block only (default: every block the committed results unlock, in order)")
    mm.add_argument("--settings", help="comma-separated settings of --block (default: the block's)")
    mm.add_argument("--commit", action="store_true", help="git-commit the result files in batches as they land "
                    "(4 a commit, the rest at a block's end)")
    mm.add_argument("--results", type=Path, default=MISMATCH_RESULTS,
                    help="where the result files go (default docs/ablations/mismatch of this checkout; another "
                         "checkout's lets a pinned copy of the code run while work goes on in that one)")
    mrep = sub.add_parser("mismatch-report",
                          help="write docs/ablations/mismatch/PILOT.md and docs/ablations/MISMATCH.md from the result files")
    mrep.add_argument("--results", type=Path, default=MISMATCH_RESULTS)
    srep = sub.add_parser("stress-report", help="write docs/ablations/STRESS.md and its plots from the result files")
    srep.add_argument("--results", type=Path, default=RESULTS)
    rep = sub.add_parser("report", help="write REPORT.md, results.json and plots")
    rep.add_argument("--out", type=Path, default=OUT)
    sub.add_parser("list", help="list the settings")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    from moe_rl.ablations.report import report

    if args.cmd == "list":
        for n, o in settings().items():
            print(f"{n:20s} {' '.join(o)}")
        return 0
    if args.cmd == "mismatch-report":
        from moe_rl.ablations.mismatch_report import write_reports

        for path in write_reports(args.results):
            print(f"wrote {path}")
        return 0
    if args.cmd == "stress-report":
        from moe_rl.ablations.stress_report import write_stress_report

        print(write_stress_report(args.results).read_text())
        return 0
    if args.cmd == "report":
        print(report(args.out))
        return 0
    t0 = time.perf_counter()
    if args.cmd == "stress":
        from moe_rl.ablations.stress_runs import plan, run_plan

        names = [n.strip() for n in args.settings.split(",") if n.strip()] if args.settings else None
        seeds = _seeds(args.seeds) if args.seeds else None
        failed = run_plan(args.out, lambda: plan(args.results, names, seeds, args.block), args.base, args.jobs,
                          args.results, args.commit, args.mix_warm_starts)
        return _finish(t0, failed)
    if args.cmd == "mismatch":
        from moe_rl.ablations.mismatch_study import blocks, run_study, select

        names = [n.strip() for n in args.settings.split(",") if n.strip()] if args.settings else None
        seeds = _seeds(args.seeds) if args.seeds else None
        failed = run_study(args.out, lambda: select(blocks(args.results), args.block, names, seeds), args.base,
                           args.jobs, args.results, args.commit)
        return _finish(t0, failed)
    seeds = _seeds(args.seeds)
    if args.cmd == "stress-sweep":
        from moe_rl.ablations.stress import run_stress_sweep, write_stress_sweep

        failed = run_stress_sweep(args.out, _lrs(args.lrs), seeds, args.base, args.jobs, updates=args.updates)
        print(write_stress_sweep().read_text())
    elif args.cmd == "sweep":
        from moe_rl.ablations.sweep import run_sweep, write_sweep

        lrs = _lrs(args.lrs)
        failed = run_sweep(args.out, lrs, seeds, args.base, args.jobs)
        print(write_sweep(args.out, lrs))
    else:
        names = list(settings()) if args.all else args.names
        unknown = [n for n in names if n not in settings()]
        if unknown or not names:
            ap.error(f"unknown or no settings {unknown}; valid: {', '.join(settings())}")
        # seed-major: a stopped run leaves whole seeds of every setting, not all seeds of a few
        failed = run_all([Run(n, s) for s in seeds for n in names], args.out, args.base, args.jobs)
        print(report(args.out))
    return _finish(t0, failed)


def _finish(t0: float, failed: list[Run]) -> int:
    print(f"done in {(time.perf_counter() - t0) / 60:.1f} min")
    if failed:
        print("failed: " + ", ".join(f"{r.setting} seed {r.seed}" for r in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
