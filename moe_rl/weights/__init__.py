"""Weight transport from the learner to the engines: the one place that sees both sides
(the learner's full-tensor stream and the sampler's loading), above `moe_rl.learner`,
`moe_rl.sampler` and `moe_rl.rollout`, which know nothing of each other's weights.

    sync = make_weight_synchronizer(cfg, placement)     # collective: every rank, once
    collector = RolloutCollector(cfg, make_sync=make_weight_synchronizer)   # what the RL program does
    metrics = sync.push(learner, version)               # every learner rank, after an update

`sync`: colocated streaming or broadcast to separate engine ranks (`moe_rl.weights.sync`).
"""

from moe_rl.weights.sync import WeightSynchronizer, make_weight_synchronizer

__all__ = ["WeightSynchronizer", "make_weight_synchronizer"]
