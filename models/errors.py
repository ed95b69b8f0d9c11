"""Bad-input errors raised below the CLI; the CLI turns them into a one-line message and exit 2."""
from core.errors import BadInput


class ConfigError(BadInput):
    """A configuration value is invalid. The message names the key and the allowed values."""
