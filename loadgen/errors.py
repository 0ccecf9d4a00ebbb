"""The one error type for bad input: the CLI prints it and exits with status 2."""


class UsageError(ValueError):
    """A flag, file or value the user gave cannot be used; the message says which and why."""
