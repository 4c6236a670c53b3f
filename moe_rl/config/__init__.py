"""Run configuration: frozen dataclasses, strict YAML loading, dotted overrides.

A recipe is a YAML file whose top-level sections match `Config`'s fields. Every key is
checked: an unknown key or a value of the wrong type is a `ConfigError` that names the key
and suggests the nearest valid one, raised before any process group or model exists.

    cfg = load_config("examples/tiny_rspo.yaml", ["rl.objective=gspo", "run.steps=20"])
    save_config(cfg, "runs/x/config.yaml")     # atomic; what `resume` reads back

The package is a leaf: it imports nothing of moe_rl but the leaf utilities `atomic` and
`registry`. The objectives register their hyperparameter types into it
(`register_objective_hparams`, called when `moe_rl.objectives` is imported, which
`import moe_rl` does).

Modules: `errors`, `coerce` (plain data -> typed values, the ConfigValue protocol,
did-you-mean), `yaml_text` (YAML with file:line:col errors), `objective_hparams` (the
registry), `model` / `rl` / `task` / `sections` (the sections and `Config`), `shipped` (paths to
assets inside the installed package), `validate` (per-section checks and the layout check),
`loading` (recipes in and out), `docs` (attribute docstrings and `--help-config`).
"""

from moe_rl.config.critic import CriticConfig
from moe_rl.config.docs import describe, field_docs
from moe_rl.config.dpo import DPOConfig
from moe_rl.config.errors import ConfigError
from moe_rl.config.loading import (
    apply_overrides,
    build_config,
    config_from_dict,
    load_config,
    load_recipe,
    load_saved_config,
    parse_overrides,
    read_recipe_file,
    save_config,
    to_dict,
)
from moe_rl.config.model import ModelConfig
from moe_rl.config.objective_hparams import OBJECTIVE_HPARAMS, register_objective_hparams
from moe_rl.config.reward_model import RewardModelConfig
from moe_rl.config.rl import CorrectionHParams, ObjectiveArgs, RLConfig
from moe_rl.config.sections import (
    Config,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    SamplerConfig,
    SFTConfig,
)
from moe_rl.config.task import TaskConfig
from moe_rl.config.validate import (
    learner_world_size,
    validate,
    validate_layout,
    validate_minibatches,
)

__all__ = [
    "OBJECTIVE_HPARAMS",
    "Config",
    "ConfigError",
    "CorrectionHParams",
    "CriticConfig",
    "DPOConfig",
    "LoggingConfig",
    "ModelConfig",
    "ObjectiveArgs",
    "OptimizerConfig",
    "ParallelConfig",
    "RLConfig",
    "RewardModelConfig",
    "RunConfig",
    "SFTConfig",
    "SamplerConfig",
    "TaskConfig",
    "apply_overrides",
    "build_config",
    "config_from_dict",
    "describe",
    "field_docs",
    "learner_world_size",
    "load_config",
    "load_recipe",
    "load_saved_config",
    "parse_overrides",
    "read_recipe_file",
    "register_objective_hparams",
    "save_config",
    "to_dict",
    "validate",
    "validate_layout",
    "validate_minibatches",
]
