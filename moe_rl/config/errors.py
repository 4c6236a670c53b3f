"""The one error type of configuration."""


class ConfigError(ValueError):
    """A recipe or override that cannot be run; the message names the key and the fix."""
