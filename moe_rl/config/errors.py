"""The one error type of configuration."""


class ConfigError(ValueError):
    """A recipe or override that cannot be run; the message names the key and the fix."""


def require_positive(values: dict[str, int | float]) -> None:
    """{key: value}: the first value below 1 is the error (counts and sizes)."""
    for key, v in values.items():
        if v < 1:
            raise ConfigError(f"{key} must be >= 1, got {v}")


def require_all(checks: dict[str, tuple[bool, str]]) -> None:
    """{key: (holds, what it must be)}: the first that does not hold is the error."""
    for key, (ok, must) in checks.items():
        if not ok:
            raise ConfigError(f"{key} must be {must}")
