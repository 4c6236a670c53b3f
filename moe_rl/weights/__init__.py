"""Weight transport from the learner to the engines: the one place that sees both sides
(the learner's full-tensor stream and the sampler's loading), above `moe_rl.learner`,
`moe_rl.sampler` and `moe_rl.rollout`, which know nothing of each other's weights.

    sync = make_weight_synchronizer(placement, bucket_mib=cfg.sampler.weight_sync_bucket_mib)  # collective
    make_sync = partial(make_weight_synchronizer, bucket_mib=cfg.sampler.weight_sync_bucket_mib)
    collector = RolloutCollector(..., make_sync=make_sync)   # what the RL program does (every rank, once)
    metrics = sync.push(learner, version)               # every learner rank, after an update

`sync`: colocated streaming or broadcast to separate engine ranks (`moe_rl.weights.sync`).
"""

from moe_rl.weights.sync import WeightSynchronizer, make_weight_synchronizer

__all__ = ["WeightSynchronizer", "make_weight_synchronizer"]
