"""Paths to files shipped inside the installed package, resolved wherever the user stands.

Recipes name shipped assets by their place in the source tree, `moe_rl/assets/tiny_base`.
The rule, applied when a recipe is loaded to every path field that can name a shipped file
(`SHIPPED_PATH_FIELDS`): a value that starts with `moe_rl/` and does not exist relative to
the working directory, but does inside the installed `moe_rl` package, becomes that
absolute path. Everything else (the user's own paths) stays relative to the working
directory, so from the repository root nothing changes, and a user directory that happens
to be called moe_rl/ wins over the package.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

PACKAGE_PREFIX = "moe_rl/"
PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""The installed `moe_rl` package directory (site-packages/moe_rl, or the source tree)."""

SHIPPED_PATH_FIELDS = (("run", "init_checkpoint"), ("task", "tokenizer"), ("task", "data_path"),
                       ("task", "eval_data_path"), ("task", "chat_template"))
"""(section, key) of the fields that may name a shipped file (sft.output is written, not read)."""


def shipped_path(value: str) -> str:
    """`value`, or the absolute path of the shipped file it names (module doc)."""
    if not value.startswith(PACKAGE_PREFIX) or Path(value).exists():
        return value
    inside = PACKAGE_DIR / value[len(PACKAGE_PREFIX):]
    return str(inside) if inside.exists() else value


def resolve_shipped_paths(cfg: Any) -> Any:
    """The config with each of SHIPPED_PATH_FIELDS resolved by `shipped_path`."""
    for section, key in SHIPPED_PATH_FIELDS:
        part = getattr(cfg, section)
        value = getattr(part, key)
        resolved = shipped_path(value)
        if resolved != value:
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(part, **{key: resolved})})
    return cfg
