"""Recipes in and out: strict YAML loading, typed coercion, dotted overrides, saving.

Every key is checked: an unknown key or a value of the wrong type is a `ConfigError` that
names the key and lists the valid ones, raised before any process group or model exists.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from moe_rl.atomic import atomic_write_text
from moe_rl.config.errors import ConfigError
from moe_rl.config.rl import ObjectiveArgs
from moe_rl.config.sections import Config


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads `1e-5` as a float. YAML 1.1 (PyYAML) wants a dot in the
    mantissa (`1.0e-5`) and would otherwise hand a learning rate over as a string."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)


def type_name(hint: Any) -> str:
    """A readable name of a field annotation (for errors and --help-config)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(hint))
    if origin is dict or hint is ObjectiveArgs:
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def _coerce_union(value: Any, hint: Any, key: str) -> Any:
    args = typing.get_args(hint)
    if value is None and type(None) in args:
        return None
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce(value, arg, key)
        except ConfigError:
            continue
    raise ConfigError(f"{key}: {value!r} does not fit {type_name(hint)}")


def _coerce_scalar(value: Any, hint: type, key: str) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {hint!r} at {key}")


def coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against the annotation `hint`; ints are accepted for floats."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, hint, key)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if hint is ObjectiveArgs:
        return ObjectiveArgs(value, key)
    return _coerce_scalar(value, hint, key)


def build_section(cls: type, data: Any, prefix: str, what: str | None = None) -> Any:
    """`cls(**data)` for a config dataclass, strictly: unknown keys, wrong types and the
    dataclass's own checks (`__post_init__` ValueErrors) become ConfigErrors naming the key.
    `prefix` is the dotted path with a trailing dot; `what` names the owner in messages."""
    where = prefix.rstrip(".") or "top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        owner = f"for {what}" if what else f"in {where}"
        raise ConfigError(f"unknown key {prefix}{unknown[0]!s} {owner}; valid keys: {', '.join(names) or '(none)'}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = build_section(hint, value if value is not None else {}, f"{prefix}{name}.")
        else:
            kwargs[name] = coerce(value, hint, f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:  # a hyperparameter dataclass's own range checks
        raise ConfigError(f"{where}: {e}") from None


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
        parsed.append((path, yaml_load(raw) if raw != "" else ""))
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


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from plain data (what YAML gives)."""
    from moe_rl.config.validate import validate

    cfg = build_section(Config, data or {}, "")
    validate(cfg)
    return cfg


def load_recipe(path: str | os.PathLike | None, overrides: list[str] | None = None) -> tuple[Config, frozenset[str]]:
    """`load_config`, plus the dotted keys the recipe and the overrides set (what a user
    asked for, as opposed to defaults: a checkpoint's config.json must agree with them)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe {p} does not exist")
        with open(p) as f:
            data = yaml_load(f.read()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"recipe {p}: top level must be a mapping of sections")
    data = apply_overrides(data, overrides or [])
    return config_from_dict(data), frozenset(_dotted_keys(data))


def _dotted_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for k, v in data.items():
        if isinstance(v, dict) and k != "objective_args":
            keys += _dotted_keys(v, f"{prefix}{k}.")
        else:
            keys.append(f"{prefix}{k}")
    return keys


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML recipe (or defaults when `path` is None) and apply `a.b=c` overrides."""
    return load_recipe(path, overrides)[0]


def to_dict(cfg: Any) -> Any:
    """Plain data (what YAML holds) of a config or any of its sections."""
    if isinstance(cfg, ObjectiveArgs):
        return cfg.to_dict()
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    return copy.deepcopy(cfg)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML, atomically (temp file in the same dir, rename)."""
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
