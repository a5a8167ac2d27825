"""The `qtool` command: it assembles the commands (each lives in qtool/commands/) and turns
whatever ends a run into one line and an exit code."""
from __future__ import annotations

import functools
import importlib
import sys

import click

from qtool.errors import QtoolError, exhausted
from qtool.workdir import Workdir

EXIT_INTERNAL = 70  # sysexits' EX_SOFTWARE: a bug in qtool, whatever the input
REPORT = ("this is a bug in qtool: please report it on qtool's issue tracker with this line and the output "
          "of the same command run with --debug")

# one module per command in qtool/commands/, each exposing a click command named `command`
COMMANDS = ["calibrate", "quantize", "eval", "inspect", "bench", "info", "batch"]


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
        except (MemoryError, RecursionError) as e:  # (the machine's or the input's limits: one line, exit 1)
            if params.get("debug"):
                raise
            model = model_of(params)
            raise exhausted(e, f"`qtool {step}`" + (f" on {model}" if model else "")) from None
        except Exception as e:
            if params.get("debug"):
                raise
            raise InternalError(step, model_of(params), e) from e

    return run


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="qtool")
def cli():
    """Post-training INT8 quantization for ONNX models.

    \b
    Exit codes: 0 success, 1 bad input (one line naming the file), 2 misuse,
    70 internal error (a bug in qtool: one line, please report it), 130 interrupted.
    --debug shows the full traceback instead.

    \b
    Example:
      qtool calibrate --model resnet50.onnx --data calib_data/
      qtool quantize --exclude-sensitive
      qtool eval --compare fp32
    """


for _name in COMMANDS:
    try:
        _mod = importlib.import_module(f"qtool.commands.{_name}")
    except ModuleNotFoundError as e:  # a command not built yet is simply absent
        if e.name != f"qtool.commands.{_name}":
            raise
        continue
    _mod.command.callback = guard(_mod.command.name, _mod.command.callback)
    cli.add_command(_mod.command)


def _step(args: list) -> str:
    """The command named on the command line, for an error raised outside any command."""
    return next((a for a in args if a in cli.commands), "")


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in args
    try:
        cli.main(args=args, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("qtool: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as e:  # misuse: bad option, missing argument
        e.show()
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except (QtoolError, OSError) as e:  # bad input, or the system refused (disk full, permissions)
        if debug:
            raise
        click.echo(f"qtool: error: {e}", err=True)
        sys.exit(getattr(e, "exit_code", 1))
    except InternalError as e:
        click.echo(f"qtool: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("qtool: interrupted", err=True)
        sys.exit(130)
    except (MemoryError, RecursionError) as e:  # outside any command (start-up): still the user's
        if debug:
            raise
        click.echo(f"qtool: error: {exhausted(e, f'`qtool {_step(args)}`' if _step(args) else '')}", err=True)
        sys.exit(1)
    except Exception as e:  # outside any command (start-up): still one line
        if debug:
            raise
        click.echo(f"qtool: {InternalError(_step(args) or '', None, e)}", err=True)
        sys.exit(EXIT_INTERNAL)
    sys.exit(0)


if __name__ == "__main__":
    main()
