"""Recipes in and out: reading YAML files, dotted overrides, building a Config, saving.

Loading and validating are two steps, because a recipe's model may come from elsewhere:

    cfg, given = load_recipe(path, overrides)   # typed and strict, not yet validated
    cfg = resolve_recipe(cfg, given)            # moe_rl.cli: config.json, then validate

`load_config` does both steps for a config that is already complete (a run's config.yaml,
a recipe with the project's own model). Every key is checked: an unknown key or a value of
the wrong type is a `ConfigError` naming the key, raised before any process group exists.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from moe_rl.config.coerce import MOVED_KEYS, MOVED_WITH_VALUE, build_section, to_plain
from moe_rl.config.errors import ConfigError
from moe_rl.config.sections import Config
from moe_rl.config.shipped import resolve_shipped_paths
from moe_rl.config.validate import validate
from moe_rl.config.yaml_text import yaml_load, yaml_value
from moe_rl.runtime.atomic import atomic_write_text

__all__ = ["apply_overrides", "build_config", "config_from_dict", "load_config", "load_recipe", "load_saved_config",
           "parse_overrides",
           "read_recipe_file", "save_config", "to_dict", "yaml_load"]


def parse_overrides(overrides: list[str]) -> list[tuple[list[str], Any]]:
    """`["rl.objective=gspo", "run.steps=5"]` -> [(["rl", "objective"], "gspo"), ...];
    values are parsed as YAML scalars / flow collections."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        path = [p for p in key.strip().split(".")]
        if not key.strip() or any(not p for p in path):
            raise ConfigError(f"override {item!r} has an empty key")
        parsed.append((path, yaml_value(raw, f"override {item!r}") if raw != "" else ""))
    return parsed


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted path in (a copy of) the recipe data. The last key's value is replaced
    whole, so `rl.objective_args.rspo={gamma_min: 0.2}` replaces rspo's block while
    `rl.objective_args.rspo.gamma_min=0.2` changes one entry of it."""
    out = copy.deepcopy(data)
    for path, value in parse_overrides(overrides):
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.setdefault(part, {})
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[: i + 1])} is not a section")
            node = nxt
        node[path[-1]] = value
    return out


def _recipes_in(directory: Path) -> str:
    found = sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    return f"recipes in it: {', '.join(str(p) for p in found)}" if found else "it holds no .yaml recipe"


def read_recipe_file(path: str | os.PathLike) -> dict[str, Any]:
    """The plain data of a YAML recipe; every way the file can be wrong is one ConfigError
    naming it (and for a syntax error, the line and column)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"recipe {p} is a directory, not a YAML file; {_recipes_in(p)}")
    if not p.is_file():
        raise ConfigError(f"recipe {p} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"recipe {p} is not UTF-8 text (is it a YAML recipe?)") from None
    except OSError as e:
        raise ConfigError(f"recipe {p} cannot be read: {e.strerror or e}") from None
    data = yaml_load(text, str(p)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {p}: top level must be a mapping of sections (model:, rl:, run:, ...)")
    return data


def build_config(data: dict[str, Any]) -> Config:
    """A typed Config from plain data (unknown keys and wrong types refused), with shipped
    asset paths resolved; not validated (see the module doc)."""
    return resolve_shipped_paths(build_section(Config, data or {}, ""))


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from plain data (what YAML gives)."""
    cfg = build_config(data)
    validate(cfg)
    return cfg


def load_recipe(path: str | os.PathLike | None, overrides: list[str] | None = None) -> tuple[Config, frozenset[str]]:
    """The recipe (defaults when `path` is None) with `a.b=c` overrides, typed but NOT
    validated, and the dotted keys the recipe and the overrides set (what a user asked for,
    as opposed to defaults: a checkpoint's config.json must agree with them). Validate with
    `moe_rl.cli.resolve_recipe`, which first takes the model from config.json."""
    data = read_recipe_file(path) if path is not None else {}
    data = apply_overrides(data, overrides or [])
    return build_config(data), frozenset(_dotted_keys(data))


def _dotted_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for k, v in data.items():
        if isinstance(v, dict):
            keys += _dotted_keys(v, f"{prefix}{k}.")
        else:
            keys.append(f"{prefix}{k}")
    return keys


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Load and validate a complete config: a run's config.yaml, or a recipe whose model
    section is its own (an entry point resolves `run.init_checkpoint` first, module doc)."""
    cfg = load_recipe(path, overrides)[0]
    validate(cfg)
    return cfg


def load_saved_config(path: str | os.PathLike) -> Config:
    """A config.yaml that a run or a checkpoint saved, possibly by an older version: keys
    that have since moved (`coerce.MOVED_KEYS`) are dropped, not refused (their new place
    holds the run's own value already), and the rest is loaded and validated strictly."""
    data = read_recipe_file(path)
    for old, new in MOVED_KEYS.items():
        section, key = old.split(".", 1)
        if not isinstance(data.get(section), dict) or key not in data[section]:
            continue
        value = data[section].pop(key)
        if old in MOVED_WITH_VALUE:
            *parents, leaf = new.split(".")
            place = data
            for name in parents:
                place = place.setdefault(name, {})
            place.setdefault(leaf, value)
    cfg = build_config(data)
    validate(cfg)
    return cfg


def to_dict(cfg: Any) -> Any:
    """Plain data (what YAML holds) of a config or any of its sections."""
    return to_plain(cfg)


def save_config(cfg: Config | Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write the resolved config (or its plain data, `to_dict`) as YAML, atomically (temp
    file in the same dir, rename)."""
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
