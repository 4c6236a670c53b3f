"""RL training entry point, plain or under torchrun.

    python -m moe_rl.train --config examples/tiny_rspo.yaml [section.key=value ...]
    torchrun --nproc-per-node 2 -m moe_rl.train --config examples/tiny_rspo.yaml \\
        parallel.expert_model_parallel_size=2
    python -m moe_rl.train --help-config

A recipe that names an unknown key, a value of the wrong type or an impossible layout
fails here (exit status 2, the message names the key), before any process group, model or
sampler is built.
"""

from __future__ import annotations

import json
import os
import sys

from moe_rl.cli import cpu_environment, parse, setup_logging


def main(argv: list[str] | None = None) -> None:
    cpu_environment()
    _, cfg = parse(argv, "python -m moe_rl.train", __doc__)
    from moe_rl.config import ConfigError
    from moe_rl.trainer import Trainer

    setup_logging(int(os.environ.get("RANK", "0")))
    try:
        trainer = Trainer(cfg)
    except ConfigError as e:
        print(f"python -m moe_rl.train: config error: {e}", file=sys.stderr)
        sys.exit(2)
    summary = trainer.fit()
    if summary:
        print(json.dumps({k: v for k, v in summary.items() if k != "median_timings"}, indent=2))


if __name__ == "__main__":
    main()
