"""qtool batch: calibrate, quantize and eval every model of a catalogue, one table of the results."""
from __future__ import annotations


import click

from qtool.commands.common import output_options, ray_option, say, setup_output
from qtool.errors import QtoolError


@click.command("batch", short_help="Calibrate, quantize and eval every model of a catalogue (TOML).")
@click.argument("catalogue", type=click.Path(dir_okay=False))
@click.option("--out", "-o", default="qtool_batch", show_default=True, type=click.Path(file_okay=False),
              help="Folder of the models' working folders (OUT/NAME) and the table (OUT/batch.md, OUT/batch.json).")
@click.option("--jobs", "-j", default=1, show_default=True, type=click.IntRange(1, 1024),
              help="Models run at once on this machine (each under its own memory limit).")
@click.option("--only", multiple=True, help="Run only this model of the catalogue (repeatable; its order kept).")
@ray_option
@output_options
def command(catalogue, out, jobs, only, ray, quiet, verbose, debug):
    """Run `qtool calibrate`, `quantize` and `eval` for every model of CATALOGUE (a TOML file: see
    docs/catalogue.md), each step a process of its own under the model's memory limit,
    and write one table: status, seconds and peak memory per step, int8 size against fp32, the eval
    figures. A model that fails is a row with its one-line reason; the batch goes on. Exit 0 when every
    model is ok, 1 when one is not (the table is written either way). With --ray, each model is one
    Ray task asking for its memory limit (--jobs is then Ray's to decide).

    \b
    Example:
      qtool batch models.toml --out release/ --jobs 2
      qtool batch models.toml --ray auto
    """
    setup_output(quiet, verbose)
    from qtool.batch.run import BatchOptions
    from qtool.batch.table import HEAD, cells

    say(quiet, " | ".join(HEAD))
    rows = run_catalogue(catalogue, BatchOptions(out, jobs, ray, tuple(only)),
                         done=lambda row: say(quiet, " | ".join(cells(row))))
    bad = [r["name"] for r in rows if r["status"] != "ok"]
    say(quiet, f"{len(rows) - len(bad)} of {len(rows)} models ok; table in {out}/batch.md and {out}/batch.json")
    if bad:
        raise QtoolError(f"{len(bad)} of {len(rows)} models failed ({', '.join(bad)}): their reasons are in the table")


def run_catalogue(path: str, options, done=lambda row: None) -> list:
    """`qtool batch` from Python -> the rows (options: qtool.batch.run.BatchOptions; `done(row)` as each
    row is in, in the catalogue's order): qtool.batch.run.run_batch with the commands' own lines."""
    from qtool.batch.run import run_batch
    from qtool.commands.batch_steps import lines
    return run_batch(path, options, lines, done)
