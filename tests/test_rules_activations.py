"""rules/activations.py: which tensors feed one activation, and their activation-aware ranges."""
from __future__ import annotations

import numpy as np
from onnx import helper

from helpers import init, make_model, weight
from qtool.calibrate.histogram import Histogram
from qtool.calibrate.methods import METHODS
from qtool.rules.activations import FUNCTIONS, activation_inputs, activation_mse_range
from rules_util import output_sqnr, quantize_tiny
from qtool.quantize.options import QuantizeOptions


def _net(rng):
    """conv0 -> SiLU; conv1 -> hard-swish (Add 3, Clip 0..6, Mul, Div 6); conv2 -> HardSigmoid; conv3 -> Sigmoid."""
    c = lambda x, y, n: helper.make_node("Conv", [x, f"{n}_w"], [y], name=n, kernel_shape=[1, 1])  # noqa: E731
    nodes = [c("x", "a", "conv0"), helper.make_node("Sigmoid", ["a"], ["as"]), helper.make_node("Mul", ["a", "as"], ["A"]),
             c("A", "b", "conv1"), helper.make_node("Add", ["b", "three"], ["b3"]),
             helper.make_node("Clip", ["b3", "zero", "six"], ["bc"]), helper.make_node("Mul", ["b", "bc"], ["bm"]),
             helper.make_node("Div", ["bm", "six"], ["B"]),
             c("B", "d", "conv2"), helper.make_node("HardSigmoid", ["d"], ["D"], alpha=0.2, beta=0.5),
             c("D", "e", "conv3"), helper.make_node("Sigmoid", ["e"], ["y"])]
    inits = [weight(rng, f"conv{k}_w", 4, 4, 1, 1, scale=1.5) for k in range(4)]
    inits += [init("three", 3.0), init("zero", 0.0), init("six", 6.0)]
    return make_model(nodes, inits, [("x", ["N", 4, 6, 6])], [("y", ["N", 4, 6, 6])])


def test_patterns_found():
    found = activation_inputs(_net(np.random.default_rng(0)))
    assert {k: v[0] for k, v in found.items()} == {"a": "silu", "b": "hard-swish", "d": "hard-sigmoid",
                                                    "e": "sigmoid"}


def test_hard_swish_not_matched_with_other_constant():
    m = _net(np.random.default_rng(0))
    next(t for t in m.graph.initializer if t.name == "three").CopyFrom(init("three", 2.0))
    assert "b" not in activation_inputs(m)


def _hist(x):
    h = Histogram()
    h.observe(x)
    return h


def test_silu_range_drops_the_flat_negative_tail():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(0, 4, 200000), [-40.0, 12.0]]).astype(np.float32)
    h = _hist(x)
    lo, hi = activation_mse_range(h, FUNCTIONS["silu"])
    plain = METHODS["mse"](h)
    assert plain[0] * 0.5 < lo < -2 and hi > 0.6 * plain[1]  # the tail below about -6 is ~0 after SiLU

    def err(r):
        s = (r[1] - r[0]) / 255
        q = np.clip(np.round((x - r[0]) / s) * s + r[0], r[0], r[1])
        return float(np.mean((FUNCTIONS["silu"](q) - FUNCTIONS["silu"](x)) ** 2))
    assert err((lo, hi)) < 0.8 * err(plain)


def test_hard_sigmoid_range_is_its_linear_part():
    x = np.random.default_rng(2).normal(0, 6, 100000).astype(np.float32)
    f = lambda v: np.clip(0.2 * v + 0.5, 0, 1)  # noqa: E731
    lo, hi = activation_mse_range(_hist(x), f)
    assert -3.0 <= lo <= -2.3 and 2.3 <= hi <= 3.0


def test_calibrate_stores_aware_mse_ranges(tmp_path):
    m = _net(np.random.default_rng(3))
    out, d, _ = quantize_tiny(m, tmp_path, {"x": (2, 4, 6, 6)}, method="mse")
    import json
    man = json.load(open(tmp_path / "w" / "manifest.json"))
    aware = man["calibrate"]["activation_aware_mse"]
    assert aware.get("a") == "silu" and aware.get("d") == "hard-sigmoid"
    assert "b" not in aware  # hard-swish keeps the plain mse range (see the module's note)


