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

from moe_rl.cli import cpu_environment, setup_logging

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
BASE = Path(__file__).resolve().parent / "assets" / "tiny_base"
TARGET_GAIN = 0.30


def main(argv: list[str] | None = None) -> int:
    cpu_environment()
    setup_logging(0)
    from moe_rl.config import ConfigError, load_config
    from moe_rl.trainer import Trainer

    overrides = ["run.name=demo", "run.output_dir=runs", f"run.init_checkpoint={BASE}", *(argv or sys.argv[1:])]
    try:
        cfg = load_config(RECIPE, overrides)
        trainer = Trainer(cfg)
    except ConfigError as e:
        print(f"demo: config error: {e}", file=sys.stderr)
        return 2
    summary = trainer.fit()
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
