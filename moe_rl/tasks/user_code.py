"""A user's code named in a recipe as `module.path:name` (a reward function, a tool, an
environment class): imported with one-line errors that name the field and the fix."""

from __future__ import annotations

import importlib
from typing import Any


class UserCodeError(ValueError):
    """`module.path:name` that cannot be imported or is not what the field needs."""


def load_object(spec: str, field: str) -> Any:
    """The callable at `spec` (`module.path:name`) for recipe field `field`."""
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise UserCodeError(f"{field}={spec}: expected module.path:name (e.g. my_pkg.tools:search)")
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise UserCodeError(f"{field}={spec}: cannot import {module_name!r} ({' '.join(repr(e).split())}); "
                            "put the module on PYTHONPATH or fix the module path") from e
    obj = getattr(module, attr, None)
    if obj is None:
        raise UserCodeError(f"{field}={spec}: module {module_name!r} has no attribute {attr!r}; fix the name "
                            "after ':'")
    if not callable(obj):
        raise UserCodeError(f"{field}={spec}: {module_name}.{attr} is a {type(obj).__name__}, not a function or "
                            "class; point it at one")
    return obj
