"""The jobs on this machine: each model's steps in child processes of their own, `jobs` models at a time.
The rows come back in the catalogue's order whatever finishes first; `done(row)` is called in that order
too, as soon as a row and every row before it are in."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from qtool.batch.job import run_job


def run_local(jobs: list, parallel: int = 1, done=lambda row: None) -> list:
    """Each job's row, in order. A Ctrl-C kills the running steps (their watchers see `cancel`) and goes on up."""
    cancel = threading.Event()
    rows = []
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = [pool.submit(run_job, job, cancel) for job in jobs]
        try:
            for f in futures:
                rows.append(f.result())
                done(rows[-1])
        except BaseException:
            cancel.set()
            for f in futures:
                f.cancel()
            raise
    return rows

