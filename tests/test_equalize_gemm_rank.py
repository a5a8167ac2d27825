"""Balancing a Gemm's output restores it with a per-channel Mul and Add shaped for a 2-D tensor, whatever
shape inference says: where it knew no size (minimol, every input free), they were [1, C, 1, 1] and the next
Gemm received a 4-D input (ORT: 'Input 0 expected to have rank 2 but has rank 4')."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from helpers import init, make_model, run, save
from qtool.api import calibrate, quantize
from qtool.quantize.options import QuantizeOptions


def _mlp(rng):
    w1 = rng.standard_normal((16, 12)) * np.geomspace(0.02, 8, 12)  # output channels 400x apart
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]), helper.make_node("HardSwish", ["h"], ["a"]),
             helper.make_node("Gemm", ["a", "w2", "b2"], ["y"])]
    inits = [init("w1", w1), init("b1", rng.standard_normal(12) * 0.1), init("w2", rng.standard_normal((12, 5))),
             init("b2", np.zeros(5))]
    return make_model(nodes, inits, [("x", ["N", 16])], [("y", ["N", 5])], opset=14)


def test_balanced_gemm_output_stays_2d_without_shape_inference(tmp_path, monkeypatch):
    from qtool import graph as G
    rng = np.random.default_rng(1)
    m = _mlp(rng)
    path = save(m, tmp_path / "mlp.onnx")
    d = tmp_path / "d"
    d.mkdir()
    for k in range(24):
        np.save(d / f"{k:02d}.npy", rng.standard_normal((1, 16)).astype(np.float32))
    calibrate(path, str(d), workdir=str(tmp_path / "w"))
    monkeypatch.setattr(G, "inferred_shapes", lambda *a, **k: {})  # (as for a model whose sizes are all free)
    q = quantize(str(tmp_path / "w"), QuantizeOptions(strict=True))
    assert "equalization" not in str(q.report["optional_steps"].get("fallbacks"))
    x = rng.standard_normal((8, 16)).astype(np.float32)
    ref = run(m, {"x": x})[0]
    got = run(onnx.load(q.path), {"x": x})[0]
    assert got.shape == ref.shape
