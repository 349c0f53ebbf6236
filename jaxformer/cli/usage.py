"""The error every `jaxformer` command raises for bad input: one line on stderr, exit 2."""


class UsageError(ValueError):
    """Bad flags, files or run directory: reported as `jaxformer COMMAND: error: ...`."""


def require_positive(flag: str, value: int) -> None:
    """UsageError unless `value` (of `flag`) is a positive number."""
    if not value > 0:
        raise UsageError(f"{flag} must be positive, got {value}")
