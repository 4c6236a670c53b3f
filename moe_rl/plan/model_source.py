"""Where the planned model comes from: the recipe's `model` section, or the config.json of
`run.init_checkpoint` (a directory holding only config.json is enough).

The Hugging Face mapping is the converter's (`moe_rl.convert.model_config_from_hf`) in its
planning mode: settings the learner cannot honour but that change no parameter's shape
(GLM-4.5's partial rotary, multi-token-prediction layers, routed scaling) become notes in
the report instead of errors, so a published config.json plans as it is. Training settings
that config.json does not describe (layer spec, fp8, dispatcher) stay the recipe's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from moe_rl.config import Config, ConfigError, validate
from moe_rl.convert import ConvertError, model_config_from_hf
from moe_rl.recipe_source import read_config_json


@dataclass(frozen=True)
class ModelSource:
    """The recipe with its model resolved, and where the model came from."""

    cfg: Config
    source: str
    """'recipe' or the config.json path."""
    notes: tuple[str, ...]
    """What the plan assumes that the checkpoint's config.json says otherwise."""


def resolve_model(cfg: Config) -> ModelSource:
    """The recipe (as `load_recipe` gives it) with `model` taken from `run.init_checkpoint`'s
    config.json when there is one, then validated: the model and layout checks see the
    checkpoint's model, not the recipe's default. A checkpoint path that does not exist here
    (a cluster path) leaves the recipe's model, with a note; a megatron checkpoint is
    planned from the recipe's model section."""
    init = cfg.run.init_checkpoint
    if not init:
        validate(cfg)
        return ModelSource(cfg, "recipe", ())
    path = Path(init) / "config.json"
    if not path.is_file():
        why = "does not exist here" if not Path(init).exists() else "has no config.json"
        validate(cfg)
        return ModelSource(cfg, "recipe", (f"run.init_checkpoint={init} {why}: the recipe's model section is planned",))
    notes: list[str] = []
    try:
        model = model_config_from_hf(read_config_json(path.parent), base=cfg.model, notes=notes)
    except (ConvertError, NotImplementedError) as e:
        raise ConfigError(f"{path}: {e}") from None
    resolved = dataclasses.replace(cfg, model=model)
    validate(resolved)
    return ModelSource(resolved, str(path), tuple(notes))
