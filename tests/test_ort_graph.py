"""quantize/ort_graph.py: the layers reported int8 that ONNX Runtime runs in float, read from its own graph."""
from __future__ import annotations

import json
import os

import numpy as np
from onnx import helper

from helpers import make_model, save, weight
from qtool.quantize.ort_graph import float_layers
from rules_util import quantize_tiny


def _conv_deconv(rng):
    """Conv -> Relu -> ConvTranspose -> Relu -> Conv: ONNX Runtime's CPU fusions take the first QDQ Conv into
    a QLinearConv and leave the ConvTranspose a float op on its dequantized weight, and the last Conv too: the
    plan leaves its output fp32 (nothing int8 follows), and a Conv without an output pair runs float."""
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
             helper.make_node("ConvTranspose", ["r0", "wt", "bt"], ["t"], name="deconv", kernel_shape=[2, 2],
                              strides=[2, 2]),
             helper.make_node("Relu", ["t"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w1", "b1"], ["y"], name="conv1", kernel_shape=[1, 1])]
    inits = [weight(rng, "w0", 8, 3, 3, 3, scale=0.4), weight(rng, "b0", 8, scale=0.1),
             weight(rng, "wt", 8, 8, 2, 2, scale=0.3), weight(rng, "bt", 8, scale=0.1),
             weight(rng, "w1", 4, 8, 1, 1, scale=0.4), weight(rng, "b1", 4, scale=0.1)]
    return make_model(nodes, inits, [("x", [1, 3, 8, 8])], [("y", [1, 4, 16, 16])])


def test_the_layers_ort_leaves_float_are_named(tmp_path):
    out, decisions, _ = quantize_tiny(_conv_deconv(np.random.default_rng(0)), tmp_path, {"x": (1, 3, 8, 8)})
    assert {"conv0", "deconv", "conv1"} <= {n for n, d in decisions.items() if d.status == "int8"}
    path = save(out.model, tmp_path / "int8.onnx")
    assert float_layers(str(path), ["conv0", "deconv", "conv1"]) == {"deconv": "ConvTranspose", "conv1": "Conv"}
    # (a name not asked about is not reported, whatever ORT runs it as)
    assert float_layers(str(path), ["conv0"]) == {}


def test_quantize_json_says_it(tmp_path):
    """`qtool quantize` writes what it found into quantize.json, and says it in one line."""
    import subprocess
    import sys

    from helpers import write_samples

    model = save(_conv_deconv(np.random.default_rng(0)), tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    data = write_samples(str(tmp_path / "data"), [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)}
                                                 for _ in range(8)])
    exe, work = os.path.join(os.path.dirname(sys.executable), "qtool"), str(tmp_path / "w")
    p = subprocess.run([exe, "calibrate", "--model", model, "--data", data, "-w", work, "-q"], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([exe, "quantize", "-w", work, "--no-sensitivity", "--strict"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "ONNX Runtime runs 2 of the 3 int8 layers with weights in float" in p.stdout + p.stderr
    report = json.load(open(os.path.join(work, "quantize.json")))
    assert report["ort_float_layers"] == {"checked": True, "layers": {"deconv": "ConvTranspose", "conv1": "Conv"}}
