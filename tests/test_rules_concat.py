"""rules/concat.py: one output scale for every input, unless no input is int8 or the ranges differ too much."""
from __future__ import annotations

import numpy as np
from onnx import helper

from helpers import init, make_model, weight
from qtool.plan import make_plan
from qtool.rules.concat import MAX_SPAN_RATIO
from rules_util import output_sqnr, quantize_tiny


def _head(rng, score_scale):
    """conv_box -> box; conv_obj -> Sigmoid * score_scale... as a detector head: Concat(box, score) -> Conv."""
    nodes = [helper.make_node("Conv", ["x", "wb"], ["box"], name="conv_box", kernel_shape=[1, 1]),
             helper.make_node("Conv", ["x", "ws"], ["s"], name="conv_score", kernel_shape=[1, 1]),
             helper.make_node("Sigmoid", ["s"], ["score"], name="sig"),
             helper.make_node("Concat", ["box", "score"], ["cat"], name="cat", axis=1),
             helper.make_node("Conv", ["cat", "wo"], ["y"], name="conv_out", kernel_shape=[1, 1])]
    inits = [weight(rng, "wb", 4, 3, 1, 1, scale=3.0), init("ws", np.full((1, 3, 1, 1), score_scale, np.float32)),
             weight(rng, "wo", 2, 5, 1, 1)]
    return make_model(nodes, inits, [("x", ["N", 3, 4, 4])], [("y", ["N", 2, 4, 4])])


def test_similar_ranges_concat_int8(tmp_path):
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"], name="conv_a", kernel_shape=[1, 1]),
             helper.make_node("Conv", ["x", "wb"], ["b"], name="conv_b", kernel_shape=[1, 1]),
             helper.make_node("Concat", ["a", "b"], ["cat"], name="cat", axis=1),
             helper.make_node("Conv", ["cat", "wo"], ["y"], name="conv_out", kernel_shape=[1, 1])]
    m = make_model(nodes, [weight(rng, "wa", 4, 3, 1, 1), weight(rng, "wb", 4, 3, 1, 1), weight(rng, "wo", 2, 8, 1, 1)],
                   [("x", ["N", 3, 4, 4])], [("y", ["N", 2, 4, 4])])
    out, d, feeds = quantize_tiny(m, tmp_path, {"x": (2, 3, 4, 4)})
    assert d["cat"].status == "int8", d["cat"]
    assert output_sqnr(m, out.model, feeds) > 25


def test_very_different_ranges_keep_fp32(tmp_path):
    """Scores squeezed to sigmoid(-4 + ...) ~ [0, 0.05] next to boxes of range ~10: over 4x apart."""
    rng = np.random.default_rng(1)
    m = _head(rng, 0.05)
    bias = helper.make_node("Add", ["s0", "minus4"], ["s"], name="shift")
    m.graph.node[1].output[0] = "s0"
    m.graph.node.insert(2, bias)
    m.graph.initializer.append(init("minus4", -4.0))
    out, d, feeds = quantize_tiny(m, tmp_path, {"x": (2, 3, 4, 4)})
    assert d["cat"].status == "fp32" and "ranges differ" in d["cat"].reason, d["cat"]
    assert "cat" in out.plan.tensors  # conv_out still reads int8: its input is quantized after the fp32 Concat
    assert output_sqnr(m, out.model, feeds) > 25


def test_no_int8_input_keeps_fp32():
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Erf", ["x"], ["a"], name="erf"), helper.make_node("Tanh", ["x"], ["b"], name="tanh"),
             helper.make_node("Concat", ["a", "b"], ["cat"], name="cat", axis=1),
             helper.make_node("Conv", ["cat", "w"], ["y"], name="conv", kernel_shape=[1, 1])]
    m = make_model(nodes, [weight(rng, "w", 2, 6, 1, 1)], [("x", ["N", 3, 4, 4])], [("y", ["N", 2, 4, 4])])
    d = {x.name: x for x in make_plan(m).decisions}
    assert d["cat"].status == "fp32" and "no input is int8" in d["cat"].reason
    assert d["conv"].status == "int8"


def test_threshold_is_two_bits():
    assert MAX_SPAN_RATIO == 4.0
