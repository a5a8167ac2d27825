"""Real models' exporter habits that broke a step (found on PyPI packages' models, rebuilt small):
tf2onnx node names equal to tensor names, If branches that are constants, a fixed batch size,
shape arithmetic on free dimensions, outputs whose shape the int8 model changes."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper

from helpers import make_model, save, weight
from qtool.calibrate.run import calibrate
from qtool.quantize.run import SensitivityOptions, quantize


def _npy_folder(folder, samples):
    folder.mkdir()
    for i, s in enumerate(samples):
        np.save(folder / f"{i:03d}.npy", s)
    return str(folder)


def _calibrate(model, tmp_path, samples):
    path = tmp_path / "m.onnx"
    save(model, path)
    data = _npy_folder(tmp_path / "data", samples)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(str(path), data, method="minmax", workdir=str(tmp_path / "w"), show_progress=False, threads=1)
    return str(tmp_path / "w")


def test_node_named_like_its_output_tensor(tmp_path):
    """tf2onnx names nodes after their outputs (basic-pitch: 176 of them): a layer's weight
    switch and its output's quantizer switch in the experiment graphs must not share a name."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["m/c1"], name="m/c1", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["m/c1", "w2", "b2"], ["m/c2"], name="m/c2", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["m/c1", "m/c2"], ["m/add"], name="m/add"),
             helper.make_node("Conv", ["m/add", "w3"], ["m/c3"], name="m/c3"),
             helper.make_node("Sigmoid", ["m/c3"], ["y"], name="y")]
    inits = [weight(rng, "w1", 8, 3, 3, 3, scale=0.3), weight(rng, "b1", 8, scale=0.1),
             weight(rng, "w2", 8, 8, 3, 3, scale=0.2), weight(rng, "b2", 8, scale=0.1),
             weight(rng, "w3", 4, 8, 1, 1, scale=0.2)]
    m = make_model(nodes, inits, [("x", ["N", 3, 16, 16])], [("y", ["N", 4, 16, 16])], opset=15)
    w = _calibrate(m, tmp_path, [rng.standard_normal((1, 3, 16, 16)).astype(np.float32) for _ in range(16)])
    r = quantize(w, strict=True, say=lambda *a, **k: None, sensitivity=SensitivityOptions(show_progress=False))
    onnx.checker.check_model(r.path)
