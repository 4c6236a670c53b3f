"""One step's rollout: prompts -> sampler engines -> rewards -> advantages -> batch.

    from moe_rl.rollout import RolloutCollector, Rollout

Modules: `types` (ScoredGroup, Rollout), `collector` (RolloutCollector: problems, sampling,
rewards, dynamic sampling), `packing` (reward shaping, group advantages, token packing,
statistics), `sampler_start` (the sampler's starting weights and engine). The trainer only
sequences a collector with the learner; nothing here imports megatron.
"""

from moe_rl.rollout.collector import RolloutCollector
from moe_rl.rollout.packing import pack_rollout
from moe_rl.rollout.types import Rollout, ScoredGroup

__all__ = ["Rollout", "RolloutCollector", "ScoredGroup", "pack_rollout"]
