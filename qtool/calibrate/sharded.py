"""calibrate's pass sharded over a Ray cluster, writing the table one process writes.

The samples one process would read (the data's files, thinned to the compute budget as budget.py
does) are cut into shards; a worker (an actor holding the fused model's sessions, made once) streams
each shard through collect.py as one process streams the whole data, given the index of its first
sample. Its statistics come back to the driver, which merges them with Observed.merge.

Identical, not just close: a histogram counts the blocks its sample's index picks and merges bin for
bin; counts, minima, maxima and NaN/inf tallies add up in any order. Two things depend on how one
process cut its stream, and are reproduced:
- the slices: one process runs its first sample alone, which measures the bytes each sample reads
  out and so the size of every later slice. Here that first slice is a shard of its own, run first;
  every other shard is told the figure and cut as the whole stream was (collect.planned_slices).
- the channel sums (float64, the first MEAN_SAMPLES samples, for bias correction): one process's
  workers each sum the slices dealt to them in turn, then the workers' sums are added. Shards of the
  batches starting below MEAN_SAMPLES are one slice each, and the driver adds them in that same order.
Memory per worker is one process's: the same collect, one shard at a time."""
from __future__ import annotations

import os
from dataclasses import dataclass

import onnx

from qtool import graph as G
from qtool.calibrate.budget import Spend, within_budget
from qtool.calibrate.collect import Pass, Targets, Within, collect, planned_slices, slice_budget
from qtool.calibrate.observed import MEAN_SAMPLES
from qtool.calibrate.options import CalibrateOptions
from qtool.calibrate.segments import ShapesAt
from qtool.calibrate.stream import Seen, noted_feeds
from qtool.data.sources import ImageData
from qtool.data.tensors import tensor_source
from qtool.distributed.cluster import RETRIES, cpus, fetched, gather, next_done, node_id, put, ray_cluster
from qtool.errors import UsageError
from qtool.timing import Phases

SHARDS_PER_WORKER = 4  # shards beyond the channel-means region: a few per worker, so the last ones even out


@dataclass(frozen=True)
class Sharded:
    """One sharded pass: the fused model, the data source fitted to it, what to observe, how (collect's
    Pass: threads, cut) and the calibration's options (the cluster's address, `ray`)."""
    model: onnx.ModelProto
    source: object
    targets: Targets
    run: Pass
    options: CalibrateOptions


@dataclass(frozen=True)
class Opening:
    """How a worker opens its share of the data: as the driver's source was opened."""
    folder: str
    kind: str  # "images", else a tensor folder
    cfg: object  # the preprocessing fitted to the model (images)
    batch: int
    threads: int  # collect's threads, as one process on the driver's machine resolves them: the first slice's
    cut: bool
    where: str


@dataclass(frozen=True)
class Shard:
    files: tuple
    within: Within  # its place in the stream (None of per_sample_bytes: the first slice itself)


class ShardWorker:
    """An actor: the fused model and its sessions, kept across the shards it is given."""

    def __init__(self, opening: Opening, targets: Targets):
        self.opening, self.targets = opening, targets
        self.model = None

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return node_id()

    def _load(self, model: list) -> None:
        if self.model is None:
            self.model = onnx.load_from_string(fetched(model))
            self.shapes, self.keep = ShapesAt(self.model), {}
            self.inputs = {i.name for i in G.real_inputs(self.model)}

    def observe(self, model: list, shard: Shard) -> Seen:
        """`model`: the fused model's bytes, boxed (cluster.put)."""
        self._load(model)
        o = self.opening
        files = list(shard.files)
        source = (ImageData(o.folder, o.cfg, self.model, o.where, o.batch, files=files) if o.kind == "images"
                  else tensor_source(o.folder, self.model, o.where, o.batch, files=files))
        seen = Seen(None, [], {}, Spend(0, len(source)), source.skipped)
        # (the first slice runs as one process would, telling how many workers it deals to; every other shard
        # on the worker's one CPU, cut as the whole stream is)
        threads = o.threads if shard.within.per_sample_bytes is None else 1
        run = Pass(None, threads, o.where, o.cut, self.shapes, shard.within, self.keep)
        seen.obs = collect(self.model, self.targets, noted_feeds(source, seen, None, None, self.inputs), run)
        return seen


def dispatch_order(shards: list) -> list:
    """The order shards are handed out in (a test reverses it: the table must not change)."""
    return shards


