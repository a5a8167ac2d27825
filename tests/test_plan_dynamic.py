"""plan._drop_dynamic_only: once a layer reads its input at run time, the static pairs that only round go, and
no pair that makes another layer int8 in ONNX Runtime goes with them."""
from __future__ import annotations

import collections

import numpy as np
from onnx import helper

from helpers import init, make_model, weight
from qtool.plan import make_plan


def _conv_gelu_then_dense(rng):
    """Conv -> GELU (Erf form, fp32) -> Conv -> GELU -> flatten -> MatMul -> bias Add: eeg-spindle-seg in
    miniature, its convolutions into fp32 GELUs and a dense head whose MatMul may read its input at run time."""
    def gelu(x, y, p):
        return [helper.make_node("Div", [x, "sqrt2"], [p + "d"], name=p + "div"),
                helper.make_node("Erf", [p + "d"], [p + "e"], name=p + "erf"),
                helper.make_node("Add", [p + "e", "one"], [p + "a"], name=p + "add"),
                helper.make_node("Mul", [x, p + "a"], [p + "m"], name=p + "mul"),
                helper.make_node("Mul", [p + "m", "half"], [y], name=p + "half")]
    nodes = ([helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", kernel_shape=[3], pads=[1, 1])]
             + gelu("c0", "g0", "g0_")
             + [helper.make_node("Conv", ["g0", "w1", "b1"], ["c1"], name="conv1", kernel_shape=[3], pads=[1, 1])]
             + gelu("c1", "g1", "g1_")
             + [helper.make_node("Reshape", ["g1", "flat"], ["f"], name="flatten"),
                helper.make_node("MatMul", ["f", "wd"], ["d"], name="dense"),
                helper.make_node("Add", ["d", "bd"], ["y"], name="dense_bias")])
    inits = [weight(rng, "w0", 8, 2, 3, scale=0.5), weight(rng, "b0", 8, scale=0.1),
             weight(rng, "w1", 8, 8, 3, scale=0.3), weight(rng, "b1", 8, scale=0.1),
             weight(rng, "wd", 8 * 16, 4, scale=0.2), weight(rng, "bd", 4, scale=0.1)]
    inits += [init("sqrt2", np.array(np.sqrt(2.0), np.float32)), init("one", np.array(1.0, np.float32)),
              init("half", np.array(0.5, np.float32)), init("flat", np.array([-1, 8 * 16]), np.int64)]
    return make_model(nodes, inits, [("x", [1, 2, 16])], [("y", [1, 4])])


def test_a_dynamic_layer_leaves_the_convolutions_their_output_pairs():
    """eeg-spindle-seg's 25 convolutions into fp32 GELUs each lost the pair on their output once its MatMuls
    read their inputs at run time: ONNX Runtime then ran them as float convolutions on weights dequantized
    every run (one QLinearConv of 22 left), still reported int8, and the model's output SQNR of 34.8 dB was
    that of fp32 convolutions (27.1 with them int8)."""
    m = _conv_gelu_then_dense(np.random.default_rng(0))
    static = make_plan(m)
    dynamic = make_plan(m, dynamic={"dense"})
    assert {"c0", "c1"} <= set(static.tensors)
    # the convolutions keep the pairs that make them int8 ...
    assert {"c0", "c1"} <= set(dynamic.tensors)
    assert {"conv0", "conv1"} <= dynamic.int8_nodes
    # ... while the dense layer's input pair goes (it quantizes at run time) and its output stays fp32
    assert "f" not in dynamic.tensors and "g1" not in dynamic.tensors
    assert "d" not in dynamic.tensors


def test_ort_runs_those_convolutions_int8(tmp_path):
    """The QDQ graph with the dense layer dynamic, as ONNX Runtime optimizes it: both convolutions become
    QLinearConv, none stays a float Conv."""
    import onnx

    from qtool.ortsession import write_optimized
    from rules_util import quantize_tiny

    q, _, _ = quantize_tiny(_conv_gelu_then_dense(np.random.default_rng(0)), tmp_path, {"x": (1, 2, 16)},
                            dynamic={"dense"})
    assert any(n.op_type == "DynamicQuantizeLinear" for n in q.model.graph.node)
    written, optimized = str(tmp_path / "int8.onnx"), str(tmp_path / "opt.onnx")
    onnx.save(q.model, written)
    write_optimized(written, optimized)
    counts = collections.Counter(n.op_type for n in onnx.load(optimized).graph.node)
    assert counts["QLinearConv"] == 2 and counts["Conv"] == 0, counts
