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
from dataclasses import dataclass, replace

import numpy as np
import onnx

from qtool import graph as G
from qtool.calibrate import segments as S
from qtool.calibrate.bound_runner import BoundRunner
from qtool.calibrate.checks import OutputWatch
from qtool.calibrate.histogram import Histogram
from qtool.calibrate.observed import Observed, as_axes, channel_range, observe
from qtool.calibrate.segments import ShapesAt
from qtool.ortsession import session


# Observed outputs of the runs in flight stay under this (ONNX Runtime's working set comes on
# top), so large models calibrate in smaller slices of each batch rather than growing memory
# with batch size. ResNet-50 reads out 68 MB per image: two workers run one image each.
MAX_OUTPUT_BYTES = 160 << 20
WORKERS = 2  # runs in flight at once (see collect)


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
        segments, per_sample = _kept(run, ("plan", _shapes_key(run, head)), lambda: S.plan(model, targets.wanted(), head, run.shapes, run.cut))
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
    return 0 if per_sample_bytes <= S.GROUPED_ABOVE // WORKERS else 1 if per_sample_bytes <= S.GROUPED_ABOVE else 2


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


class _Worker:
    """One thread: runs its slices through the session (or the session of each group of tensors)
    into its own buffers, folds them into its own Observed."""

    def __init__(self, parts, targets: Targets, threads: int, progress):
        # (runner, segment, the tensors of targets.ranges it observes, those of targets.means), per segment
        self.parts = [(BoundRunner(sess, seg.outputs), seg, [t for t in targets.ranges if t in set(seg.observe)],
                       {t: a for t, a in as_axes(targets.means).items() if t in set(seg.observe)})
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
                        observe(self.obs, seen, ranges, means, n, first, pool)
                        for t in [t for t in seen if t in self.ranged]:  # (the segment's order: a set's
                            # order follows the hash seed, and the table would list channel_ranges in it)
                            self.obs.add_channel_range(t, *channel_range(seen[t]))
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

