"""Where eval's models run: here, or with --ray on a Ray cluster (sharded.py, imported only then)."""
from __future__ import annotations

from contextlib import contextmanager

from qtool.evaluate.runs import Engines, Here


@contextmanager
def engines_at(ray: str | None, engines: Engines, sessions: tuple, times=None):
    """Inside the block, an object whose .outputs(batches) runs them (runs.py): `sessions` (fp32, int8,
    native or None, the exact check's native session or None) here when `ray` is None, else the same
    engines made by workers on the cluster at `ray` (distributed/cluster.ray_cluster)."""
    if ray is None:
        yield Here(engines, *sessions, times=times)
        return
    from qtool.evaluate.sharded import on_cluster
    with on_cluster(ray, engines) as there:
        yield there
