"""Stream batches through the fp32 model and feed every observed tensor to its histogram.

The fused model gets the observed tensors as extra outputs and runs in ONNX Runtime;
memory holds one slice of activations per worker and one fixed-size histogram per tensor
and worker, whatever the number of images.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
from onnx import helper

from qtool import graph as G
from qtool.calibrate.checks import OutputWatch
from qtool.calibrate.histogram import Histogram, scan
from qtool.errors import QtoolError
from qtool.ortsession import session, with_outputs  # noqa: F401  (with_outputs: used by callers)


NONFINITE_NAMED = 10  # samples named per tensor with NaN/inf values (the count covers them all)


@dataclass
class Observed:
    histograms: dict = field(default_factory=dict)  # tensor -> Histogram
    channel_sums: dict = field(default_factory=dict)  # tensor -> float64 [C], of finite values
    channel_counts: dict = field(default_factory=dict)  # tensor -> int64 [C], finite values summed per channel
    channel_min: dict = field(default_factory=dict)  # tensor -> float64 [C] (the `ranged` tensors, axis 1)
    channel_max: dict = field(default_factory=dict)
    n_samples: int = 0
    watch: OutputWatch | None = None  # the first model output, summarised (checks.py)
    # NaN and inf are excluded from every statistic (min, max, histogram, channel means) and counted:
    nonfinite: dict = field(default_factory=dict)  # tensor -> number of NaN/inf values seen
    nonfinite_samples: dict = field(default_factory=dict)  # tensor -> sorted indices of the first samples holding them
    # how the pass ran, for a sharded pass (sharded.py) to cut and fold its shards as one process would:
    per_sample_bytes: int | None = None  # observed bytes per sample, as the first run measured them
    lanes: int = 1  # workers the samples were dealt to in turn (each sums its own channel sums: merge order)

    def channel_means(self) -> dict:
        return {t: (s / np.maximum(self.channel_counts[t], 1)).tolist() for t, s in self.channel_sums.items()}

    def add_channel_range(self, t: str, lo: np.ndarray, hi: np.ndarray) -> None:
        if t in self.channel_min:
            lo, hi = np.minimum(self.channel_min[t], lo), np.maximum(self.channel_max[t], hi)
        self.channel_min[t], self.channel_max[t] = lo, hi

    def channel_ranges(self) -> dict:
        return {t: [self.channel_min[t].tolist(), self.channel_max[t].tolist()] for t in self.channel_min}

    def add_nonfinite(self, t: str, count: int, samples) -> None:
        self.nonfinite[t] = self.nonfinite.get(t, 0) + int(count)
        self.nonfinite_samples[t] = sorted(set(self.nonfinite_samples.get(t, [])) | set(samples))[:NONFINITE_NAMED]

    def no_finite_value(self) -> list:
        """Tensors that held NaN/inf and not one finite value."""
        return [t for t in self.nonfinite if t in self.histograms and self.histograms[t].e is None]

    def merge(self, other: "Observed") -> None:
        """Add another worker's observations of the same tensors."""
        for t, h in other.histograms.items():
            self.histograms[t].merge(h)
        for t, sums in other.channel_sums.items():
            if t in self.channel_sums:
                self.channel_sums[t] = self.channel_sums[t] + sums
                self.channel_counts[t] = self.channel_counts[t] + other.channel_counts[t]
            else:
                self.channel_sums[t], self.channel_counts[t] = sums.copy(), other.channel_counts[t].copy()
        for t, c in other.nonfinite.items():
            self.add_nonfinite(t, c, other.nonfinite_samples.get(t, []))
        for t in other.channel_min:
            self.add_channel_range(t, other.channel_min[t], other.channel_max[t])
        self.n_samples += other.n_samples
        self.per_sample_bytes = self.per_sample_bytes or other.per_sample_bytes
        if self.watch is not None and other.watch is not None:
            self.watch.merge(other.watch)


# Observed outputs of the runs in flight stay under this (ONNX Runtime's working set comes on
# top), so large models calibrate in smaller slices of each batch rather than growing memory
# with batch size. ResNet-50 reads out 68 MB per image: two workers run one image each.
MAX_OUTPUT_BYTES = 160 << 20
WORKERS = 2  # runs in flight at once (see collect)
MEAN_SAMPLES = 128  # per-channel means (for bias correction): 128 images x every pixel settle them


