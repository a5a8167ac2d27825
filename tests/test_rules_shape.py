"""rules/shape.py: Slice, Split, Resize and Pad pass uint8 through with the input's scale and zero point."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from helpers import init, make_model, run, weight
from rules_util import output_sqnr, quantize_tiny


def _conv(rng, x, y, name, cin=4, cout=4):
    return (helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [y], name=name, kernel_shape=[1, 1]),
            [weight(rng, f"{name}_w", cout, cin, 1, 1), weight(rng, f"{name}_b", cout, scale=0.1)])


def _wrap(middle_nodes, middle_inits, mid_in, mid_outs, rng, out_shape):
    """conv -> (middle) -> one conv per middle output -> Add them (if several) -> y."""
    nodes, inits = [], list(middle_inits)
    n, i = _conv(rng, "x", mid_in, "c0")
    nodes += [n] + list(middle_nodes)
    inits += i
    ys = []
    for k, t in enumerate(mid_outs):
        n, i = _conv(rng, t, f"y{k}", f"c{k + 1}")
        nodes.append(n)
        inits += i
        ys.append(f"y{k}")
    if len(ys) == 2:
        nodes.append(helper.make_node("Add", ys, ["y"], name="sum"))
    else:
        nodes.append(helper.make_node("Identity", ys, ["y"], name="id"))
    return make_model(nodes, inits, [("x", ["N", 4, 8, 8])], [("y", out_shape)])


def _check_shared(out, node, n_outputs=1):
    qp = out.qparams
    src = out.plan.shared[node.output[0]]
    for o in list(node.output)[:n_outputs]:
        assert qp[o] == qp[src], o


def test_slice_passthrough(tmp_path):
    rng = np.random.default_rng(0)
    sl = helper.make_node("Slice", ["a", "st", "en", "ax"], ["s"], name="slice")
    m = _wrap([sl], [init("st", [1], np.int64), init("en", [7], np.int64), init("ax", [2], np.int64)],
              "a", ["s"], rng, ["N", 4, 6, 8])
    out, d, feeds = quantize_tiny(m, tmp_path, {"x": (2, 4, 8, 8)})
    assert d["slice"].status == "passthrough"
    _check_shared(out, sl)
    assert output_sqnr(m, out.model, feeds) > 25


def test_split_every_output_shares(tmp_path):
    rng = np.random.default_rng(1)
    sp = helper.make_node("Split", ["a", "parts"], ["s0", "s1"], name="split", axis=2)
    m = _wrap([sp], [init("parts", [4, 4], np.int64)], "a", ["s0", "s1"], rng, ["N", 4, 4, 8])
    out, d, feeds = quantize_tiny(m, tmp_path, {"x": (2, 4, 8, 8)})
    assert d["split"].status == "passthrough"
    assert "s1" in out.plan.tensors and out.plan.shared["s1"] == "a"
    _check_shared(out, sp, 2)
    assert output_sqnr(m, out.model, feeds) > 25


def test_resize_nearest_and_linear(tmp_path):
    for mode in ("nearest", "linear"):
        rng = np.random.default_rng(2)
        rs = helper.make_node("Resize", ["a", "", "scales"], ["r"], name="resize", mode=mode)
        m = _wrap([rs], [init("scales", [1, 1, 2, 2])], "a", ["r"], rng, ["N", 4, 16, 16])
        out, d, feeds = quantize_tiny(m, tmp_path / mode, {"x": (2, 4, 8, 8)})
        assert d["resize"].status == "passthrough", mode
        assert output_sqnr(m, out.model, feeds) > 25


def test_resize_cubic_stays_fp32(tmp_path):
    rng = np.random.default_rng(3)
    rs = helper.make_node("Resize", ["a", "", "scales"], ["r"], name="resize", mode="cubic")
    m = _wrap([rs], [init("scales", [1, 1, 2, 2])], "a", ["r"], rng, ["N", 4, 16, 16])
    out, d, _ = quantize_tiny(m, tmp_path, {"x": (2, 4, 8, 8)})
    assert d["resize"].status == "fp32" and "cubic" in d["resize"].reason


def test_pad_zero_passes_nonzero_stays_fp32(tmp_path):
    for value, status in ((0.0, "passthrough"), (1.5, "fp32")):
        rng = np.random.default_rng(4)
        pd = helper.make_node("Pad", ["a", "pads", "v"], ["p"], name="pad", mode="constant")
        mp = helper.make_node("MaxPool", ["p"], ["pm"], name="pool", kernel_shape=[2, 2], strides=[1, 1],
                              pads=[1, 1, 0, 0])  # a Pad straight into a Conv would be folded into it
        m = _wrap([pd, mp], [init("pads", [0, 0, 1, 1, 0, 0, 1, 1], np.int64), init("v", value)], "a", ["pm"], rng,
                  ["N", 4, 10, 10])
        out, d, feeds = quantize_tiny(m, tmp_path / str(value), {"x": (2, 4, 8, 8)})
        assert d["pad"].status == status, (value, d["pad"])
        if status == "fp32":
            assert "not 0" in d["pad"].reason
        assert output_sqnr(m, out.model, feeds) > 25


# data movement ONNX Runtime runs on uint8 (it drops their Q/DQ) or in float on the same grid: the output keeps
# the input's scale and zero point, and qtool's runtime moves the uint8 values as ORT does
_MOVES = {
    "DepthToSpace": ([], dict(blocksize=2, mode="CRD"), ["N", 1, 16, 16]),
    "SpaceToDepth": ([], dict(blocksize=2), ["N", 16, 4, 4]),
    "Gather": ([init("idx", [3, 0, 1], np.int64)], dict(axis=1), ["N", 3, 8, 8]),
    "GatherElements": ([init("idx", np.random.default_rng(9).integers(-4, 4, (1, 4, 8, 8)), np.int64)],
                       dict(axis=1), ["N", 4, 8, 8]),
    "Expand": ([init("shape", [1, 4, 8, 8], np.int64)], {}, ["N", 4, 8, 8]),
    "Tile": ([init("reps", [1, 1, 2, 1], np.int64)], {}, ["N", 4, 16, 8]),
    "ReduceMax": ([], dict(axes=[2]), ["N", 4, 1, 8]),
    "ReduceMin": ([], dict(axes=[3]), ["N", 4, 8, 1]),
}


@pytest.mark.parametrize("op", sorted(_MOVES))
def test_data_movement_passes_uint8_through(tmp_path, op):
    from qtool.runtime import NativeSession

    extra, attrs, out_shape = _MOVES[op]
    rng = np.random.default_rng(4)
    mv = helper.make_node(op, ["a"] + [i.name for i in extra], ["m"], name="move", **attrs)
    nodes, inits = [], list(extra)
    n, i = _conv(rng, "x", "a", "c0")
    nodes += [n, mv]
    inits += i
    cin = out_shape[1]
    nodes.append(helper.make_node("Conv", ["m", "c1_w", "c1_b"], ["y"], name="c1", kernel_shape=[1, 1]))
    inits += [weight(rng, "c1_w", 4, cin, 1, 1), weight(rng, "c1_b", 4, scale=0.1)]
    m = make_model(nodes, inits, [("x", ["N", 4, 8, 8])], [("y", ["N", 4] + out_shape[2:])], opset=17)
    out, d, feeds = quantize_tiny(m, tmp_path, {"x": (2, 4, 8, 8)})
    assert d["move"].status == "passthrough", d["move"].reason
    _check_shared(out, mv)
    assert output_sqnr(m, out.model, feeds) > 25
    s = NativeSession(out.model, threads=1)
    assert [e.mode for e in s.report_entries() if e.op == op] == ["int8"], s.report()
    # no rounding but the convolutions' own: qtool's runtime gives ONNX Runtime's int8 result
    np.testing.assert_allclose(s.run(None, feeds)[0], run(out.model, feeds)[0], rtol=1e-5, atol=1e-5)
