"""Shared by tests/test_rules_*.py: calibrate a tiny model from random tensors, quantize it, compare in ORT."""
from __future__ import annotations

import warnings

import numpy as np
import onnx

from helpers import run, save
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions
from qtool.quantize.qdq import quantize_graph
from qtool.quantize.qdq import BuildOptions


def sqnr(ref, out):
    ref, out = ref.astype(np.float64), out.astype(np.float64)
    return 10 * np.log10((ref ** 2).sum() / max(((ref - out) ** 2).sum(), 1e-30))


def quantize_tiny(model, tmp_path, shapes, n=4, seed=0, method="minmax", dynamic=frozenset()):
    """(QuantizeOutput, decisions by node name, feeds of one held-out sample); `dynamic`: layers reading their
    input at run time."""
    rng = np.random.default_rng(seed)
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(n + 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = calibrate(save(model, tmp_path / "m.onnx"), data[:n],
                      CalibrateOptions(method=method, threads=1, show_progress=False), workdir=str(tmp_path / "w"))
    out = quantize_graph(r.fused, r.table, BuildOptions(method=method, dynamic=frozenset(dynamic)))
    onnx.checker.check_model(out.model)
    return out, {d.name: d for d in out.plan.decisions}, data[n]


def output_sqnr(before, after, feeds):
    return sqnr(run(before, feeds)[0], run(after, feeds)[0])
