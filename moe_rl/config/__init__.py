"""Run configuration: frozen dataclasses, strict YAML loading, dotted overrides.

A recipe is a YAML file whose top-level sections match `Config`'s fields. Every key is
checked: an unknown key or a value of the wrong type is a `ConfigError` that names the key
and lists the valid ones, raised before any process group or model exists.

    cfg = load_config("examples/tiny_rspo.yaml", ["rl.objective=gspo", "run.steps=20"])
    save_config(cfg, "runs/x/config.yaml")     # atomic; what `resume` reads back

Modules: `model` (the architecture section), `rl` (the objective section, with each
objective's hyperparameters typed), `sections` (the other sections and `Config`), `loading`
(YAML, coercion, overrides, saving), `validate` (per-section checks and the layout check),
`docs` (attribute docstrings and `--help-config`).
"""

from moe_rl.config.docs import describe, field_docs
from moe_rl.config.errors import ConfigError
from moe_rl.config.loading import (
    apply_overrides,
    config_from_dict,
    load_config,
    load_recipe,
    parse_overrides,
    save_config,
    to_dict,
)
from moe_rl.config.model import ModelConfig
from moe_rl.config.rl import ObjectiveArgs, RLConfig
from moe_rl.config.sections import (
    Config,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    SamplerConfig,
    SFTConfig,
    TaskConfig,
)
from moe_rl.config.validate import learner_world_size, validate, validate_layout

__all__ = [
    "Config",
    "ConfigError",
    "LoggingConfig",
    "ModelConfig",
    "ObjectiveArgs",
    "OptimizerConfig",
    "ParallelConfig",
    "RLConfig",
    "RunConfig",
    "SFTConfig",
    "SamplerConfig",
    "TaskConfig",
    "apply_overrides",
    "config_from_dict",
    "describe",
    "field_docs",
    "learner_world_size",
    "load_config",
    "load_recipe",
    "parse_overrides",
    "save_config",
    "to_dict",
    "validate",
    "validate_layout",
]
