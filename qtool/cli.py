"""The `qtool` command: it only assembles commands; each lives in qtool/commands/."""
from __future__ import annotations

import importlib
import sys

import click

from qtool.errors import QtoolError

# one module per command in qtool/commands/, each exposing a click command named `command`
COMMANDS = ["calibrate", "quantize", "eval", "inspect", "bench", "info"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="qtool")
def cli():
    """Post-training INT8 quantization for ONNX models.

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
    cli.add_command(_mod.command)


def main(argv=None):
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        cli.main(args=argv, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("qtool: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as e:  # misuse: bad option, missing argument
        e.show()
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except QtoolError as e:
        if debug:
            raise
        click.echo(f"qtool: error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("qtool: interrupted", err=True)
        sys.exit(130)
    sys.exit(0)


if __name__ == "__main__":
    main()
