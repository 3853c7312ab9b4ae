"""User-facing errors: one clear message naming the problem and the fix."""


class AutoCompressError(Exception):
    """An error the user can fix; entry points print its message and exit non-zero."""


class ConfigError(AutoCompressError):
    """A configuration value is missing, unknown or out of range."""


class InfeasibleError(AutoCompressError):
    """No architecture in the search space can meet a constraint."""
