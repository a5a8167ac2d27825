"""Errors a user can act on. The CLI turns them into one line and an exit code."""


class QtoolError(Exception):
    """Bad input (a file, a model, data): exit code 1."""

    exit_code = 1


class UsageError(QtoolError):
    """The command was called wrongly: exit code 2."""

    exit_code = 2
