"""YAML text -> plain data, with errors as one line naming the file, line and column.

    yaml_load(text, "examples/tiny_rspo.yaml")
    # ConfigError: examples/tiny_rspo.yaml:12:3: mapping values are not allowed here
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from moe_rl.config.errors import ConfigError


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads `1e-5` as a float. YAML 1.1 (PyYAML) wants a dot in the
    mantissa (`1.0e-5`) and would otherwise hand a learning rate over as a string."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def yaml_error(source: str, e: yaml.YAMLError) -> ConfigError:
    """`<source>:<line>:<col>: <what is wrong>` (1-based, as editors count)."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        what = " ".join(f"{e.context + ': ' if e.context else ''}{e.problem or 'invalid YAML'}".split())
        return ConfigError(f"{source}:{mark.line + 1}:{mark.column + 1}: {what}")
    return ConfigError(f"{source}: not valid YAML: {' '.join(str(e).split())}")


def yaml_load(text: str, source: str = "<yaml>") -> Any:
    """Parse YAML `text`; a syntax error is a ConfigError naming `source` and the position."""
    try:
        return yaml.load(text, Loader=_YamlLoader)
    except yaml.YAMLError as e:
        raise yaml_error(source, e) from None


def yaml_value(raw: str, what: str) -> Any:
    """One override's value (a YAML scalar or flow collection); `what` names the override."""
    try:
        return yaml.load(raw, Loader=_YamlLoader)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"{what}: the value is not valid YAML ({problem}); quote it if it is a "
                          "string") from None
