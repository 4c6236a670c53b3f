"""RL training entry point, plain or under torchrun.

    python -m moe_rl.train --config examples/tiny_rspo.yaml [section.key=value ...]
    torchrun --nproc-per-node 2 -m moe_rl.train --config examples/tiny_rspo.yaml \\
        parallel.expert_model_parallel_size=2
    python -m moe_rl.train --help-config
    python -m moe_rl.train --check --nproc 8 --config RECIPE   # check only: one line, exit 0 or 2

A recipe that names an unknown key, a value of the wrong type or an impossible layout
fails here (exit status 2, the message names the key), before any process group, model or
sampler is built; under torchrun rank 0 prints it, once. `--check` runs every pre-flight
check for `--nproc` ranks and prints `recipe OK: <what would run>`. Every later error the
user can fix (task data, checkpoints, the run directory, a full disk) is one line too, with
exit status 2; `--debug` shows the traceback; `--verbose` shows third-party warnings.
"""

from __future__ import annotations

import json
from typing import Any

from moe_rl.cli import run_main

PROG = "python -m moe_rl.train"


def _report(summary: dict[str, Any]) -> None:
    """Rank 0 prints the run's summary."""
    print(json.dumps({k: v for k, v in summary.items() if k != "median_timings"}, indent=2))


def main(argv: list[str] | None = None) -> None:
    run_main(PROG, __doc__, argv, program=_program, report=_report)


def _program() -> type:
    from moe_rl.programs.rl.learner_role import LearnerRole

    return LearnerRole


if __name__ == "__main__":
    main()
