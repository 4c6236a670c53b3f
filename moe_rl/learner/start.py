"""A learner's starting weights: a moe_rl checkpoint or a Hugging Face directory, model only."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moe_rl.config import ConfigError
from moe_rl.learner.checkpoint import (
    is_checkpoint,
    load_checkpoint,
    load_saved_component,
    read_meta,
)
from moe_rl.learner.critic import VALUE_HEAD_KEYS
from moe_rl.learner.hf_import import load_hf_weights

if TYPE_CHECKING:
    from moe_rl.learner.critic import ValueModel
    from moe_rl.learner.engine import Learner


def load_start(learner: Learner, path: str, trust: bool, optional: tuple[str, ...] = (),
               key: str = "run.init_checkpoint") -> None:
    """Collective. Load `path`'s model weights into `learner` and reset its step to 0
    (`optional`: parameter-name prefixes the weights may lack, which keep their initial
    values, as do LoRA adapters the weights lack; `key`: the recipe key that named `path`,
    for the error). Weights only: no
    optimizer state and no RNG state (the run's seed, not the checkpoint's, decides what
    comes next; a run with two starting checkpoints, PPO's actor and critic, would otherwise
    end up with the second one's)."""
    p = Path(path)
    if is_checkpoint(p):
        load_checkpoint(learner, p, load_optimizer=False, trust=trust, optional=optional, restore_rng=False,
                        adapters_optional=True)
    elif (p / "config.json").is_file():
        load_hf_weights(learner, p, optional=optional)
        learner.base_origin = str(p.resolve())
    else:
        raise ConfigError(f"{key}={path} is neither a moe_rl checkpoint nor a Hugging Face directory")
    learner.step = 0


def load_critic_start(critic: ValueModel, path: str, trust: bool, key: str = "critic.init_checkpoint") -> None:
    """Collective. PPO's starting critic: from a PPO run's checkpoint, the critic saved in it
    (transformer and value head: a value-pretraining run's product); from any other weights
    (a policy, a reward model, a Hugging Face directory), their transformer, with the value
    head at zero. Weights only, step 0."""
    p = Path(path)
    if is_checkpoint(p) and "critic" in read_meta(p):
        load_saved_component(critic, p, "critic", trust=trust)
    else:
        load_start(critic, path, trust, optional=(VALUE_HEAD_KEYS,), key=key)
        critic.init_value_head(0.0, seed=0)
