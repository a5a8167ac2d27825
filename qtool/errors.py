"""Errors a user can act on. The CLI turns them into one line and an exit code.

A message often quotes what an untrusted file holds (node names, tensor names, paths), so it
is made printable here, once: control characters (terminal escape codes, newlines, bidi
overrides) become visible escapes, and every message stays one line.
"""


def printable(text) -> str:
    """`text` with every non-printable character (ESC, newline, NUL, Unicode format and
    separator characters other than the space) written as a \\xNN / \\uNNNN escape."""
    s = str(text)
    if s.isprintable():
        return s
    out = []
    for ch in s:
        if ch.isprintable():
            out.append(ch)
        else:
            o = ord(ch)
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
    return "".join(out)


class QtoolError(Exception):
    """Bad input (a file, a model, data): exit code 1."""

    exit_code = 1

    def __init__(self, message="", *args):
        super().__init__(printable(message), *args)


class UsageError(QtoolError):
    """The command was called wrongly: exit code 2."""

    exit_code = 2


class LateWriteError(QtoolError):
    """The work is done but a file written last (the manifest, a report) could not be: `result` is what
    was computed, for the caller to show before this error (an hour of evaluation is never lost to a
    read-only working directory). Exit code 1."""

    def __init__(self, message, result):
        super().__init__(message)
        self.result = result


class ExhaustedError(QtoolError):
    """The machine or the input ran out of something (memory, Python's recursion depth, room on standard
    output): the user's to act on, exit code 1, not a bug in qtool."""


def exhausted(error: BaseException, where: str = "") -> ExhaustedError:
    """The one line an exhausted resource is told as: what ran out, and where (`qtool calibrate on m.onnx`)."""
    at = f" in {where}" if where else ""
    if isinstance(error, MemoryError):
        return ExhaustedError(f"out of memory{at}: the process could not allocate more (free memory, raise the "
                              f"limit, e.g. `ulimit -v`, or use fewer or smaller samples)")
    if isinstance(error, RecursionError):
        return ExhaustedError(f"input nested too deeply{at}: Python's recursion limit was reached reading it")
    return ExhaustedError(f"{type(error).__name__}{at}: {error}")
