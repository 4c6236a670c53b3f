"""`make demo`: RSPO on the shipped tiny MoE with the vLLM sampler, on CPU.

    python -m moe_rl.demo [section.key=value ...]

Runs `examples/tiny_rspo.yaml` from the shipped SFT base checkpoint (exact-match reward on
4-6 digit reversal), writes `runs/demo/summary.json` and prints where the TensorBoard logs
are. The demo asks for `reward_last10 - reward_first10 >= 0.30` and says whether it got it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moe_rl.cli import cpu_environment, run_guarded, setup_logging

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
BASE = Path(__file__).resolve().parent / "assets" / "tiny_base"
TARGET_GAIN = 0.30


def main(argv: list[str] | None = None) -> int:
    cpu_environment()
    setup_logging(0)
    # Each `make demo` starts over: the previous demo run is moved aside, never deleted.
    overrides = ["run.name=demo", "run.output_dir=runs", f"run.init_checkpoint={BASE}", "run.overwrite=true",
                 *(argv if argv is not None else sys.argv[1:])]
    return run_guarded("demo", lambda: _run(overrides))


def _run(overrides: list[str]) -> int:
    from moe_rl.config import load_config
    from moe_rl.trainer import Trainer

    cfg = load_config(RECIPE, overrides)
    summary = Trainer(cfg).fit()
    gain = summary["reward_last10"] - summary["reward_first10"]
    print(json.dumps({k: v for k, v in summary.items() if k != "median_timings"}, indent=2))
    print(f"\nsummary:     {cfg.run_dir / 'summary.json'}")
    print(f"tensorboard: tensorboard --logdir {cfg.run_dir / 'tb'}")
    print(f"reward {summary['reward_first10']:.3f} -> {summary['reward_last10']:.3f} "
          f"(gain {gain:+.3f}; target {TARGET_GAIN:+.2f}: {'met' if gain >= TARGET_GAIN else 'NOT met'}) "
          f"in {summary['wall_seconds']:.0f}s, median step {summary['median_step_seconds']:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
