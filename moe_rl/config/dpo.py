"""The `dpo` section: Direct Preference Optimisation (`python -m moe_rl.dpo`), and its checks.

The run length, seed, checkpoints and resume are the `run` section's (`run.steps`,
`run.save_every`, `run.resume`, ...); the preference files are `task.data_path` and
`task.eval_data_path`; `run.init_checkpoint` is both the starting policy and the frozen
reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from moe_rl.config.errors import ConfigError


@dataclass(frozen=True)
class DPOConfig:
    """Preference tuning against a frozen reference (the starting checkpoint)."""

    beta: float = 0.1
    """Strength of the implicit KL to the reference: the implicit reward of a response is
    beta * (log pi(y|x) - log pi_ref(y|x)), sequence log-probs summed over response tokens."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO's -log sigmoid(beta * h) (Rafailov et al. 2023, eq. 7). ipo:
    (h - 1/(2 beta))^2 (Azar et al. 2023, eq. 17). h is the log-ratio margin
    (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))."""
    label_smoothing: float = 0.0
    """Conservative DPO (sigmoid only): the probability that a pair's labels are flipped;
    the loss becomes -(1-eps) log sigmoid(beta h) - eps log sigmoid(-beta h). In [0, 0.5)."""
    batch_size: int = 32
    """Preference pairs per optimizer step (2x as many sequences go through the model)."""
    eval_max_pairs: int = 0
    """Evaluate on the first N held-out pairs (0: all of them)."""


    def validate(self) -> None:
        """The section's ranges (checked for every recipe; only moe_rl.dpo reads it)."""
        d = self
        if d.beta <= 0:
            raise ConfigError(f"dpo.beta must be > 0, got {d.beta}")
        if not 0 <= d.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5), got {d.label_smoothing}")
        if d.loss == "ipo" and d.label_smoothing:
            raise ConfigError(f"dpo.label_smoothing={d.label_smoothing} applies to dpo.loss=sigmoid only "
                              "(conservative DPO); set it to 0 with dpo.loss=ipo")
        validate_pair_batches("dpo", d)


def validate_pair_batches(name: str, section: Any) -> None:
    """batch_size and eval_max_pairs of a preference program's section `name`."""
    if section.batch_size < 1:
        raise ConfigError(f"{name}.batch_size must be >= 1, got {section.batch_size}")
    if section.eval_max_pairs < 0:
        raise ConfigError(f"{name}.eval_max_pairs must be >= 0 (0: all), got {section.eval_max_pairs}")