@dataclass(frozen=True)
class Targets:
    """What the pass observes: `ranges` (a histogram each), `means` (channel sums of the first
    MEAN_SAMPLES samples: a list, channels on axis 1, or a dict tensor -> channel axis), `watch` (a float
    model output summarised per sample: Observed.watch, checks.OutputWatch) and `ranged` (tensors of
    `means`, channels on axis 1, whose per-channel min and max are kept too)."""
    ranges: list
    means: object
    watch: str | None = None
    ranged: tuple = ()

    def wanted(self) -> list:
        """Every tensor read out, once, in order."""
        return list(dict.fromkeys(list(self.ranges) + list(self.means) + ([self.watch] if self.watch else [])))


class ShapesAt:
    """Shape inference of a graph at a batch's input shapes, kept for the last shapes asked: the
    calibration budget (the first batch's MACs) and the plan of the pass (the first batch's observed
    bytes) read the same inference, of the whole graph with data propagation (0.1 s on MiniLM-L3 or
    PP-OCRv5 det; more on larger graphs). What it returns is shared: read it, never change it."""

    def __init__(self, model: onnx.ModelProto):
        self.model, self.key, self.shapes = model, None, None

    @staticmethod
    def inputs(feeds: dict) -> dict:
        return {k: np.shape(v) for k, v in feeds.items()}

    def __call__(self, feeds: dict) -> dict:
        key = self.inputs(feeds)
        if key != self.key:
            self.key, self.shapes = key, G.inferred_shapes(self.model, key)
        return self.shapes


@dataclass(frozen=True)
class Within:
    """A shard's place in the whole stream of a sharded pass (sharded.py): `first`, the index of its first
    sample (which blocks a histogram samples, which samples the channel means cover); `per_sample_bytes`, as
    the stream's first run measured them, and `slice_bytes`, the stream's budget of a slice (slice_budget):
    the shard's batches are then cut as the whole stream's were, without a lone first slice, whatever the
    shard's own workers."""
    first: int = 0
    per_sample_bytes: int | None = None
    slice_bytes: int | None = None


@dataclass(frozen=True)
class Pass:
    """How the pass runs. `progress(k)` is told of k more samples; `threads`: 0 for all cores (up to 8);
    `where` names the model in errors; `cut`: axis 0 of the feeds holds samples, which may be run in
    slices; False: each feed is one sample, run whole (a model whose axis 0 is the sample's own, time or
    nodes). `shapes`: the ShapesAt of the model, when the caller shares it. `within`: a shard's place in
    the whole stream of a sharded pass (sharded.py). `keep`: a dict the caller keeps across passes over one model (a shard worker's many shards), where the
    graph's plan and its sessions are kept, made once."""
    progress: object = None
    threads: int = 0
    where: str | None = None
    cut: bool = True
    shapes: ShapesAt | None = None
    within: Within = Within()
    keep: dict | None = None


