"""Where the planned model comes from: the recipe's `model` section, or the config.json of
`run.init_checkpoint` (a directory holding only config.json is enough).

The Hugging Face mapping is the converter's (`moe_rl.convert.model_config_from_hf`) in its
planning mode: settings the learner cannot honour but that change no parameter's shape
(GLM-4.5's partial rotary, multi-token-prediction layers, routed scaling) become notes in
the report instead of errors, so a published config.json plans as it is. Training settings
that config.json does not describe (layer spec, fp8, dispatcher) stay the recipe's.
`moe_rl.plan.planner.resolve_model` puts the model into the recipe and validates it.
"""

from __future__ import annotations

from pathlib import Path

from moe_rl.config import ConfigError, ModelConfig
from moe_rl.convert import ConvertError, model_config_from_hf
from moe_rl.recipe_source import read_config_json


def planned_model(model: ModelConfig, init_checkpoint: str) -> tuple[ModelConfig, str, tuple[str, ...]]:
    """(the model to plan, where it came from, notes): the recipe's `model` section, or the
    config.json of `init_checkpoint` (run.init_checkpoint) over it, with 'recipe' or the
    config.json path and what the plan assumes that the checkpoint's config.json says
    otherwise. A checkpoint path that does not exist here (a cluster path) leaves the
    recipe's model, with a note; a megatron checkpoint is planned from the recipe's model."""
    if not init_checkpoint:
        return model, "recipe", ()
    path = Path(init_checkpoint) / "config.json"
    if not path.is_file():
        why = "does not exist here" if not Path(init_checkpoint).exists() else "has no config.json"
        return model, "recipe", (f"run.init_checkpoint={init_checkpoint} {why}: the recipe's model section is planned",)
    notes: list[str] = []
    try:
        resolved = model_config_from_hf(read_config_json(path.parent), base=model, notes=notes)
    except (ConvertError, NotImplementedError) as e:
        raise ConfigError(f"{path}: {e}") from None
    return resolved, str(path), tuple(notes)
