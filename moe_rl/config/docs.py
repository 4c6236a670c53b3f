"""Attribute docstrings of config dataclasses, and `--help-config`.

Each field carries an attribute docstring (the string literal under it); `describe()`
renders them with types and defaults, one key per line.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import typing
from functools import cache
from typing import Any

from moe_rl.config.coerce import is_config_value, type_name
from moe_rl.config.sections import Config


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass, its dataclass bases' included:
    {field name: the string literal under it}."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _describe_parts(hint: type, key: str, doc: str) -> list[str]:
    """A ConfigValue's heading and each of its sub-sections (rl.objective_args.<name>)."""
    lines = [f"[{key}]  {doc}"]
    for name, heading, section in hint.config_sections():  # type: ignore[attr-defined]
        lines.append(f"[{key}.{name}]  {heading}")
        lines.append(describe(section, prefix=f"{key}.{name}."))
    return lines


def describe(cls: type = Config, prefix: str = "", defaults: Any = None) -> str:
    """Every key with its type, default and docstring, one per line (for --help-config).
    `defaults`: the section's default value as its parent builds it (a nested section's
    factory may set other defaults than its type's, e.g. critic.optimizer's learning rate)."""
    lines = []
    hints = typing.get_type_hints(cls)
    defaults = defaults if defaults is not None else cls()
    for f in dataclasses.fields(cls):
        key, hint, doc = f"{prefix}{f.name}", hints[f.name], field_docs(cls).get(f.name, "")
        if is_config_value(hint):
            lines += _describe_parts(hint, key, doc)
            continue
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            lines.append(f"[{key}]  {doc}")
            lines.append(describe(hint, prefix=key + ".", defaults=getattr(defaults, f.name)))
            continue
        lines.append(f"  {key} = {getattr(defaults, f.name)!r}  ({type_name(hint)})  {doc}")
    return "\n".join(lines)
