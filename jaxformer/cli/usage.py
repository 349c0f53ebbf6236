"""The error every `jaxformer` command raises for bad input: one line on stderr, exit 2."""


class UsageError(ValueError):
    """Bad flags, files or run directory: reported as `jaxformer COMMAND: error: ...`."""
