"""Options every command shares, defined once."""
from __future__ import annotations

import json
import logging
import sys
import warnings

import click

from qtool.distributed.cluster import LOCAL
from qtool.errors import LateWriteError, QtoolError, printable
from qtool.modelio import atomic_write_text, json_safe


def _verbosity(ctx, param, value):
    ctx.ensure_object(dict)
    ctx.obj[param.name] = value
    return value


def common_options(f):
    f = click.option("--workdir", "-w", default="qtool_work", show_default=True, type=click.Path(file_okay=False),
                     help="Working directory that joins calibrate -> quantize -> eval.")(f)
    return output_options(f)


def ray_option(f):
    """--ray [ADDRESS]: the command's work on a Ray cluster (distributed/cluster.py; the extra qtool[ray])."""
    return click.option("--ray", "ray", is_flag=False, flag_value=LOCAL, default=None, metavar="[ADDRESS]",
                        help="Run on a Ray cluster (pip install 'qtool[ray]'), with the result one process writes: "
                             "alone, a local cluster of this machine's cores; `auto`, the one `ray start` runs "
                             "here; or ray://HOST:PORT.")(f)


def output_options(f):
    """-q, -v and --debug, which every command takes."""
    f = click.option("-q", "--quiet", is_flag=True, help="Only errors; no progress bars.")(f)
    f = click.option("-v", "--verbose", count=True, help="More detail (repeat for more).")(f)
    f = click.option("--debug", is_flag=True, help="Show the full traceback on errors.")(f)
    return f


def setup_output(quiet: bool, verbose: int) -> None:
    level = logging.ERROR if quiet else (logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING)
    logging.basicConfig(level=level, format="%(message)s")
    warnings.simplefilter("ignore" if quiet else "default")
    warnings.formatwarning = lambda msg, cat, *a, **k: f"qtool: warning: {printable(msg)}\n"
    warnings.showwarning = show_warning


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning on a line of its own, also while a progress bar is drawn: on a terminal the bar is
    cleared and drawn again below it (tqdm.write); in a log, where the bar's line never ends, a new line
    first (a warning printed after a bar's last frame was lost to a reader filtering the bars out)."""
    from tqdm import tqdm
    text = warnings.formatwarning(message, category, filename, lineno, line)
    out = file or sys.stderr
    bars = [b for b in getattr(tqdm, "_instances", ()) if not b.disable]
    if bars and not getattr(out, "isatty", lambda: False)():
        text = "\n" + text
    tqdm.write(text.rstrip("\n"), file=out)


def say(quiet: bool, text: str = "") -> None:
    if not quiet:  # names from a model or the file system are printed escaped (no terminal codes)
        echo("\n".join(printable(line) for line in str(text).split("\n")))


def echo(text: str = "") -> None:
    """click.echo to standard output; a write that fails (`> /dev/full`, a closed pipe) is one error
    saying it was standard output, not a bare "No space left on device" after the work."""
    try:
        click.echo(text)
    except OSError as e:
        raise QtoolError(f"cannot write to standard output ({e.strerror or e})") from None


def write_json(path: str | None, data: dict) -> None:
    if path:
        atomic_write_text(path, json.dumps(json_safe(data), indent=2))


def shown(run, show):
    """run() -> its result, after show(result) (the figures printed, --json written). When a write after the
    work failed (LateWriteError), the figures it carries are shown first, then the error goes on."""
    try:
        r = run()
    except LateWriteError as e:
        try:
            show(e.result)
        except QtoolError as also:
            raise QtoolError(f"{e}; and {also}") from None
        raise
    show(r)
    return r
