"""A name -> entry registry shared by the objective and advantage families, and the strict
builder of their hyperparameter dataclasses.

One registry per family (`OBJECTIVES`, `ADVANTAGES`). Registering a name twice is an error
(two files claiming one name is a bug, not an override), and looking up an unknown name
raises `UnknownNameError`, which lists the valid names and is both a `KeyError` (so the
`Mapping` protocol, `in` and `.get` behave) and a `ValueError` (what callers catch for bad
configuration).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """A registry lookup of a name that is not registered; the message lists the valid ones."""

    def __str__(self) -> str:  # KeyError would repr() the message, quotes and all
        return str(self.args[0]) if self.args else ""


class Registry(Mapping[str, T], Generic[T]):
    """Insertion-ordered, add-only mapping from names to entries of one family."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Add `entry` under `name`; a name that is already taken raises ValueError."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; valid names: {', '.join(self._entries)}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._entries)})"


def build_hparams(cls: type, kwargs: Mapping[str, Any], what: str) -> Any:
    """`cls(**kwargs)` for a hyperparameter dataclass, strictly: an unknown key is a
    ValueError naming it, `what` it was meant for, and the valid keys."""
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in kwargs if k not in valid]
    if unknown:
        raise ValueError(
            f"unknown hyperparameter {unknown[0]!r} for {what}; valid: {', '.join(valid) or '(none)'}"
        )
    return cls(**kwargs)
