"""The megatron-core learner: the only package of moe_rl that imports megatron.core.

    from moe_rl.learner import Learner, init_distributed, parallel_layout
"""

from moe_rl.learner.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from moe_rl.learner.engine import Learner
from moe_rl.learner.microbatch import (
    BatchTotals,
    LossFn,
    MicroBatch,
    MicroBatchLoss,
    ScoreResult,
    UpdateResult,
)
from moe_rl.learner.parallel import Layout, init_distributed, parallel_layout
from moe_rl.learner.routing import RoutingPlan
from moe_rl.learner.start import load_start

__all__ = [
    "BatchTotals",
    "CheckpointError",
    "Layout",
    "Learner",
    "LossFn",
    "MicroBatch",
    "MicroBatchLoss",
    "RoutingPlan",
    "ScoreResult",
    "UpdateResult",
    "init_distributed",
    "latest_checkpoint",
    "load_checkpoint",
    "load_start",
    "parallel_layout",
    "read_meta",
    "save_checkpoint",
]
