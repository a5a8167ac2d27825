"""The Ray cluster a command runs on: the one module that imports ray.

`ray_cluster(address)` connects for the length of a `with` block and yields the ray module:
address None (or LOCAL) starts a local cluster on this machine's cores, `auto` joins the cluster
already running here (`ray start --head`), `ray://host:port` a remote one through Ray Client.
A cluster the process is already connected to (a test's, a notebook's) is used as it is and left
running. Ray is an optional extra (`pip install 'qtool[ray]'`), imported (here, lazily) only when --ray is
given; without the extra the option is one error saying how to install it.

`gather(refs, what, nodes)` waits for remote results: a worker process that dies is restarted and its
call retried by Ray (RETRIES); a worker lost for good, or a node of `nodes` (where the workers live) gone
from the cluster, ends the job with one line (ClusterError, exit 1), never a partial result."""
from __future__ import annotations

import os
import re
from contextlib import contextmanager

from qtool.errors import QtoolError, UsageError

LOCAL = "local"  # --ray given without an address: a cluster of this machine's cores, started here
RETRIES = 3  # restarts of an actor, and re-runs of a task, after its worker process died
NODE_CHECK_SECONDS = 2.0  # while waiting for results, how often the workers' nodes are checked


class ClusterError(QtoolError):
    """The cluster lost a node or a worker beyond what Ray retries: the job ends, nothing is written."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray: pip install 'qtool[ray]'") from None
    return ray


@contextmanager
def ray_cluster(address: str | None = None, num_cpus: int | None = None):
    """Connected to the cluster at `address` inside the block -> the ray module. `num_cpus`: the
    cores of a local cluster (default: this machine's)."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    kwargs = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR", configure_logging=True)
    try:
        if address in (None, LOCAL):
            ray.init(num_cpus=num_cpus or os.cpu_count() or 1, **kwargs)
        else:
            kwargs.pop("include_dashboard")
            ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(f"cannot connect to the Ray cluster at {address}: {_first_line(e)}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def gather(refs: list, what: str, nodes: frozenset = frozenset()) -> list:
    """ray.get of `refs`, in their order, waiting as next_done does (a node of `nodes` gone ends the job);
    a loss Ray could not retry is one ClusterError naming `what`."""
    ray = import_ray()
    lost = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
            ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)
    pending = list(refs)
    while pending:
        _, pending = next_done(pending, nodes, what)
    try:
        return ray.get(list(refs))
    except lost as e:
        raise ClusterError(f"{what}: the Ray cluster lost a worker or node ({type(e).__name__}): "
                           f"{_first_line(e)}; nothing was written") from None
    except ray.exceptions.RayTaskError as e:
        cause = e.as_instanceof_cause() if hasattr(e, "as_instanceof_cause") else e
        if isinstance(getattr(e, "cause", None), QtoolError):
            raise e.cause from None  # the user's input was at fault: its own one line
        raise cause from None


def node_id() -> str:
    """The node this process runs on (an actor's method answers it: where that worker lives)."""
    return import_ray().get_runtime_context().get_node_id()


def next_done(pending: list, nodes: set, what: str) -> tuple:
    """(the first of `pending` to finish, the others). Ray restarts a dead worker where it can; a node of
    `nodes` (the workers') gone from the cluster ends the job here, with one line, rather than waiting
    for a restart that may never find room."""
    ray = import_ray()
    while True:
        done, rest = ray.wait(pending, num_returns=1, timeout=NODE_CHECK_SECONDS)
        if done:
            return done, rest
        gone = [n.get("NodeManagerAddress", "?") for n in ray.nodes() if n["NodeID"] in nodes and not n["Alive"]]
        if gone:
            raise ClusterError(f"{what}: the Ray node at {gone[0]} left the cluster; nothing was written")


def put(value) -> list:
    """`value` into the object store, boxed in a list: passed to an actor's method so, it reaches the actor
    as the reference, fetched once (`fetched`) and kept, not with every call; and a restarted actor
    fetches it again (constructor arguments held in the object store are not safe across restarts)."""
    return [import_ray().put(value)]


def fetched(boxed: list):
    return import_ray().get(boxed[0])


def cpus() -> int:
    """The cluster's CPUs (at least 1): how many workers to start."""
    ray = import_ray()
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def _first_line(e: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()  # (Ray colours the names in its messages)
    return text.splitlines()[0] if text else type(e).__name__