def test_hard_sigmoid_chain_is_one_fp32_unit(tmp_path):
    """x -> Add(3) -> Clip(0, 6) -> Div(6) gating features (an exported SE block): the chain runs fp32 between
    int8 tensors, its input's range is fitted to [-3, 3] where the gate is not flat."""
    from qtool.rules.activations import activation_chains
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Conv", ["x", "w0"], ["f"], name="conv0", kernel_shape=[1, 1]),
             helper.make_node("Conv", ["f", "w1"], ["g1"], name="conv1", kernel_shape=[1, 1]),
             helper.make_node("Add", ["g1", "f"], ["g"], name="residual"),  # (after a Conv, Add(3) folds into it)
             helper.make_node("Add", ["g", "three"], ["g3"], name="add3"),
             helper.make_node("Clip", ["g3", "zero", "six"], ["gc"], name="clip"),
             helper.make_node("Div", ["gc", "six"], ["gate"], name="div6"),
             helper.make_node("Mul", ["f", "gate"], ["y0"], name="gate_mul"),
             helper.make_node("Conv", ["y0", "w2"], ["y"], name="conv2", kernel_shape=[1, 1])]
    inits = [weight(rng, "w0", 4, 4, 1, 1), weight(rng, "w1", 4, 4, 1, 1, scale=3.0), weight(rng, "w2", 2, 4, 1, 1),
             init("three", 3.0), init("zero", 0.0), init("six", 6.0)]
    m = make_model(nodes, inits, [("x", ["N", 4, 6, 6])], [("y", ["N", 2, 6, 6])])
    assert set(activation_chains(m)) == {"add3", "clip", "div6"}
    assert activation_inputs(m)["g"][0] == "hard-sigmoid"
    out, d, _ = quantize_tiny(m, tmp_path, {"x": (2, 4, 6, 6)}, method="mse")
    assert all(d[n].status == "fp32" and "inside hard-sigmoid" in d[n].reason for n in ("add3", "clip", "div6"))
    assert d["gate_mul"].status == "int8" and d["residual"].status == "int8"
    lo, hi = out.qparams["g"].lo, out.qparams["g"].hi
    assert -3.3 < lo and hi < 3.3


