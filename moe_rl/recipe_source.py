"""A recipe completed by its starting checkpoint: the model section from a Hugging Face
directory's config.json, and the tokenizer made concrete.

    cfg = load_resolved(path, overrides)   # every CLI (moe_rl.cli): load -> model from config.json -> validate

This module holds the pieces, each on the section it completes (`resolved_model`,
`resolved_tokenizer`); the entry points' `moe_rl.cli.resolve_recipe` puts them together.

The order matters: the recipe's own model section (the tiny default) is replaced by
config.json before any model or parallel check runs, so `expert_model_parallel_size=3` is
checked against the checkpoint's 12 experts, not the default's 8.

`run.init_checkpoint=<HF dir>` is enough to train a supported architecture
(`moe_rl.convert.layouts`: Qwen3-MoE, Glm4-MoE, DeepseekV3 / Kimi-K2): every config.json field that changes the
math is mapped (`model_config_from_hf`), a field the learner cannot honour is an error
naming it, and so is an unsupported architecture. Training settings config.json does not
describe (layer spec, fp8, aux-loss coefficients, dispatcher) stay the recipe's. A model key
the recipe *sets* must agree with config.json, except `model.params_dtype`, which follows
config.json's dtype unless the recipe overrides it; the error names the program's Hugging
Face recipe to start from instead (`hf_recipe`: no model section). `task.tokenizer` becomes
"shipped" or a path, so checkpoints record which tokenizer their ids belong to.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from moe_rl.config import ConfigError, ModelConfig

OVERRIDABLE = frozenset({"params_dtype"})
"""Model keys a recipe may set differently from config.json (a training choice)."""
HF_RECIPES = {"moe_rl.sft": "examples/hf_sft.yaml", "moe_rl.dpo": "examples/hf_dpo.yaml",
              "moe_rl.reward_model": "examples/hf_rm.yaml"}
"""Each program's recipe for a Hugging Face directory (no model section); moe_rl.train's
depends on the advantage (`hf_recipe`)."""


def hf_recipe(program: str, uses_critic: bool) -> str:
    """The Hugging Face recipe of `program` (`moe_rl.dpo`, ...) for a recipe whose advantage
    does (not) need a critic (rl.uses_critic); "" when the program has none."""
    if program == "moe_rl.train":
        return "examples/hf_ppo.yaml" if uses_critic else "examples/hf_rspo.yaml"
    return HF_RECIPES.get(program, "")


def read_config_json(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return data


def model_from_checkpoint(model: ModelConfig, directory: Path, given: frozenset[str],
                          start_from: str = "") -> ModelConfig:
    """The model section derived from `directory`/config.json, `model` (the recipe's, whose
    keys the recipe set are `given`) keeping its training settings (`start_from`: the recipe
    a conflict's error suggests)."""
    from moe_rl.convert import ConvertError, model_config_from_hf

    hf = read_config_json(directory)
    try:
        derived = model_config_from_hf(hf, base=model)
    except (ConvertError, NotImplementedError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"run.init_checkpoint={directory}: {' '.join(str(e).split())}") from None
    conflicts: list[str] = []
    keep: dict[str, Any] = {}
    for key in sorted(k.split(".", 1)[1] for k in given if k.startswith("model.")):
        mine, theirs = getattr(model, key, None), getattr(derived, key, None)
        if key in OVERRIDABLE:
            keep[key] = mine
        elif mine != theirs:
            conflicts.append(f"model.{key}={mine!r} (config.json gives {theirs!r})")
    if conflicts:
        instead = f", or start from {start_from}, which has no model section" if start_from else ""
        raise ConfigError(f"the recipe disagrees with run.init_checkpoint={directory}/config.json: "
                          f"{'; '.join(conflicts[:4])}; remove these keys (the checkpoint defines the model)"
                          f"{instead}")
    return dataclasses.replace(derived, **keep)


def resolved_model(model: ModelConfig, init_checkpoint: str, given: frozenset[str], start_from: str = "") -> ModelConfig:
    """The model section a run starts with: config.json's when run.init_checkpoint is a
    Hugging Face directory (`model_from_checkpoint`), else the recipe's own."""
    if init_checkpoint and (Path(init_checkpoint) / "config.json").is_file():
        return model_from_checkpoint(model, Path(init_checkpoint), given, start_from)
    return model


def resolved_tokenizer(tokenizer: str, init_checkpoint: str) -> str:
    """task.tokenizer made concrete: "shipped" or an absolute path (the checkpoint's own
    tokenizer for "auto"), so checkpoints record which tokenizer their ids belong to."""
    from moe_rl.tokenization import resolve_spec

    try:
        spec = resolve_spec(tokenizer, init_checkpoint or None)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return spec if spec == "shipped" else str(Path(spec).resolve())
