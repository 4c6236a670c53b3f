"""One step's rollout: prompts -> sampler engines -> rewards -> advantages -> each rank's rows.

    from moe_rl.rollout import RolloutCollector, Rollout

Modules: `types` (ScoredGroup, GroupSummary, RowSample, Rollout), `collector`
(RolloutCollector: problems, sampling, rewards, dynamic sampling, rows to their ranks),
`packing` (reward shaping, group advantages, statistics, a rank's rows as a `StepBatch`),
`placement` (where the engines sit, the collectives between ranks), `sampler_start` (the
sampler's starting weights and engine), `learning_signal` (the no-signal warning). The RL
program sequences a collector with the learner and hands it the weight transport
(`moe_rl.weights`); nothing here imports megatron or knows a program.
"""

from moe_rl.rollout.collector import RolloutCollector
from moe_rl.rollout.types import GroupSummary, Rollout, RowSample, Sampled, ScoredGroup

__all__ = ["GroupSummary", "Rollout", "RolloutCollector", "RowSample", "Sampled", "ScoredGroup"]
