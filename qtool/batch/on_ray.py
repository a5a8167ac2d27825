"""The jobs on a Ray cluster: one task per model, asking Ray for the model's memory limit (so a node runs
no more models at once than its memory holds) and re-run by Ray when its worker process dies. The task
runs the very job the local path runs (job.run_job: the three steps as watched child processes, the
same limits), so the rows are the same; the working folders must be where every node sees them (one
machine, or a shared file system).

A model asking more memory than any node has would wait forever in Ray's queue: it is a row saying so
instead, and the others run."""
from __future__ import annotations

from qtool.batch.job import new_row, run_job
from qtool.batch.watch import MB
from qtool.distributed.cluster import RETRIES, gather, ray_cluster
from qtool.timing import Phases


def _job(job):
    return run_job(job)


def largest_node_mb(ray) -> float:
    """The memory Ray may schedule on its largest live node."""
    return max((n["Resources"].get("memory", 0) / MB for n in ray.nodes() if n.get("Alive")), default=0.0)


def too_big(job, largest: float) -> dict:
    row = new_row(job)
    row.update(status="failed", reason=f"not run: memory_mb {job.entry.limits.memory_mb:g} is above the largest "
                                       f"node's {largest:.0f} MB")
    return row


def run_on_ray(jobs: list, address: str, done=lambda row: None, laps: Phases | None = None) -> list:
    """Each job's row, in the jobs' order (`done` called in that order too); `laps` (timing.Phases) told of
    the cluster's start ("ray start"), the jobs and its stop ("ray stop")."""
    laps = laps or Phases()
    laps.lap("ray start")
    with ray_cluster(address) as ray:
        task = ray.remote(_job)
        largest = largest_node_mb(ray)
        laps.lap("jobs")
        refs = [None if job.entry.limits.memory_mb > largest else
                task.options(memory=int(job.entry.limits.memory_mb * MB), max_retries=RETRIES).remote(job)
                for job in jobs]
        rows = []
        for job, ref in zip(jobs, refs):
            rows.append(too_big(job, largest) if ref is None else
                        gather([ref], f"qtool batch: model {job.entry.name!r}")[0])
            done(rows[-1])
        laps.lap("ray stop")
    return rows
