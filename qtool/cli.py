"""The `qtool` command: it only assembles commands; each lives in qtool/commands/."""
from __future__ import annotations

import importlib
import sys

import click

from qtool.commands.common import EXIT_INTERNAL, InternalError, guard
from qtool.errors import QtoolError

# one module per command in qtool/commands/, each exposing a click command named `command`
COMMANDS = ["calibrate", "quantize", "eval", "inspect", "bench", "info"]


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
    except Exception as e:  # outside any command (start-up): still one line
        if debug:
            raise
        click.echo(f"qtool: {InternalError(_step(args) or '', None, e)}", err=True)
        sys.exit(EXIT_INTERNAL)
    sys.exit(0)


if __name__ == "__main__":
    main()
