"""eval's runs of the two models over a Ray cluster, with the figures one process gets.

The driver reads and batches the samples as one process does (the decoding is the light part); each
batch goes to a worker, an actor holding the sessions one process makes (the same models, the same ONNX
Runtime threads, the same native runtime), which runs it and sends the outputs back. The driver adds the
outputs up in the batches' order (runs.py), so every figure is made from the same outputs added in the
same order. A few batches per worker are under way at once: memory on the driver is theirs, not the data's.
The latency is timed on the driver's own sessions afterwards (evaluate/timing.py): one machine's speed."""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager

from qtool.distributed.cluster import RETRIES, cpus, gather, node_id, ray_cluster
from qtool.evaluate.runs import Engines, Outputs, run_batch
from qtool.ortsession import session

WHAT = "eval"
IN_FLIGHT_PER_WORKER = 2  # batches handed to a worker before the first comes back: it never waits for the driver


class EvalWorker:
    """An actor: the engines of `Engines`, made on its first batch and kept."""

    def __init__(self, engines: Engines):
        self.engines, self.sessions = engines, None

    def node(self) -> str:
        return node_id()

    def run(self, feeds: dict, exact: bool) -> Outputs:
        if self.sessions is None:
            self.sessions = _sessions(self.engines)
        sessions = self.sessions
        if exact and sessions[3] is None:
            sessions = sessions[:3] + (_native(self.engines),)
            self.sessions = sessions
        return run_batch(self.engines, sessions, feeds, exact)


def _sessions(e: Engines) -> tuple:
    sf = session(e.fp32_path, e.threads, arena=e.arena)
    sq = session(e.int8_path, e.threads, arena=e.arena)
    native = _native(e) if e.native else None
    return sf, sq, native, native


def _native(e: Engines):
    """qtool's runtime on the int8 model, as the driver's ExactCheck makes it; a model it cannot load gives
    a session whose runs answer that error (the check gives up on it, as in one process)."""
    from qtool.runtime import NativeSession
    try:
        return NativeSession(e.int8_path, threads=e.threads)
    except Exception as err:  # noqa: BLE001 (exact.exact_output hands it back as the batch's exact output)
        return _Failed(err)


class _Failed:
    def __init__(self, error: Exception):
        self.error = error

    def run(self, names, feeds):
        raise self.error


@contextmanager
def on_cluster(address: str | None, engines: Engines):
    """Workers on the cluster at `address` (cluster.ray_cluster) running `engines`, for the block."""
    with ray_cluster(address) as ray:
        yield Workers(ray, engines)


class Workers:
    def __init__(self, ray, engines: Engines):
        actor = ray.remote(num_cpus=1, max_restarts=RETRIES, max_task_retries=RETRIES)(EvalWorker)
        self.workers = [actor.remote(engines) for _ in range(cpus())]
        self.nodes = set(gather([w.node.remote() for w in self.workers], WHAT))

    def outputs(self, batches):
        """(names, feeds, want exact) -> (names, feeds, Outputs), in order; batch k on worker k mod W."""
        under_way = deque()
        limit = IN_FLIGHT_PER_WORKER * len(self.workers)
        for k, (names, feeds, exact) in enumerate(batches):
            under_way.append((names, feeds, self.workers[k % len(self.workers)].run.remote(feeds, exact)))
            if len(under_way) >= limit:
                yield self._back(under_way.popleft())
        while under_way:
            yield self._back(under_way.popleft())

    def _back(self, item) -> tuple:
        names, feeds, ref = item
        return names, feeds, gather([ref], WHAT, self.nodes)[0]
