"""The `rm` section: a reward model trained on preference pairs (`python -m moe_rl.reward_model`).

The run length, seed, checkpoints and resume are the `run` section's; the preference files
are `task.data_path` and `task.eval_data_path` (the DPO trainer's format); the learning rate
and schedule are the `optimizer` section's; `run.init_checkpoint` is the starting
transformer (the value head starts small and random: `rm.head_init_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moe_rl.config.dpo import validate_pair_batches
from moe_rl.config.errors import ConfigError


@dataclass(frozen=True)
class RewardModelConfig:
    """A Bradley-Terry reward model: the value model's score of a chosen response should
    exceed its score of the rejected one."""

    compare: Literal["divergence", "last"] = "divergence"
    """Which scores a pair's loss compares. `last`: each response's score at its last
    token's slot (the state after the whole answer, before EOS: InstructGPT's sequence
    reward, except that it does not see whether the answer ended). `divergence`: every slot whose prefix holds the first token where the two
    responses differ, up to the shorter one's last slot (DeepSpeed-Chat's per-token loss;
    a pair that differs only in its last token falls back to `last`). The loss is the
    mean over those slots of -log sigmoid(r_chosen - r_rejected)."""
    batch_size: int = 32
    """Preference pairs per optimizer step (2x as many sequences go through the model)."""
    eval_max_pairs: int = 0
    """Evaluate on the first N held-out pairs (0: all of them)."""
    head_init_scale: float = 1.0
    """The value head's weights start as N(0, (scale / sqrt(model.hidden_size))^2), drawn from
    run.seed (nn.Linear's scale; DeepSpeed-Chat's and TRL's reward heads start random too),
    its bias at 0. 0: a zero head, so every score starts equal and the transformer gets no
    gradient until the head has moved, a flat start whose length varies run to run
    (docs/ppo_dpo.md)."""


    def validate(self) -> None:
        """The section's ranges (only moe_rl.reward_model reads it)."""
        validate_pair_batches("rm", self)
        if not self.head_init_scale >= 0:
            raise ConfigError(f"rm.head_init_scale must be >= 0 (0: a zero value head), got {self.head_init_scale}")
