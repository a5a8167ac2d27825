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

from qtool.calibrate.histogram import Histogram


@dataclass
class Observed:
    histograms: dict = field(default_factory=dict)  # tensor -> Histogram
    channel_sums: dict = field(default_factory=dict)  # tensor -> float64 [C]
    channel_counts: dict = field(default_factory=dict)  # tensor -> number of values summed per channel
    n_samples: int = 0

    def channel_means(self) -> dict:
        return {t: (s / max(self.channel_counts[t], 1)).tolist() for t, s in self.channel_sums.items()}


# Observed outputs of one run stay under this: about three sets are alive at once (the run in
# progress, the one being folded into histograms, ONNX Runtime's own), so large models
# calibrate in smaller slices of each batch rather than growing memory with batch size.
MAX_OUTPUT_BYTES = 96 << 20
MEAN_SAMPLES = 512  # per-channel means (for bias correction) settle long before this


def session(model: onnx.ModelProto | str | bytes, threads: int = 0, arena: bool = True) -> ort.InferenceSession:
    so = ort.SessionOptions()
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
    sess = session(with_outputs(model, wanted), threads, arena=False)
    obs = Observed({t: Histogram() for t in range_tensors})
    graph_inputs = {i.name for i in sess.get_inputs()}
    # one worker folds batch i into the histograms while ONNX Runtime computes batch i + 1;
    # the native histogram code releases the GIL
    per_sample = None  # bytes of observed outputs per sample, known after the first run
    with ThreadPoolExecutor(1) as pool:
        pending = None
        for feeds in _slices(batches, graph_inputs, lambda: per_sample):
            outs = sess.run(wanted, feeds)
            n_run = len(next(iter(feeds.values()))) if feeds else 1
            per_sample = per_sample or max(1, sum(o.nbytes for o in outs) // max(n_run, 1))
            if pending is not None:
                pending.result()
            n = len(next(iter(feeds.values()))) if feeds else 0
            pending = pool.submit(_observe, obs, dict(zip(wanted, outs)), range_tensors, mean_tensors, n)
            if progress:
                progress(n)
        if pending is not None:
            pending.result()
    return obs


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


def _observe(obs: Observed, values: dict, range_tensors: list, mean_tensors: list, n: int) -> None:
    for t in range_tensors:
        obs.histograms[t].observe(values[t], n)
    for t in mean_tensors if obs.n_samples < MEAN_SAMPLES else ():
        v = np.asarray(values[t], np.float32)
        if v.ndim < 2:
            continue
        if t not in obs.channel_sums:
            obs.channel_sums[t] = np.zeros(v.shape[1], np.float64)
            obs.channel_counts[t] = 0
        # sum along the contiguous spatial axis first: one fast pass instead of a strided reduction
        obs.channel_sums[t] += v.reshape(v.shape[0], v.shape[1], -1).sum(axis=2, dtype=np.float64).sum(axis=0)
        obs.channel_counts[t] += v.size // v.shape[1]
    obs.n_samples += n
