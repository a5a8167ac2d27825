"""Options every command shares, defined once."""
from __future__ import annotations

import functools
import json
import logging
import warnings

import click

from qtool.errors import QtoolError
from qtool.modelio import atomic_write_text, json_safe
from qtool.workdir import Workdir

EXIT_INTERNAL = 70  # sysexits' EX_SOFTWARE: a bug in qtool, whatever the input
REPORT = ("this is a bug in qtool: please report it on qtool's issue tracker with this line and the output "
          "of the same command run with --debug")


def _verbosity(ctx, param, value):
    ctx.ensure_object(dict)
    ctx.obj[param.name] = value
    return value


def common_options(f):
    f = click.option("--workdir", "-w", default="qtool_work", show_default=True, type=click.Path(file_okay=False),
                     help="Working directory that joins calibrate -> quantize -> eval.")(f)
    f = click.option("-q", "--quiet", is_flag=True, help="Only errors; no progress bars.")(f)
    f = click.option("-v", "--verbose", count=True, help="More detail (repeat for more).")(f)
    f = click.option("--debug", is_flag=True, help="Show the full traceback on errors.")(f)
    return f


def setup_output(quiet: bool, verbose: int) -> None:
    level = logging.ERROR if quiet else (logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING)
    logging.basicConfig(level=level, format="%(message)s")
    warnings.simplefilter("ignore" if quiet else "default")
    warnings.formatwarning = lambda msg, cat, *a, **k: f"qtool: warning: {msg}\n"


def say(quiet: bool, text: str = "") -> None:
    if not quiet:
        click.echo(text)


def write_json(path: str | None, data: dict) -> None:
    if path:
        atomic_write_text(path, json.dumps(json_safe(data), indent=2))


class InternalError(Exception):
    """An unexpected exception inside a command, told as one line naming the step and the model."""

    exit_code = EXIT_INTERNAL

    def __init__(self, step: str, model: str | None, error: BaseException):
        super().__init__(step, model, error)
        self.step, self.model, self.error = step, model, error

    def __str__(self):
        text = " ".join(str(self.error).split())  # one line, whatever the exception printed
        if len(text) > 300:
            text = text[:297] + "..."
        where = f"qtool {self.step}" if self.step else "qtool"
        on = f" on {self.model}" if self.model else ""
        return f"internal error in `{where}`{on}: {type(self.error).__name__}: {text}; {REPORT}"


def model_of(params: dict) -> str | None:
    """The model a command works on, for error messages: its --model/MODEL, else the model
    calibrated in its working directory. Never raises: it runs while reporting another error."""
    if params.get("model"):
        return str(params["model"])
    if "workdir" not in params:
        return None
    try:
        return Workdir(params["workdir"]).manifest().get("calibrate", {}).get("model_path")
    except Exception:
        return None


# exceptions that already reach the user as one line (or are click's own control flow)
_EXPECTED = (QtoolError, OSError, click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort)


def guard(step: str, callback):
    """Wrap a command's callback: an exception no step anticipated becomes an InternalError naming
    the step and the model, so a bug is one line, not a traceback. With --debug the original
    exception propagates with its traceback."""

    @functools.wraps(callback)
    def run(**params):
        try:
            return callback(**params)
        except _EXPECTED:
            raise
        except Exception as e:
            if params.get("debug"):
                raise
            raise InternalError(step, model_of(params), e) from e

    return run