def collect(model: onnx.ModelProto, targets: Targets, batches, run: Pass = Pass()) -> Observed:
    """`batches` yields dicts input name -> array; what is observed of them is `targets`, how the pass
    runs `run` (Pass).

    Two workers each run a slice through one shared session on their share of the threads,
    then fold its outputs into their own histograms, while the other worker does the same
    with the next slice. Against one run on every thread followed by folding on every thread
    (measured on ResNet-50, 2 cores, same process, interleaved: 1.65-1.69x plain inference
    against 1.51-1.54x), the cores stay busy while a worker folds; plain inference alone runs
    as fast either way (two single-threaded runs at once: 0.98x one run on both). Slices are dealt
    to the workers in turn, so which samples each histogram saw does not depend on timing;
    the workers' histograms merge exactly at the end.

    A model whose observed tensors for one sample exceed GROUPED_ABOVE (a 1280x1280 detector: 1.3 GB,
    a 960x1280 U-Net: 1.9 GB) runs in segments of its graph, one worker, each segment's tensors observed
    before the next runs: memory bounded, each node still run once."""
    run = replace(run, threads=run.threads or min(os.cpu_count() or 1, 8), shapes=run.shapes or ShapesAt(model))
    # name -> the size of axis 0 when fixed (a fixed batch is never cut into slices), else None
    graph_inputs = {i.name: (d[0] if d and isinstance(d[0], int) and d[0] > 0 else None)
                    for i in G.real_inputs(model) for d in [G.input_dims(i)]}
    stream = _Stream(iter(batches), graph_inputs, run.cut)
    obs, first = None, run.within.first
    head = stream.next_head()
    while True:
        # the graph is planned (whole or in segments) at the largest sample met so far: a later
        # sample beyond it ends the phase and the rest runs under a plan made at its size
        segments, per_sample = _kept(run, ("plan", _shapes_key(run, head)), lambda: _segments(model, targets.wanted(), head, run))
        stream.plan(head, per_sample)
        workers = WORKERS if run.threads >= WORKERS and _level(per_sample) == 0 else 1
        phase = _Phase(targets, run, graph_inputs, segments, workers)
        got, first = _collect_phase(phase, itertools.chain([] if head is None else [head], stream), first)
        if obs is None:
            obs = got
        else:
            obs.merge(got)
        head = stream.replan
        if head is None:
            return obs


class _Stream:
    """The batches, handed on until one whose samples are larger than the plan's (GROW times its
    input values per sample) would need another plan (_level); that one is kept in `replan`.
    (Samples grow their activations about as their inputs: images, sequences.)"""
    GROW = 1.5

    def __init__(self, batches, graph_inputs: dict, cut: bool):
        self.batches, self.graph_inputs, self.cut = batches, graph_inputs, cut
        self.planned = self.planned_bytes = 0
        self.replan = None

    def values_per_sample(self, feeds: dict) -> float:
        arrays = [np.asarray(v) for k, v in feeds.items() if k in self.graph_inputs and np.asarray(v).dtype.kind in "biuf"]
        rows = len(arrays[0]) if self.cut and arrays and arrays[0].ndim and len(arrays[0]) else 1
        return sum(a.size for a in arrays) / rows

    def next_head(self):
        return next(self.batches, None)

    def plan(self, head, per_sample_bytes: int) -> None:
        self.replan = None
        self.planned = self.values_per_sample(head) if head is not None else 0
        self.planned_bytes = per_sample_bytes

    def __iter__(self):
        for feeds in self.batches:
            grow = self.values_per_sample(feeds) / max(self.planned, 1)
            if grow > self.GROW and (_level(self.planned_bytes) == 2 or
                                     _level(self.planned_bytes * grow) > _level(self.planned_bytes)):
                self.replan = feeds
                return
            yield feeds


def _kept(run: Pass, key: tuple, make):
    """make(), or what it made for `key` before when the caller keeps it (Pass.keep)."""
    if run.keep is None:
        return make()
    if key not in run.keep:
        run.keep[key] = make()
    return run.keep[key]


def _shapes_key(run: Pass, feeds) -> tuple | None:
    """What a kept plan is made for: the inputs' shapes per sample (a shard of one slice and a shard of
    whole batches share the plan, and its sessions), or whole where axis 0 is not the samples'."""
    if feeds is None:
        return None
    return tuple(sorted((k, v[1:] if run.cut else v) for k, v in run.shapes.inputs(feeds).items()))


def _level(per_sample_bytes: int) -> int:
    """The plan for samples observing this many bytes each: 0 the whole graph, two workers (each holds
    its sample's tensors: a 640x640 YOLOv8x classifier's 769 MB twice took calibrate to 3.4 GB); 1 the
    whole graph, one worker; 2 segments of the graph, one worker."""
    return 0 if per_sample_bytes <= GROUPED_ABOVE // WORKERS else 1 if per_sample_bytes <= GROUPED_ABOVE else 2


@dataclass(frozen=True)
class _Phase:
    """One plan of the pass: the graph `segments` run by `n_workers` workers, until the stream ends or
    asks for another plan."""
    targets: Targets
    run: Pass
    graph_inputs: dict  # name -> the size of axis 0 when fixed, else None
    segments: list
    n_workers: int


