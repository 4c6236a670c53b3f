"""A learner's starting weights: a moe_rl checkpoint or a Hugging Face directory, model only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_rl.config import ConfigError
from moe_rl.learner.checkpoint import is_checkpoint, load_checkpoint
from moe_rl.learner.hf_import import load_hf_weights


def load_start(learner: Any, path: str, trust: bool, optional: tuple[str, ...] = (),
               key: str = "run.init_checkpoint") -> None:
    """Collective. Load `path`'s model weights into `learner` and reset its step to 0
    (`optional`: parameter-name prefixes the weights may lack, which keep their initial
    values; `key`: the recipe key that named `path`, for the error). Weights only: no
    optimizer state and no RNG state (the run's seed, not the checkpoint's, decides what
    comes next; a run with two starting checkpoints, PPO's actor and critic, would otherwise
    end up with the second one's)."""
    p = Path(path)
    if is_checkpoint(p):
        load_checkpoint(learner, p, load_optimizer=False, trust=trust, optional=optional, restore_rng=False)
    elif (p / "config.json").is_file():
        load_hf_weights(learner, p, optional=optional)
    else:
        raise ConfigError(f"{key}={path} is neither a moe_rl checkpoint nor a Hugging Face directory")
    learner.step = 0
