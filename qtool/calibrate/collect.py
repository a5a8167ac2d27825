"""Stream batches through the fp32 model and feed every observed tensor to its histogram.

The fused model gets the observed tensors as extra outputs and runs in ONNX Runtime;
memory holds one batch of activations and one fixed-size histogram per tensor,
whatever the number of images.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from qtool.calibrate.histogram import Histogram, scan


@dataclass
class Observed:
    histograms: dict = field(default_factory=dict)  # tensor -> Histogram
    channel_sums: dict = field(default_factory=dict)  # tensor -> float64 [C]
    channel_counts: dict = field(default_factory=dict)  # tensor -> number of values summed per channel
    n_samples: int = 0

    def channel_means(self) -> dict:
        return {t: (s / max(self.channel_counts[t], 1)).tolist() for t, s in self.channel_sums.items()}


# Observed outputs of one run stay under this (ONNX Runtime's working set comes on top), so
# large models calibrate in smaller slices of each batch rather than growing memory with
# batch size. ResNet-50 reads out 68 MB per image: slices of two images ran ~10 % faster than
# single images and peak at 1.3 GB over 1000 images; four images peaked at 1.8 GB.
MAX_OUTPUT_BYTES = 160 << 20
MEAN_SAMPLES = 128  # per-channel means (for bias correction): 128 images x every pixel settle them


def session(model: onnx.ModelProto | str | bytes, threads: int = 0, arena: bool = True,
            spin: bool = True) -> ort.InferenceSession:
    so = ort.SessionOptions()
    if not spin:
        # idle ORT workers spin by default, taking the core that the histogram thread needs
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # without the arena, the large extra outputs of a calibration run are returned to the
    # system after each batch instead of pinning the peak for the whole run
    so.enable_cpu_mem_arena = arena
    so.intra_op_num_threads = threads or min(os.cpu_count() or 1, 8)
    so.log_severity_level = 3
    src = model if isinstance(model, (str, bytes)) else model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def with_outputs(model: onnx.ModelProto, names: list) -> bytes:
    """The serialized model with `names` as extra outputs. The outputs are appended to the
    model itself only while it is serialized: no second copy of the weights in memory."""
    have = {o.name for o in model.graph.output}
    added = [n for n in dict.fromkeys(names) if n not in have]
    n0 = len(model.graph.output)
    model.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in added)
    try:
        return model.SerializeToString()
    finally:
        del model.graph.output[n0:]


def collect(model: onnx.ModelProto, range_tensors: list, mean_tensors: list, batches, progress=None,
            threads: int = 0) -> Observed:
    """`batches` yields dicts input name -> array; `progress(k)` is told of k more samples."""
    wanted = list(dict.fromkeys(list(range_tensors) + list(mean_tensors)))
    threads = threads or min(os.cpu_count() or 1, 8)
    sess = session(with_outputs(model, wanted), threads, arena=True, spin=False)
    obs = Observed({t: Histogram() for t in range_tensors})
    graph_inputs = {i.name for i in sess.get_inputs()}
    runner = _BoundRunner(sess, wanted)
    # Inference and statistics take turns, each with every core: folding one batch while
    # ONNX Runtime computes the next puts a third thread on the cores, and ORT's parallel
    # loops stall whenever one of their threads is descheduled (slower on this 2-vCPU machine
    # under load; on an idle machine both orders measured about 1.8x plain inference, the
    # tapped ORT run itself being ~1.5x: see the calibration-time note on issue 2).
    with ThreadPoolExecutor(threads) as pool:
        for feeds in _slices(batches, graph_inputs, lambda: runner.per_sample_bytes):
            outs = runner.run(feeds)
            n = len(next(iter(feeds.values()))) if feeds else 0
            _observe(obs, dict(zip(wanted, outs)), range_tensors, mean_tensors, n, pool if threads > 1 else None)
            if progress:
                progress(n)
    return obs


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
            self.per_sample_bytes = self.per_sample_bytes or max(1, sum(o.nbytes for o in outs) // max(n, 1))
            batch_major = all(o.ndim >= 1 and o.shape[0] == n for o in outs)
            self.shapes[sig] = [o.shape[1:] for o in outs] if batch_major else None
            return outs
        if self.shapes[sig] is None:
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
        self.sess.run_with_iobinding(io)
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


def _slices(batches, graph_inputs, per_sample):
    """Each batch as it comes, or in slices along axis 0 once a whole batch's outputs would
    exceed MAX_OUTPUT_BYTES."""
    for feeds in batches:
        feeds = {k: v for k, v in feeds.items() if k in graph_inputs}
        n = len(next(iter(feeds.values()))) if feeds else 0
        ps = per_sample()
        step = n if not ps or n * ps <= MAX_OUTPUT_BYTES else max(1, MAX_OUTPUT_BYTES // ps)
        if step >= n or any(np.ndim(v) == 0 or len(v) != n for v in feeds.values()):
            yield feeds
            continue
        for i in range(0, n, step):
            yield {k: v[i:i + step] for k, v in feeds.items()}


def _observe(obs: Observed, values: dict, range_tensors: list, mean_tensors: list, n: int, pool=None) -> None:
    """Fold one run's outputs into the histograms (and, for the first MEAN_SAMPLES samples, the
    channel sums). Tensors are independent, so `pool` may fold several at once: the native
    code releases the GIL."""
    means = set(mean_tensors) if obs.n_samples < MEAN_SAMPLES else set()
    todo = list(dict.fromkeys([t for t in range_tensors] + [t for t in mean_tensors if t in means]))
    todo.sort(key=lambda t: -np.size(values[t]))  # largest first: the workers finish together
    jobs = [(obs.histograms.get(t), t, values[t], n, t in means) for t in todo]
    for t, sums, count in (pool.map(_observe_one, *zip(*jobs)) if pool and jobs else
                           (_observe_one(*j) for j in jobs)):
        if sums is None:
            continue
        if t not in obs.channel_sums:
            obs.channel_sums[t] = np.zeros(sums.size, np.float64)
            obs.channel_counts[t] = 0
        obs.channel_sums[t] += sums
        obs.channel_counts[t] += count
    obs.n_samples += n


def _observe_one(hist: Histogram | None, t: str, v, n: int, mean: bool):
    """One tensor: a single read gives min, max and (when asked) the channel sums; then the
    histogram counts its sampled blocks."""
    v = np.ascontiguousarray(v, np.float32)
    sums = count = None
    if mean and v.ndim >= 2 and v.size:
        sums = np.zeros(v.shape[1], np.float64)
        count = v.size // v.shape[1]
        scanned = scan(v, v.size // (v.shape[0] * v.shape[1]), sums)
    else:
        scanned = scan(v) if hist is not None else None
    if hist is not None:
        hist.observe(v, n, scanned)
    return t, sums, count
