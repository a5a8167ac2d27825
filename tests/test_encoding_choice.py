"""The portable target's per-layer encoding: the few cheap layers where pair-safe int8 weights cost
precision store them as uint8 + 128 instead (encoding.cheap_u8_layers), within a MAC budget."""
from __future__ import annotations

import numpy as np
from helpers import init, make_model
from onnx import helper

from qtool.quantize import encoding as E
from qtool.quantize.qdq import BuildOptions


def test_pair_safe_cost_is_zero_where_no_pair_binds_and_positive_where_one_does():
    rng = np.random.default_rng(0)
    partners = E._flat_partners(16)
    calm = rng.uniform(-1, 1, (8, 16)) * 0.3
    calm[:, 0], calm[:, 1] = 1.0, 0.0  # each row's largest weight, paired with a zero: no pair past 128
    assert E.pair_safe_cost_db(calm, partners) == 0.0
    bound = calm.copy()
    bound[:, 1] = 0.95  # a same-sign pair summing to ~248 steps: the scale or the pair must give
    assert E.pair_safe_cost_db(bound, partners) > 1.0


def test_cheap_u8_layers_takes_the_costliest_that_fit_the_budget():
    total = 100_000_000  # budget: 2 % = 2 MMAC
    layers = {"head": (500_000, 4.0), "mid": (1_800_000, 6.0), "big": (50_000_000, 9.0),
              "free": (100, 0.1), "small": (150_000, 1.0)}
    chosen = E.cheap_u8_layers(layers, total)
    assert set(chosen) == {"mid", "small"}  # mid (the costliest that fits) first; head no longer fits
    assert "6.0 dB" in chosen["mid"] and "uint8 + 128" in chosen["mid"]
    # a tiny model: the floor lets every costly layer be u8, even when it is all of the model's MACs
    assert set(E.cheap_u8_layers({"a": (200_000, 2.0), "b": (20_000, 1.0)}, 220_000)) == {"a", "b"}


def _conv_head_model():
    rng = np.random.default_rng(1)
    fc = rng.uniform(-0.2, 0.2, (10, 64))
    fc[:, 0] = fc[:, 1] = 1.0  # the first pair of every row sums to 254 steps
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "fc", "fb"], ["y"], name="head", transB=1)]
    inits = [init("w", rng.standard_normal((64, 3, 3, 3))), init("b", np.zeros(64)),
             init("fc", fc), init("fb", np.zeros(10))]
    return make_model(nodes, inits, [("x", [1, 3, 32, 32])], [("y", [1, 10])])


def test_portable_stores_the_costly_head_as_u8_and_not_the_big_conv():
    m = _conv_head_model()
    chosen = E.portable_u8_layers(m, {"x": [1, 3, 32, 32]})
    assert list(chosen) == ["head"]  # the conv's 1.8 MMAC are past the 1 MMAC floor


def test_quantize_graph_writes_the_chosen_layer_as_uint8_plus_128(calibrated):
    from onnx import numpy_helper

    from qtool.quantize.qdq import quantize_graph
    _, _, _, _, r = calibrated
    name = next(n.name for n in r.fused.graph.node if n.op_type == "Conv" and n.input[1])
    plain = quantize_graph(r.fused, r.table, BuildOptions(target="vnni"))
    out = quantize_graph(r.fused, r.table, BuildOptions(target="portable", encodings={name: E.U8}))
    assert out.layers[name].encoding == E.U8
    assert all(v.encoding != E.U8 for k, v in out.layers.items() if k != name)
    inits = {t.name: numpy_helper.to_array(t) for t in out.model.graph.initializer}
    ref = {t.name: numpy_helper.to_array(t) for t in plain.model.graph.initializer}
    node = next(n for n in out.model.graph.node if n.name == name)
    dq = next(n for n in out.model.graph.node if n.output and n.output[0] == node.input[1])
    q, zp = inits[dq.input[0]], inits[dq.input[2]]
    assert q.dtype == np.uint8 and (zp == 128).all()
    dq_plain = next(n for n in plain.model.graph.node
                    if n.output and n.output[0] == next(x for x in plain.model.graph.node if x.name == name).input[1])
    np.testing.assert_array_equal(q.astype(np.int16) - 128, ref[dq_plain.input[0]])  # plain int8's values
