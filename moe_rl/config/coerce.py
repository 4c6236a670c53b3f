"""Plain data (what YAML gives) -> typed config values, strictly, for any config dataclass.

Field annotations drive the checks: bool / int / float / str, Literal choices, unions with
None, dicts, lists (`tuple[str, ...]`: a YAML list, kept as a tuple so sections stay
frozen), and nested config dataclasses. A type that needs its own parsing implements
the `ConfigValue` protocol (a `from_config` classmethod, `to_config`, and the named
sub-sections `--help-config` lists); the coercer calls it instead of knowing the type.

Unknown keys are ConfigErrors that suggest the nearest valid key (difflib), or list the
valid ones when none is near: `unknown key run.save_evry; did you mean run.save_every?`
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal, Protocol, runtime_checkable

from moe_rl.config.errors import ConfigError


@runtime_checkable
class ConfigValue(Protocol):
    """A config field type with its own parsing (rl.objective_args is one)."""

    @classmethod
    def from_config(cls, value: Any, key: str) -> Any:
        """Build from plain data; raise ConfigError naming `key` (a dotted path)."""

    def to_config(self) -> Any:
        """Plain data that `from_config` reads back to an equal value."""

    @classmethod
    def config_sections(cls) -> list[tuple[str, str, type]]:
        """(name, one-line heading, dataclass) of each sub-section, for `--help-config`."""


def is_config_value(hint: Any) -> bool:
    return isinstance(hint, type) and callable(getattr(hint, "from_config", None))


def type_name(hint: Any) -> str:
    """A readable name of a field annotation (for errors and --help-config)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(hint))
    if origin is dict or is_config_value(hint):
        return "mapping"
    if origin is tuple:
        return f"list of {type_name(typing.get_args(hint)[0])}"
    return getattr(hint, "__name__", str(hint))


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """`; did you mean <prefix><nearest>?` when a choice is close to `word`, else ''."""
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{near[0]}?" if near else ""


def choices_hint(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """`; did you mean <nearest>? valid: a, b` or `; valid: a, b` (for unknown names)."""
    valid = ", ".join(choices)
    near = did_you_mean(word, choices, prefix)
    return f"{near} valid: {valid}" if near else f"; valid: {valid}"


def key_text(name: str) -> str:
    """A key as a recipe wrote it, for a one-line message: quoted when it holds a newline or
    another unprintable character."""
    return name if name.isprintable() else repr(name)


MOVED_KEYS = {
    "sft.steps": "run.steps",
    "sft.eval_every": "run.eval_every",
    "dpo.eval_every": "run.eval_every",
    "rm.eval_every": "run.eval_every",
    "critic.lr": "critic.optimizer.lr",
    "critic.lr_warmup_steps": "critic.optimizer.lr_warmup_steps",
}
"""Keys that moved (old -> new): the run loop's settings live in `run` for every program, and
the critic's optimizer is a section of the actor's type."""
MOVED_WITH_VALUE = frozenset({"critic.lr", "critic.lr_warmup_steps"})
"""Moved keys whose value a saved config carries to the new place (the others' new place holds
the run's own value)."""


def unknown_key(prefix: str, key: str, valid: list[str], owner: str) -> ConfigError:
    """`unknown key a.b; did you mean a.c?`, or the valid keys when none is near; a key that
    moved names its new place."""
    if f"{prefix}{key}" in MOVED_KEYS:
        new = MOVED_KEYS[f"{prefix}{key}"]
        why = ("the critic's optimizer is a section of the optimizer's type" if new.startswith("critic.")
               else "the run loop's settings are in the run section for every program")
        return ConfigError(f"{prefix}{key} moved to {new} ({why}); write {new}: <value> in the recipe (nested) "
                           f"or {new}=<value> on the command line")
    hint = did_you_mean(key, valid, prefix)
    key = key_text(key)
    if hint:  # the dotted key says where; an owner that is not a section (an objective) is named
        return ConfigError(f"unknown key {prefix}{key}{'' if owner.startswith('in ') else ' ' + owner}{hint}")
    return ConfigError(f"unknown key {prefix}{key} {owner}; valid keys: {', '.join(valid) or '(none)'}")


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


def _coerce_list(value: Any, hint: Any, key: str) -> tuple[Any, ...]:
    """A YAML list for a `tuple[X, ...]` field, each item checked as an X."""
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{key}: expected a list, e.g. [a, b], got {type(value).__name__} {value!r}")
    item = typing.get_args(hint)[0]
    return tuple(coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value))


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
    if origin is tuple:
        return _coerce_list(value, hint, key)
    if is_config_value(hint):
        return hint.from_config(value, key)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build_section(hint, value if value is not None else {}, f"{key}.")
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
    unknown = [k for k in data if k not in names]
    if unknown:
        raise unknown_key(prefix, str(unknown[0]), names, f"for {what}" if what else f"in {where}")
    kwargs = {name: coerce(value, hints[name], f"{prefix}{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:  # a hyperparameter dataclass's own range checks
        raise ConfigError(f"{where}: {e}") from None


def to_plain(value: Any) -> Any:
    """Plain data (what YAML holds) of a config, any of its sections, or a field value."""
    if isinstance(value, ConfigValue) and not isinstance(value, type):
        return value.to_config()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    return value
