"""An Add whose inputs cancel stays fp32 (rules/add.py): its inputs' uint8 steps, set by their wide
ranges, would be a large part of the narrow sum."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from helpers import init, make_model, run, save
from qtool.api import calibrate, quantize
from qtool.quantize.options import QuantizeOptions


def _cancelling(rng):
    """u = x W (+-50), v = x W2 - u, y = u + v = x W2 (+-1), then a MatMul reading y."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["u"]), helper.make_node("MatMul", ["x", "w2"], ["z"]),
             helper.make_node("Sub", ["z", "u"], ["v"]), helper.make_node("Add", ["u", "v"], ["y"], name="cancel"),
             helper.make_node("MatMul", ["y", "w3"], ["out"])]
    inits = [init("w", rng.standard_normal((16, 16)) * 12), init("w2", rng.standard_normal((16, 16)) * 0.25),
             init("w3", rng.standard_normal((16, 4)))]
    return make_model(nodes, inits, [("x", ["N", 16])], [("out", ["N", 4])], opset=13)


def _sqnr(a, b):
    return 10 * np.log10(np.sum(a.astype(np.float64) ** 2) / np.sum((a.astype(np.float64) - b) ** 2))


def test_cancelling_add_stays_fp32(tmp_path, monkeypatch):
    from qtool.rules import add
    rng = np.random.default_rng(0)
    m = _cancelling(rng)
    path = save(m, tmp_path / "c.onnx")
    samples = [rng.standard_normal((4, 16)).astype(np.float32) for _ in range(8)]
    x = rng.standard_normal((64, 16)).astype(np.float32)
    ref = run(m, {"x": x})[0]
    calibrate(path, samples, workdir=str(tmp_path / "w"))
    q = quantize(str(tmp_path / "w"))
    d = {n["name"]: n for n in q.report["nodes"]}["cancel"]
    assert d["status"] == "fp32" and "cancel" in d["reason"]
    kept = _sqnr(ref, run(onnx.load(q.path), {"x": x})[0])
    monkeypatch.setattr(add, "MAX_CANCEL_RATIO", float("inf"))
    q2 = quantize(str(tmp_path / "w"), QuantizeOptions(output=str(tmp_path / "int8_all.onnx")))
    assert {n["name"]: n for n in q2.report["nodes"]}["cancel"]["status"] == "int8"
    assert kept > _sqnr(ref, run(onnx.load(q2.path), {"x": x})[0]) + 6
