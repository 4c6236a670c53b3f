"""`make demo`: RSPO on the shipped tiny MoE with the vLLM sampler, on CPU (~2 min).

Runs `examples/tiny_rspo.yaml` from the shipped SFT base checkpoint (exact-match reward on
4-6 digit reversal), writes `runs/demo/summary.json` and prints where the TensorBoard logs
are. The demo asks for `reward_last10 - reward_first10 >= 0.30` and says whether it got it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from moe_rl.cli import add_debug_flag, cpu_environment, run_guarded, setup_logging

PROG = "python -m moe_rl.demo"
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
BASE = Path(__file__).resolve().parent / "assets" / "tiny_base"
TARGET_GAIN = 0.30
# Each `make demo` starts over: the previous demo run is moved aside, never deleted.
DEMO_OVERRIDES = ("run.name=demo", "run.output_dir=runs", f"run.init_checkpoint={BASE}", "run.overwrite=true")


def _args(argv: list[str] | None) -> argparse.Namespace:
    fixed = "\n".join(f"  {o}" for o in DEMO_OVERRIDES)
    ap = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"The demo applies these overrides to {RECIPE.relative_to(ROOT)}, then yours:\n{fixed}\n\n"
               "e.g. `python -m moe_rl.demo run.steps=50 rl.objective=gspo`; every key and its meaning:\n"
               "`python -m moe_rl.train --help-config`.")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value",
                    help="recipe overrides, applied after the demo's own (listed below)")
    add_debug_flag(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    cpu_environment()
    setup_logging(0)
    return run_guarded("demo", lambda: _run([*DEMO_OVERRIDES, *args.overrides]), debug=args.debug)


def tensorboard_command(logdir: Path) -> str:
    """The command that shows `logdir`, runnable as printed: TensorBoard from this Python's
    environment (`.venv/bin/tensorboard`), which is on PATH only once the venv is activated."""
    exe = Path(sys.executable).parent / "tensorboard"
    shown = os.path.relpath(exe) if exe.is_relative_to(Path.cwd()) else str(exe)
    return f"{shown} --logdir {logdir}"


def _run(overrides: list[str]) -> int:
    from moe_rl.config import load_config
    from moe_rl.programs.rl import train

    cfg = load_config(RECIPE, overrides)
    summary = train(cfg)
    gain = summary["reward_last10"] - summary["reward_first10"]
    print(json.dumps({k: v for k, v in summary.items() if k != "median_timings"}, indent=2))
    print(f"\nsummary:     {cfg.run_dir / 'summary.json'}")
    print(f"tensorboard: {tensorboard_command(cfg.run_dir / 'tb')}")
    print(f"reward {summary['reward_first10']:.3f} -> {summary['reward_last10']:.3f} "
          f"(gain {gain:+.3f}; target {TARGET_GAIN:+.2f}: {'met' if gain >= TARGET_GAIN else 'NOT met'}) "
          f"in {summary['wall_seconds']:.0f}s, median step {summary['median_step_seconds']:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
