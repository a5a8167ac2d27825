"""`qtool batch` as a library function: read and check the catalogue, run every model's job (here or on
Ray), write the table. Returns the rows; the caller decides the exit code (1 when a model failed).
`lines_of(entry, workdir)` makes an entry's command lines (qtool.commands.batch_steps.lines: the
commands' own parsing, in the CLI's layer above this one)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from qtool import outputs
from qtool.batch import catalogue as cat
from qtool.batch import table
from qtool.batch.job import Job
from qtool.batch.local import run_local
from qtool.errors import UsageError
from qtool.timing import Phases
from qtool.workdir import MANIFEST

TABLE = {"markdown": "batch.md", "json": "batch.json"}


@dataclass(frozen=True)
class BatchOptions:
    """out: the folder of the working folders (OUT/NAME) and the table (OUT/batch.md, OUT/batch.json);
    jobs: models run at once on this machine; ray: None (no Ray), "local" (a local cluster), "auto" or an
    address; only: run these models of the catalogue (its order kept)."""
    out: str = "qtool_batch"
    jobs: int = 1
    ray: str | None = None
    only: tuple = ()


def plan(path: str, options: BatchOptions, lines_of) -> tuple:
    """(catalogue, jobs, table paths), everything checked: the catalogue, each step's options, and that
    no file the batch writes is one it reads (a model, a data file, the catalogue itself)."""
    c = cat.load(path)
    if options.only:
        missing = [n for n in options.only if n not in {e.name for e in c.entries}]
        if missing:
            raise UsageError(f"{path}: no model named {missing[0]!r} (--only)")
        c = cat.Catalogue(c.path, tuple(e for e in c.entries if e.name in options.only))
    lines = {}
    for e in c.entries:  # (every line parsed now: a wrong option is found before any job runs)
        try:
            lines[e.name] = lines_of(e, os.path.abspath(os.path.join(options.out, e.name)))
        except UsageError as err:
            raise UsageError(f"{path}: {err}") from None
    paths = {k: os.path.join(options.out, v) for k, v in TABLE.items()}
    reads = [outputs.File("catalogue", path)]
    for e in c.entries:
        reads += outputs.model(f"model {e.name!r}", e.path) + outputs.data(f"data of {e.name!r}", e.data)
        reads += outputs.data(f"evaluation data of {e.name!r}", e.eval_data) if e.eval_data else []
    outputs.check([outputs.File(f"table ({k})", p) for k, p in paths.items()], reads)
    for e in c.entries:
        emptied(os.path.join(options.out, e.name), reads)
    jobs = [Job(e, os.path.abspath(os.path.join(options.out, e.name)), lines[e.name]) for e in c.entries]
    return c, jobs, paths


def emptied(work: str, reads: list) -> None:
    """A job empties its working folder first: the folder must be new, empty or a qtool working folder
    (one a user's own folder named like a model is not), and hold no input."""
    if os.path.isdir(work) and os.listdir(work) and not os.path.isfile(os.path.join(work, MANIFEST)):
        raise UsageError(f"{work}: a folder that is not a qtool working folder, which qtool batch would empty "
                         f"first: choose another --out")
    real = os.path.realpath(work)
    for r in reads:
        if r.path and os.path.commonpath([real, os.path.realpath(r.path)]) == real:
            raise UsageError(f"{r.path}: the {r.what} is inside the working folder {work} that qtool batch "
                             f"empties first: choose another --out")


def run_batch(path: str, options: BatchOptions, lines_of, done=lambda row: None) -> list:
    laps = Phases()  # (the table's "phases": where the driver's time went, for benchmarks/bench_ray.py)
    laps.lap("plan")
    c, jobs, paths = plan(path, options, lines_of)
    if options.ray is None:
        laps.lap("jobs")
        rows, where = run_local(jobs, options.jobs, done), f"local, {options.jobs} at a time"
    else:
        from qtool.batch.on_ray import run_on_ray  # (Ray imported only with --ray)
        rows, where = run_on_ray(jobs, options.ray, done, laps), f"ray {options.ray}"
    table.write(rows, c.path, where, paths, laps.stop())
    return rows
