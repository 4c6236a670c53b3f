"""The RL program (the GRPO family and PPO): `python -m moe_rl.train`.

    summary = train(cfg)             # inside torchrun or a plain process

Every rank builds the rollout collector; the training ranks run `LearnerRole` (collect ->
score -> update -> sync), the engine-only ranks of a separate placement `EngineRole`, both
in the one run loop (`moe_rl.loop`).
"""

from __future__ import annotations

import os
from typing import Any

from moe_rl.config import Config
from moe_rl.loop import Program, RunLoop


def rl_program(cfg: Config) -> Program:
    """This rank's role in an RL run, after every input check (once, against torchrun's
    WORLD_SIZE, before anything is built)."""
    from moe_rl.learner import init_distributed
    from moe_rl.programs.rl.engine_role import EngineRole
    from moe_rl.programs.rl.learner_role import LearnerRole
    from moe_rl.rollout import RolloutCollector
    from moe_rl.weights import make_weight_synchronizer

    LearnerRole.check(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    separate = cfg.sampler.placement == "separate"
    rank, world = init_distributed(cfg.parallel.distributed_backend,
                                   engine_ranks=cfg.sampler.engine_ranks if separate else 0)
    collector = RolloutCollector(cfg, make_weight_synchronizer)
    role = LearnerRole if collector.placement.trains else EngineRole
    return role(cfg, collector, rank, world)


def train(cfg: Config) -> dict[str, Any]:
    """A whole RL run on this rank; rank 0 returns the summary (what `python -m moe_rl.train` calls)."""
    from moe_rl.cli import compile_off_without_gpu

    compile_off_without_gpu()
    return RunLoop(cfg, rl_program(cfg)).run()
