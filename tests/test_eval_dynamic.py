"""eval of an int8 model with dynamic quantization: each sample runs alone, since a DynamicQuantizeLinear
takes its range from everything in the run (batched, one sample's rounding would follow the others')."""
from __future__ import annotations

import os

import numpy as np
from onnx import helper

from helpers import make_model, run, save
from qtool import graph as G
from qtool.evaluate.options import EvalOptions
from qtool.evaluate.tensors import evaluate_tensors


def _models():
    fp32 = make_model([helper.make_node("Identity", ["x"], ["y"])], [], [("x", [None, 64])], [("y", [None, 64])])
    dq = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
          helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    int8 = make_model(dq, [], [("x", [None, 64])], [("y", [None, 64])])
    return fp32, int8


def test_samples_of_a_dynamic_model_are_evaluated_alone(tmp_path):
    fp32, int8 = _models()
    assert G.samples_interact(int8) and not G.samples_interact(fp32)
    save(fp32, str(tmp_path / "f.onnx"))
    save(int8, str(tmp_path / "q.onnx"))
    os.makedirs(tmp_path / "d")
    rng = np.random.default_rng(0)
    xs = [(rng.standard_normal((1, 64)) * 10.0 ** k).astype(np.float32) for k in range(-3, 3)]  # scales 1e-3..1e2
    for k, x in enumerate(xs):
        np.save(tmp_path / "d" / f"{k}.npy", x)
    r = evaluate_tensors(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), str(tmp_path / "d"), EvalOptions())
    alone = np.concatenate([run(int8, {"x": x})[0] for x in xs])
    ref = np.concatenate(xs)
    want = 10 * np.log10((ref.astype(np.float64) ** 2).sum() / ((alone - ref).astype(np.float64) ** 2).sum())
    batched = run(int8, {"x": ref})[0]  # (one range for all six: the small samples round to zero)
    worse = 10 * np.log10((ref.astype(np.float64) ** 2).sum() / ((batched - ref).astype(np.float64) ** 2).sum())
    assert abs(r["outputs"]["y"]["sqnr_db"] - want) < 1e-6 and abs(want - worse) > 1e-3