def test_hard_sigmoid_after_conv_folds_harmlessly(tmp_path):
    """Conv -> Add(3) -> Clip(0, 6) -> Div(6): fold_mul_add moves the +3 into the Conv's bias, and the Clip
    becomes that Conv's output clamp [0, 6] -- exactly the gate's non-flat region; only Div(6) stays fp32."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["g"], name="conv1", kernel_shape=[1, 1]),
             helper.make_node("Add", ["g", "three"], ["g3"], name="add3"),
             helper.make_node("Clip", ["g3", "zero", "six"], ["gc"], name="clip"),
             helper.make_node("Div", ["gc", "six"], ["gate"], name="div6"),
             helper.make_node("Mul", ["x", "gate"], ["y0"], name="gate_mul"),
             helper.make_node("Conv", ["y0", "w2"], ["y"], name="conv2", kernel_shape=[1, 1])]
    inits = [weight(rng, "w1", 4, 4, 1, 1, scale=3.0), weight(rng, "w2", 2, 4, 1, 1),
             init("three", 3.0), init("zero", 0.0), init("six", 6.0)]
    m = make_model(nodes, inits, [("x", ["N", 4, 6, 6])], [("y", ["N", 2, 6, 6])])
    out, d, feeds = quantize_tiny(m, tmp_path, {"x": (2, 4, 6, 6)})
    assert "add3" not in d and d["clip"].status == "fused" and d["div6"].status == "fp32"
    assert out.plan.clamp["gc"] == (0.0, 6.0)
    assert output_sqnr(m, out.model, feeds) > 25


def test_flat_ends_found_for_every_flat_reader():
    from qtool.rules.activations import flat_bounds
    m = _net(np.random.default_rng(0))
    found = flat_bounds(m)
    assert found["b"] == (-3.0, None)  # exported hard-swish chain
    assert np.allclose(found["d"], (-2.5, 2.5))  # HardSigmoid(alpha 0.2, beta 0.5)
    assert "a" not in found and "e" not in found  # SiLU and Sigmoid are never exactly flat
    nodes = [helper.make_node("HardSwish", ["x"], ["h"]), helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Clip", ["h", "lo", "hi"], ["c"]), helper.make_node("Add", ["r", "c"], ["s"]),
             helper.make_node("Abs", ["s"], ["y"]), helper.make_node("Relu", ["y"], ["z"])]
    m2 = make_model(nodes, [init("lo", -1.0), init("hi", 2.0)], [("x", ["N", 4])], [("z", ["N", 4])], opset=14)
    found = flat_bounds(m2)
    assert found["x"] == (-3.0, None)  # HardSwish and Relu: below -3 neither changes
    assert found["h"] == (-1.0, 2.0)
    assert "s" not in found  # Abs is not flat
    assert found["y"] == (0.0, None)


def test_clip_to_flat_puts_a_grid_point_past_each_end():
    from qtool.qparams import activation_qparams, clip_to_flat
    for hi in (0.5, 7.3, 140.0, 1000.0):
        for lo in (-3.01, -5.0, -131.0):
            a, b = clip_to_flat(lo, hi, -3.0, None)
            qp = activation_qparams(a, b)
            assert a >= lo - qp.scale and b == hi
            assert qp.lo <= -3.0 < qp.lo + 2 * qp.scale  # the lowest point is past -3, and only just
    a, b = clip_to_flat(-40.0, 40.0, -2.5, 2.5)
    qp = activation_qparams(a, b)
    assert qp.lo <= -2.5 and qp.hi >= 2.5 and qp.scale < 5.0 / 250
    assert clip_to_flat(-1.0, 5.0, -3.0, None) == (-1.0, 5.0)  # nothing to narrow


def test_every_method_has_a_flat_ended_twin(tmp_path):
    from qtool.calibrate.methods import METHODS
    from qtool.calibrate.table import load_table, range_candidates
    m = _net(np.random.default_rng(3))
    quantize_tiny(m, tmp_path, {"x": (2, 4, 6, 6)}, method="minmax")
    table = load_table(str(tmp_path / "w" / "calibration.json"))
    assert sorted(table.ranges) == sorted(list(METHODS) + [k + "+flat" for k in METHODS])
    assert sorted(range_candidates(table)) == sorted(METHODS)  # auto: by name only
    for method in METHODS:
        lo, hi = table.ranges[method + "+flat"]["b"]  # hard-swish input: one step past -3
        assert -3.0 - (hi + 3.0) / 250 <= lo <= -3.0, (method, lo, hi)
        assert table.ranges[method]["b"][0] <= lo  # the method's own range is left as it was
        assert table.ranges[method + "+flat"]["a"] == table.ranges[method]["a"]  # SiLU: not flat


def test_quantize_with_a_flat_ended_method(tmp_path):
    m = _net(np.random.default_rng(3))
    quantize_tiny(m, tmp_path, {"x": (2, 4, 6, 6)}, method="minmax")
    from qtool.api import quantize
    q = quantize(str(tmp_path / "w"), QuantizeOptions(method="minmax+flat", output=str(tmp_path / "f.onnx")), verbose=False)
    import onnx
    from qtool.qparams import ActQParams
    g = onnx.load(q.path).graph
    inits = {i.name: np.asarray(onnx.numpy_helper.to_array(i)) for i in g.initializer}
    node = next(n for n in g.node if n.op_type == "QuantizeLinear" and n.input[0] == "b")
    qp = ActQParams(float(inits[node.input[1]]), int(inits[node.input[2]]))
    assert -3.0 - 2 * qp.scale < qp.lo <= -3.0  # the hard-swish input stops one step past -3