def _collect_phase(phase: _Phase, batches, first: int) -> tuple:
    """Runs `batches` under one plan -> (Observed, index of the next sample)."""
    workers = _start_workers(phase)
    try:
        first = _deal(phase, workers, batches, first)
    except _WorkerFailed:
        pass  # the worker's own exception is raised below
    finally:
        for w in workers:
            w.stop()
    for w in workers:
        w.raise_error()
    obs = workers[0].obs
    for w in workers[1:]:
        obs.merge(w.obs)
    obs.per_sample_bytes, obs.lanes = _measured(phase, workers), phase.n_workers
    return obs, first


def _measured(phase: _Phase, workers: list):
    """Observed bytes per sample: as a worker's first run measured them, else as the pass was told."""
    return next((w.per_sample_bytes for w in workers if w.per_sample_bytes), None) or phase.run.within.per_sample_bytes


def _start_workers(phase: _Phase) -> list:
    """A session per segment, shared by the workers, each given its share of the threads."""
    per_worker = max(1, phase.run.threads // phase.n_workers)
    # segments run one after another: one arena for all holds one segment's peak, where an arena each
    # would pin every segment's peak at once (CRAFT at 960x1280: 6.9 GB)
    arena = True if len(phase.segments) == 1 else "shared"
    sessions = _kept(phase.run, ("sessions", id(phase.segments), per_worker),
                     lambda: [session(seg.model, per_worker, arena=arena, spin=False, where=phase.run.where)
                              for seg in phase.segments])
    workers = [_Worker(list(zip(sessions, phase.segments)), phase.targets, per_worker, phase.run.progress)
               for _ in range(phase.n_workers)]
    for w in workers:
        w.start()
    return workers


def _deal(phase: _Phase, workers: list, batches, first: int) -> int:
    """The batches, in slices, to the workers in turn -> the index of the next sample."""
    n_workers, cut = phase.n_workers, phase.run.cut
    per_sample = lambda: _measured(phase, workers)
    slices = _slices(batches, phase.graph_inputs, per_sample, phase.run.within.slice_bytes or slice_budget(n_workers)) \
        if cut else \
        ({k: v for k, v in f.items() if k in phase.graph_inputs} for f in batches)
    for k in itertools.count():
        if k == 1 and phase.run.within.per_sample_bytes is None:
            # the first slice goes alone: its run measures the output size per sample,
            # which sizes every later slice
            workers[0].wait_idle()
        feeds = next(slices, None)
        if feeds is None:
            return first
        n = (len(next(iter(feeds.values()))) if feeds else 0) if cut else 1
        workers[k % n_workers].put((first, n, feeds), workers)
        first += n


GROUPED_ABOVE = 1 << 30  # observed bytes per sample beyond which the graph is run in segments
GROUP_BYTES = 384 << 20  # observed bytes per sample a segment writes out, about


@dataclass
class _Segment:
    """A run of the graph's nodes, a session of its own: it reads `inputs` from the values carried
    along (the samples' inputs, what earlier segments wrote), writes `outputs` (the observed tensors
    it computes, and what later segments read), after which `observe` is observed and `drop` dropped."""
    model: bytes
    inputs: list
    outputs: list
    observe: list
    drop: list = field(default_factory=list)


def _segments(model: onnx.ModelProto, wanted: list, feeds: dict | None, run: Pass) -> tuple:
    """The whole graph as one segment reading out `wanted`, or, when one sample's values of them exceed
    GROUPED_ABOVE, its nodes (in graph order) cut into segments that each write about GROUP_BYTES of
    them: each node runs once, and only one segment's values and the tensors crossing the cuts are
    held. Sizes from shape inference at the batch's input shapes (run.shapes); a tensor of unknown size
    counts as the largest known one. -> (segments, the observed bytes per sample at these shapes)"""
    if not feeds:
        return [_Segment(with_outputs(model, wanted), [], wanted, wanted)], 0
    # inferred at the batch's own shapes, one sample's share taken after: at one row, onnx's data propagation
    # aborted the process (a std::clamp assertion) on madmom's onsets CNN, whose axis 0 is time
    shapes = run.shapes(feeds)
    rows = max(1, len(next(iter(feeds.values())))) if run.cut and np.ndim(next(iter(feeds.values()))) else 1
    size = {t: 4 * int(np.prod(shapes[t])) // rows for t in wanted if shapes.get(t) is not None and all(shapes[t])}
    big = max(size.values(), default=0)
    total = sum(size.get(t, big) for t in wanted)
    if total <= GROUPED_ABOVE:  # (the whole graph serialized only now: a cut graph never needs it)
        return [_Segment(with_outputs(model, wanted), [], wanted, wanted)], total
    return _cut(model, wanted, lambda t: size.get(t, big)), total


def _cut(model: onnx.ModelProto, wanted: list, size) -> list:
    """The graph's nodes, in order, as segments each writing about GROUP_BYTES of `wanted` (`size(t)`:
    a tensor's bytes per sample)."""
    from qtool.plan import elem_types
    nodes = G.topological_order(model)
    want = set(wanted)
    cuts, used = [0], 0
    for k, n in enumerate(nodes):
        out = sum(size(o) for o in n.output if o in want)
        if used and used + out > GROUP_BYTES:
            cuts.append(k)
            used = 0
        used += out
    cuts.append(len(nodes))
    reads = [G.node_reads(n) for n in nodes]
    inits = {t.name: t for t in model.graph.initializer}
    types = elem_types(model)
    graph_inputs = [i.name for i in G.real_inputs(model)]
    segs = []
    for a, b in zip(cuts, cuts[1:]):
        made = {o for n in nodes[a:b] for o in n.output if o}
        later = set().union(*reads[b:]) if b < len(nodes) else set()
        ins = sorted(set().union(*reads[a:b]) - made - set(inits))
        outs = [t for t in wanted if t in made] + sorted((made & later) - want)
        seen = set(graph_inputs) if a == 0 else set()
        g = helper.make_graph(nodes[a:b], f"segment{len(segs)}",
                              [helper.make_tensor_value_info(t, types.get(t, onnx.TensorProto.FLOAT), None) for t in ins],
                              [helper.make_empty_tensor_value_info(t) for t in outs],
                              [inits[t] for t in sorted(set().union(*reads[a:b]) & set(inits))])
        m = helper.make_model(g, opset_imports=model.opset_import)
        m.ir_version = max(model.ir_version, 8)
        segs.append(_Segment(m.SerializeToString(), ins, outs, [t for t in wanted if t in made or t in seen & want]))
    for k, seg in enumerate(segs):  # what no later segment reads goes once this one is done
        ahead = set().union(*(s.inputs for s in segs[k + 1:])) if k + 1 < len(segs) else set()
        seg.drop = [t for t in seg.outputs + seg.inputs if t not in ahead]
    return segs


class _Worker:
    """One thread: runs its slices through the session (or the session of each group of tensors)
    into its own buffers, folds them into its own Observed."""

    def __init__(self, parts, targets: Targets, threads: int, progress):
        # (runner, segment, the tensors of targets.ranges it observes, those of targets.means), per segment
        self.parts = [(_BoundRunner(sess, seg.outputs), seg, [t for t in targets.ranges if t in set(seg.observe)],
                       {t: a for t, a in _as_axes(targets.means).items() if t in set(seg.observe)})
                      for sess, seg in parts]
        self.ranged = set(targets.ranged)
        self.obs = Observed({t: Histogram() for t in targets.ranges},
                            watch=OutputWatch(targets.watch) if targets.watch else None)
        self.threads, self.progress = threads, progress
        self.queue = queue.Queue(maxsize=1)
        self.error = None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    @property
    def per_sample_bytes(self):
        known = [r.per_sample_bytes for r, *_ in self.parts if r.per_sample_bytes]  # (per segment: the largest)
        return max(known) if known else None

    def start(self):
        self.thread.start()

    def put(self, item, everyone):
        while True:
            for w in everyone:
                if w.error is not None:
                    raise _WorkerFailed()
            try:
                self.queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def wait_idle(self):
        """Until this worker has finished everything it was given (or failed)."""
        while self.error is None and self.queue.unfinished_tasks:
            time.sleep(0.005)

    def stop(self):
        # the worker takes every item until it sees None (after a failure it only drains),
        # so the put goes through once the slice ahead of it is done, however long that takes
        while self.thread.is_alive():
            try:
                self.queue.put(None, timeout=0.1)
                break
            except queue.Full:
                continue
        self.thread.join()

    def raise_error(self):
        if self.error is not None:
            raise self.error

    def _loop(self):
        pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        try:
            while True:
                item = self.queue.get()
                try:
                    if item is None:
                        return
                    if self.error is not None:
                        continue  # failed: drain until told to stop
                    first, n, feeds = item
                    values = dict(feeds)  # (the samples' inputs, then what the segments write)
                    for runner, seg, ranges, means in self.parts:
                        values.update(zip(seg.outputs, runner.run({t: values[t] for t in seg.inputs} if seg.inputs
                                                                  else feeds)))
                        seen = {t: values[t] for t in seg.observe}
                        if self.obs.watch is not None and self.obs.watch.name in seen:
                            self.obs.watch.observe(seen[self.obs.watch.name], first)
                        _observe(self.obs, seen, ranges, means, n, first, pool)
                        for t in [t for t in seen if t in self.ranged]:  # (the segment's order: a set's
                            # order follows the hash seed, and the table would list channel_ranges in it)
                            self.obs.add_channel_range(t, *_channel_range(seen[t]))
                        del seen
                        for t in seg.drop:  # (a segment's values go before the next segment's come)
                            values.pop(t, None)
                    del values
                    self.obs.n_samples += n
                    if self.progress:
                        with _PROGRESS_LOCK:
                            self.progress(n)
                except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
                    self.error = e
                finally:
                    self.queue.task_done()
        finally:
            if pool is not None:
                pool.shutdown()


class _WorkerFailed(Exception):
    """A worker stopped with an error; collect re-raises the worker's own exception."""


_PROGRESS_LOCK = threading.Lock()


class _BoundRunner:
    """Runs the session into output buffers allocated once per batch size.

    Letting ONNX Runtime allocate fresh outputs for every run costs more than the
    inference itself when dozens of activations are read out (allocation, page faults,
    copies); bound buffers are written in place. The first run, and any whose outputs
    do not scale with the batch, goes the ordinary way."""

    def __init__(self, sess, names: list):
        self.sess, self.names = sess, names
        self.shapes = {}  # per-sample input shapes -> per-sample output shapes (None: not batch-major)
        self.per_sample_bytes = None
        self.bufs = {}  # (input shapes, batch) -> (io_binding, [arrays])

    def run(self, feeds: dict) -> list:
        n = len(next(iter(feeds.values()))) if feeds else 1
        sig = tuple((k, np.shape(v)[1:]) for k, v in sorted(feeds.items()))
        if sig not in self.shapes:
            outs = self.sess.run(self.names, feeds)
            # (a sequence output, SplitToSequence's or an If's, comes back as a list of arrays)
            # (the largest of the input shapes met: a larger image later must not overfill the slices)
            self.per_sample_bytes = max(self.per_sample_bytes or 0,
                                        max(1, sum(getattr(o, "nbytes", 0) for o in outs) // max(n, 1)))
            if n < 2:
                # one sample tells nothing: a transformer's position embeddings are [1, T, C] whatever the batch
                return outs
            batch_major = all(isinstance(o, np.ndarray) and o.ndim >= 1 and o.shape[0] == n for o in outs)
            self.shapes[sig] = [o.shape[1:] for o in outs] if batch_major else None
            return outs
        if self.shapes[sig] is None or any(np.asarray(v).dtype.kind in "OSU" for v in feeds.values()):
            # (ONNX Runtime binds no string tensor: a model that takes text runs the ordinary way)
            return self.sess.run(self.names, feeds)
        key = (sig, n)
        fresh = key not in self.bufs
        if fresh:
            if len(self.bufs) >= 2:  # a new batch size or image size: drop the old buffers
                self.bufs.clear()
            arrays = [None if name in feeds else np.empty((n,) + tuple(sh), np.float32)
                      for name, sh in zip(self.names, self.shapes[sig])]
            io = self.sess.io_binding()
            for name, arr in zip(self.names, arrays):
                if arr is not None:  # a model input read back as an output is served from the feed
                    io.bind_output(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)
                else:
                    io.bind_output(name, "cpu")
            self.bufs[key] = [io, arrays, set()]
        io, arrays, fetch = self.bufs[key]
        for name, value in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(value))
        try:
            self.sess.run_with_iobinding(io)
        except QtoolError:
            # an output whose length the data decides (a Loop that stops at an end token: SLANet's
            # decoder) no longer fits the buffer the first batch sized: ordinary runs from here on
            self.shapes[sig] = None
            self.bufs.clear()
            return self.sess.run(self.names, feeds)
        if fresh:
            # ONNX Runtime may hand back its own tensor instead of filling a bound buffer:
            # those outputs are read from the binding on every run
            for i, (ov, arr) in enumerate(zip(io.get_outputs(), arrays)):
                if arr is not None and ov.data_ptr() != arr.ctypes.data:
                    fetch.add(i)
        if not fetch:
            return [feeds[nm] if a is None else a for nm, a in zip(self.names, arrays)]
        got = io.get_outputs()
        return [feeds[nm] if a is None else (got[i].numpy() if i in fetch else a)
                for i, (nm, a) in enumerate(zip(self.names, arrays))]


def _slices(batches, graph_inputs: dict, per_sample, budget: int = MAX_OUTPUT_BYTES):
    """Each batch as it comes, or in slices along axis 0 once a whole batch's outputs would
    exceed `budget` bytes. Until a run has measured the outputs per sample (`per_sample()`
    is None), slices hold one sample: a first run on a whole batch of a large model would
    set the memory peak for the whole calibration. An input whose axis 0 has a fixed size
    (`graph_inputs`: name -> that size, or None when dynamic) is never cut.
    Slices are copies: the caller may refill its arrays while a worker still holds a slice."""
    for feeds in batches:
        feeds = {k: v for k, v in feeds.items() if k in graph_inputs}
        n = len(next(iter(feeds.values()))) if feeds else 0
        short = [k for k in feeds if isinstance(graph_inputs[k], int) and np.ndim(feeds[k]) and len(feeds[k]) != graph_inputs[k]]
        if short:  # the last, partial batch of a model whose batch is fixed: it cannot run
            warnings.warn(f"the model takes exactly {graph_inputs[short[0]]} samples at a time: the last {n} are "
                          f"left out", stacklevel=2)
            continue
        if (n <= 1 or any(np.ndim(v) == 0 or len(v) != n for v in feeds.values())
                or any(isinstance(graph_inputs[k], int) for k in feeds)):
            yield {k: np.array(v) for k, v in feeds.items()}
            continue
        i = 0
        while i < n:
            step = _step(n - i, per_sample(), budget)
            yield {k: np.array(v[i:i + step]) for k, v in feeds.items()}
            i += step


def slice_budget(workers: int) -> int:
    """The bytes a slice may read out when `workers` run slices at once."""
    return MAX_OUTPUT_BYTES // workers


def _step(left: int, per_sample: int | None, budget: int) -> int:
    """Samples in the next slice of a batch with `left` samples to go."""
    return 1 if not per_sample else left if left * per_sample <= budget else max(1, budget // per_sample)


def planned_slices(batch_sizes: list, per_sample: int, lanes: int, cut: bool) -> list:
    """The slice sizes collect cuts batches of `batch_sizes` samples into (each batch's in turn), when its
    first run measured `per_sample` bytes and it deals to `lanes` workers; `cut`: as Pass.cut, and no input
    of a fixed batch. What a sharded pass (sharded.py) plans its shards by, to fold them as collect would."""
    sizes = []
    for b, n in enumerate(batch_sizes):
        i = 0
        while i < n:
            step = n - i if not cut or n <= 1 else 1 if b == 0 and i == 0 else _step(n - i, per_sample,
                                                                                     slice_budget(lanes))
            sizes.append(step)
            i += step
    return sizes


def _observe(obs: Observed, values: dict, range_tensors: list, mean_tensors: list, n: int, first: int,
             pool=None) -> None:
    """Fold one run's outputs (samples first .. first + n - 1 of the stream) into the histograms
    and, while first < MEAN_SAMPLES, the channel sums. Tensors are independent, so `pool` may
    fold several at once: the native code releases the GIL."""
    means = set(mean_tensors) if first < MEAN_SAMPLES else set()
    todo = list(dict.fromkeys([t for t in range_tensors] + [t for t in mean_tensors if t in means]))
    todo.sort(key=lambda t: -np.size(values[t]))  # largest first: the workers finish together
    axes = _as_axes(mean_tensors)
    jobs = [(obs.histograms.get(t), t, values[t], n, axes[t] if t in means else None, first) for t in todo]
    for t, sums, count, bad in (pool.map(_observe_one, *zip(*jobs)) if pool and jobs else
                                (_observe_one(*j) for j in jobs)):
        if bad is not None:
            obs.add_nonfinite(t, *bad)
        if sums is None:
            continue
        if t not in obs.channel_sums:
            obs.channel_sums[t] = np.zeros(sums.size, np.float64)
            obs.channel_counts[t] = np.zeros(sums.size, np.int64)
        obs.channel_sums[t] += sums
        obs.channel_counts[t] += count


def _channel_range(v: np.ndarray) -> tuple:
    """(min, max) per channel (axis 1) of the finite values, float64 [C] each."""
    v = np.asarray(v, np.float32)
    axes = tuple(k for k in range(v.ndim) if k != 1)
    lo, hi = v.min(axis=axes).astype(np.float64), v.max(axis=axes).astype(np.float64)
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        fin = np.isfinite(v)
        lo = np.where(fin, v, np.inf).min(axis=axes).astype(np.float64)
        hi = np.where(fin, v, -np.inf).max(axis=axes).astype(np.float64)
        lo, hi = np.where(np.isfinite(lo), lo, 0.0), np.where(np.isfinite(hi), hi, 0.0)
    return lo, hi


def _as_axes(mean_tensors) -> dict:
    """{tensor: channel axis} of mean tensors given as that dict or as a plain list (axis 1)."""
    return dict(mean_tensors) if isinstance(mean_tensors, dict) else {t: 1 for t in mean_tensors}


def _observe_one(hist: Histogram | None, t: str, v, n: int, axis: int | None, first: int):
    """One tensor: a single read gives min, max and (when asked: the channel `axis`, 1 or -1) the
    channel sums; then the histogram counts its sampled blocks. NaN and inf (rare: the read says whether
    there are any) are counted, with the samples they are in, and left out of the sums and the histogram.
    -> (t, channel sums, finite values per channel, (NaN/inf count, sample indices) or None)"""
    v = np.ascontiguousarray(v, np.float32)
    sums = count = bad = None
    if axis is not None and v.ndim >= 2 and v.size:
        c = v.shape[axis]
        sums = np.zeros(c, np.float64)
        count = np.full(c, v.size // c, np.int64)
        # each run of `inner` contiguous values belongs to one channel, channels in turn
        scanned = scan(v, 1 if axis in (-1, v.ndim - 1) else v.size // (v.shape[0] * c), sums)
    else:
        scanned = scan(v)
    if not scanned[2] and v.size:
        fin = np.isfinite(v)
        per = (~fin).reshape(n, -1).sum(axis=1) if v.ndim and v.shape[0] == n and n else None
        where = [first + int(j) for j in np.flatnonzero(per)] if per is not None else [first]
        bad = (int(v.size - np.count_nonzero(fin)), where)
        if sums is not None:  # the sums again, of the finite values only
            c = v.shape[axis]
            fv = np.moveaxis(np.where(fin, v, np.float32(0)), axis, -1).reshape(-1, c)
            sums = fv.sum(axis=0, dtype=np.float64)
            count = np.moveaxis(fin, axis, -1).reshape(-1, c).sum(axis=0).astype(np.int64)
    if hist is not None:
        hist.observe(v, n, scanned, first_sample=first)
    return t, sums, count, bad
