"""The RL program (the GRPO family and PPO): `python -m moe_rl.train`.

    summary = train(cfg)             # inside torchrun or a plain process

Every rank builds the rollout collector; the training ranks run `LearnerRole` (collect ->
score -> update -> sync), the engine-only ranks of a separate placement `EngineRole`, both
in the one run loop (`moe_rl.loop`); `LearnerRole.build` is the program's factory.
"""

from __future__ import annotations

from typing import Any

from moe_rl.config import Config


def train(cfg: Config) -> dict[str, Any]:
    """A whole RL run on this rank; rank 0 returns the summary (what `python -m moe_rl.train` calls)."""
    from moe_rl.cli import run_program
    from moe_rl.programs.rl.learner_role import LearnerRole

    return run_program(LearnerRole, cfg)