def sharded_pass(job: Sharded, seen: Seen, macs, planned) -> Seen:
    """The pass over the cluster at job.options.ray -> `seen` (the budget's Spend filled in by the driver)."""
    source, run = job.source, job.run
    if source.kind == "iterable":
        raise UsageError("--ray shards a data folder; a Python iterable of samples runs in this process")
    batches = _kept_batches(source, seen, macs, planned)
    threads = run.threads or min(os.cpu_count() or 1, 8)  # (collect's default, resolved here: the same plan)
    opening = Opening(_folder(source), source.kind, source.cfg,
                      job.options.sampling.batch, threads, run.cut, run.where)
    if not batches:
        return seen
    laps = Phases()  # (seen.phases: where the driver waited, for -v, --json and benchmarks/bench_ray.py)
    laps.lap("ray start")
    with ray_cluster(job.options.ray) as ray:
        actor = ray.remote(num_cpus=1, max_restarts=RETRIES, max_task_retries=RETRIES)(ShardWorker)
        model = put(job.model.SerializeToString())
        workers = [actor.remote(opening, job.targets) for _ in range(cpus())]
        nodes = set(gather([w.node.remote() for w in workers], "calibrate"))  # (started: the first slice timed apart)
        laps.lap("first slice")
        head = Shard(tuple(batches[0][:1] if run.cut and len(batches[0]) > 1 else batches[0]), Within())
        first = gather([workers[0].observe.remote(model, head)], "calibrate", nodes)[0]
        _progress(run, first)
        laps.lap("shards")
        folded, rest = _plan(batches, first.obs, run.cut, len(workers))
        got = _run_shards(workers, nodes, [(model, s) for s in folded + rest], run)
        laps.lap("ray stop")
    laps.lap("merge")
    seen = _fold(seen, [first] + got[:len(folded)], got[len(folded):])
    seen.phases = laps.stop()
    return seen


def _folder(source) -> str:
    files = list(source.files)
    return os.path.dirname(files[0]) if files else ""


def _kept_batches(source, seen: Seen, macs, planned) -> list:
    """The files of each batch one process would read, thinned to the budget as it would be (budget.py,
    told the first batch's MACs: that batch is read here)."""
    size = source.stream.batch if source.kind == "images" else source.batch
    files = [os.path.abspath(f) for f in source.files]  # (a worker on another node has another working directory)
    chunks = [files[i:i + size] for i in range(0, len(files), size)]
    head = next(iter(source.batches()), None)
    if head is None:
        return []

    def stream():
        yield head
        yield from ((c, None) for c in chunks[1:])

    return [[os.path.abspath(f) for f in c] for c, _ in
            within_budget(stream(), len(files), macs, seen.spend.budget_gmac, planned, spend=seen.spend)]


def _plan(batches: list, head, cut: bool, workers: int) -> tuple:
    """(the shards of the channel-means region, one slice each, after the first; the other shards, whole
    batches, a few per worker)."""
    sizes = iter(planned_slices([len(b) for b in batches], head.per_sample_bytes, head.lanes, cut))
    at = lambda first: Within(first, head.per_sample_bytes, slice_budget(head.lanes))
    folded, rest, first = [], [], 0
    for b in batches:
        if first < MEAN_SAMPLES:
            i = 0
            while i < len(b):
                n = next(sizes)
                folded.append(Shard(tuple(b[i:i + n]), at(first + i)))
                i += n
        else:
            rest.append(b)
        first += len(b)
    folded = folded[1:]  # (the first slice ran alone)
    per = max(1, -(-len(rest) // (workers * SHARDS_PER_WORKER)))
    start = sum(len(b) for b in batches) - sum(len(b) for b in rest)
    shards = []
    for k in range(0, len(rest), per):
        group = rest[k:k + per]
        shards.append(Shard(tuple(f for b in group for f in b), at(start)))
        start += sum(len(b) for b in group)
    return folded, shards


def _run_shards(workers: list, nodes: set, shards: list, run: Pass) -> list:
    """Each shard's Seen, in the order of `shards`; handed to whichever worker is free (two queued each)."""
    order = dispatch_order(list(range(len(shards))))
    results, pending, free = {}, {}, [w for w in workers for _ in range(2)]
    todo = list(order)
    while todo or pending:
        while todo and free:
            w, k = free.pop(0), todo.pop(0)
            pending[w.observe.remote(*shards[k])] = (k, w)
        done, _ = next_done(list(pending), nodes, "calibrate")
        k, w = pending.pop(done[0])
        results[k] = gather(done, "calibrate", nodes)[0]
        _progress(run, results[k])
        free.append(w)
    return [results[k] for k in range(len(shards))]


def _progress(run: Pass, seen: Seen) -> None:
    if run.progress is not None:
        run.progress(seen.obs.n_samples)


def _fold(seen: Seen, folded: list, rest: list) -> Seen:
    """The shards' statistics as one process adds them: the one-slice shards of the channel-means region
    into the lane the process would have dealt each to (slices in turn), the lanes one after another; then
    the other shards, whose channel sums are empty, in any order."""
    lanes = folded[0].obs.lanes
    lane = [None] * lanes
    for k, s in enumerate(folded):
        if lane[k % lanes] is None:
            lane[k % lanes] = s.obs
        else:
            lane[k % lanes].merge(s.obs)
    obs = lane[0]
    for o in lane[1:] + [s.obs for s in rest]:
        if o is not None:
            obs.merge(o)
    seen.obs = obs
    for s in folded + rest:
        seen.merge(s)
    return seen
