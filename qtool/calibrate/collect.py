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


MEAN_SAMPLES = 512  # per-channel means (for bias correction) settle long before this


def session(model: onnx.ModelProto | str, threads: int = 0, arena: bool = True) -> ort.InferenceSession:
    so = ort.SessionOptions()
    # without the arena, the large extra outputs of a calibration run are returned to the
    # system after each batch instead of pinning the peak for the whole run
    so.enable_cpu_mem_arena = arena
    so.intra_op_num_threads = threads or min(os.cpu_count() or 1, 8)
    so.log_severity_level = 3
    src = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def with_outputs(model: onnx.ModelProto, names: list) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for n in names:
        if n not in have:
            m.graph.output.append(helper.make_empty_tensor_value_info(n))
            have.add(n)
    return m


def collect(model: onnx.ModelProto, range_tensors: list, mean_tensors: list, batches, progress=None,
            threads: int = 0) -> Observed:
    """`batches` yields dicts input name -> array; `progress(k)` is told of k more samples."""
    wanted = list(dict.fromkeys(list(range_tensors) + list(mean_tensors)))
    sess = session(with_outputs(model, wanted), threads, arena=False)
    obs = Observed({t: Histogram() for t in range_tensors})
    graph_inputs = {i.name for i in sess.get_inputs()}
    # one worker folds batch i into the histograms while ONNX Runtime computes batch i + 1;
    # the native histogram code releases the GIL
    with ThreadPoolExecutor(1) as pool:
        pending = None
        for feeds in batches:
            feeds = {k: v for k, v in feeds.items() if k in graph_inputs}
            outs = sess.run(wanted, feeds)
            if pending is not None:
                pending.result()
            n = len(next(iter(feeds.values()))) if feeds else 0
            pending = pool.submit(_observe, obs, dict(zip(wanted, outs)), range_tensors, mean_tensors, n)
            if progress:
                progress(n)
        if pending is not None:
            pending.result()
    return obs


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
