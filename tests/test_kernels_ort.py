"""The native epilogue (qtool.qparams.requantize) against ONNX Runtime, bit for bit:
QLinearConv (per-channel int8 weights, u8 activations, int32 bias, incl. depthwise and padding)
and QLinearMatMul, on random data whose outputs cover the whole u8 range.

ORT's int8 sums are exact only on some CPUs (qtool/arithmetic.py): ORT must equal the reference
under the arithmetic this machine's ORT uses (qtool/ort_arithmetic.py's probe; the saturating
pairs are emulated by qtool/runtime/saturating.py), and every native kernel must equal the exact
reference. On a CPU with VNNI the two are the same statement."""
from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("qtool.kernels")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from qtool.arithmetic import EXACT  # noqa: E402
from qtool.kernels import reference as R  # noqa: E402
from qtool.kernel_params import BinaryQuant, ConvGeometry  # noqa: E402
from qtool.ort_arithmetic import ort_int8_arithmetic  # noqa: E402
from qtool.runtime import saturating  # noqa: E402


def _run(nodes, inits, x, out_name="y"):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, list(x.shape))],
        [helper.make_tensor_value_info(out_name, TensorProto.UINT8, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


# (n, h, w, cin, cout, k, stride, pad, group)
CASES = [(1, 8, 8, 16, 32, 3, 1, 1, 1), (1, 9, 9, 3, 24, 3, 2, 1, 1), (1, 7, 7, 64, 48, 1, 1, 0, 1),
         (1, 10, 10, 32, 32, 3, 1, 1, 32), (1, 11, 11, 24, 24, 5, 2, 2, 24), (2, 6, 6, 8, 12, 3, 1, 0, 2)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_qlinearconv_matches_ort(case):
    n, h, w, cin, cout, k, s, p, g = case
    rng = np.random.default_rng(sum(case))
    x_nhwc = rng.integers(0, 256, (n, h, w, cin), dtype=np.uint8)
    wq = rng.integers(-127, 128, (cout, cin // g, k, k), dtype=np.int8)
    x_scale, x_zp = np.float32(0.0173), np.uint8(rng.integers(0, 256))
    w_scale = rng.uniform(0.001, 0.02, cout).astype(np.float32)
    bias = rng.integers(-3000, 3000, cout, dtype=np.int32)
    acc = R.conv2d_acc(wq, bias, x_nhwc, int(x_zp), (s, s), (p,) * 4, (1, 1), g)
    y_scale = np.float32(x_scale * float(np.abs(acc * w_scale).std()) / 40.0)
    y_zp = np.uint8(rng.integers(0, 256))
    inits = {"xs": np.array(x_scale), "xz": np.array(x_zp), "w": wq, "ws": w_scale,
             "wz": np.zeros(cout, np.int8), "ys": np.array(y_scale), "yz": np.array(y_zp), "b": bias}
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"],
                            kernel_shape=[k, k], strides=[s, s], pads=[p] * 4, group=g)
    want = _run([node], inits, np.ascontiguousarray(x_nhwc.transpose(0, 3, 1, 2))).transpose(0, 2, 3, 1)
    mult = K.conv_multiplier(x_scale, w_scale, y_scale)
    q = dict(x_zp=int(x_zp), multiplier=mult, y_zp=int(y_zp), geometry=ConvGeometry((s, s), (p,) * 4, group=g))
    ref = R.conv2d(wq, bias, x_nhwc, **q)
    ort_ref = ref
    if ort_int8_arithmetic() != EXACT and g != cin:  # (depthwise sums in int32 on every ORT path)
        ort_ref = saturating.conv2d(saturating.pack_conv2d(wq, bias, **q), x_nhwc)
    assert ((want == 0) | (want == 255)).any() and len(np.unique(want)) > 50  # clamps and range exercised
    bad = np.argwhere(ort_ref != want)
    assert not len(bad), f"reference vs ORT: {len(bad)} differ, first {[(tuple(b), ort_ref[tuple(b)], want[tuple(b)]) for b in bad[:5]]}"
    for isa in K.available_isas():
        K.set_isa(isa)
        try:
            got = K.conv2d(K.pack_conv2d(wq, bias, **q), x_nhwc)
        finally:
            K.set_isa(None)
        assert (got == ref).all(), f"{isa}: {(got != ref).sum()} values differ from the exact reference"


def test_qlinearmatmul_matches_ort():
    rng = np.random.default_rng(3)
    m, k, n = 9, 70, 37
    x = rng.integers(0, 256, (m, k), dtype=np.uint8)
    b = rng.integers(-127, 128, (k, n), dtype=np.int8)
    x_scale, x_zp, b_scale = np.float32(0.02), np.uint8(77), np.float32(0.01)
    acc = (x.astype(np.int64) - 77) @ b.astype(np.int64)
    y_scale = np.float32(x_scale * b_scale * acc.std() / 40)
    y_zp = np.uint8(120)
    inits = {"xs": np.array(x_scale), "xz": np.array(x_zp), "b": b, "bs": np.array(b_scale),
             "bz": np.array(np.int8(0)), "ys": np.array(y_scale), "yz": np.array(y_zp)}
    node = helper.make_node("QLinearMatMul", ["x", "xs", "xz", "b", "bs", "bz", "ys", "yz"], ["y"])
    want = _run([node], inits, x)
    mult = K.conv_multiplier(x_scale, b_scale, y_scale)
    q = dict(x_zp=77, multiplier=mult, y_zp=120)
    ref = R.gemm(np.ascontiguousarray(b.T), None, x, **q)
    ort_ref = ref
    if ort_int8_arithmetic() != EXACT:
        ort_ref = saturating.gemm(saturating.pack_gemm(np.ascontiguousarray(b.T), None, **q), x)
    assert (ort_ref == want).all(), f"reference vs ORT: {(ort_ref != want).sum()} of {want.size} differ"
    got = K.gemm(K.pack_gemm(np.ascontiguousarray(b.T), None, **q), x)
    assert (got == ref).all(), f"{(got != ref).sum()} of {got.size} differ from the exact reference"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qlinearadd_matches_ort(seed):
    rng = np.random.default_rng(seed)
    shape = (1, 8, 9, 37)
    a = rng.integers(0, 256, shape, dtype=np.uint8)
    b = rng.integers(0, 256, shape, dtype=np.uint8)
    sa, sb, sy = (np.float32(v) for v in rng.uniform(0.01, 0.2, 3))
    za, zb, zy = (np.uint8(v) for v in rng.integers(0, 256, 3))
    inits = {"as": np.array(sa), "az": np.array(za), "b": b, "bs": np.array(sb), "bz": np.array(zb),
             "ys": np.array(sy), "yz": np.array(zy)}
    node = helper.make_node("QLinearAdd", ["x", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"],
                            domain="com.microsoft")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": a})[0]
    q = BinaryQuant(a_scale=sa, a_zp=int(za), b_scale=sb, b_zp=int(zb), y_scale=sy, y_zp=int(zy))
    ref = R.add(a, b, q)
    assert (ref == want).all(), f"reference vs ORT: {(ref != want).sum()} differ"
    for isa in K.available_isas():
        K.set_isa(isa)
        try:
            got = K.add(a, b, q)
        finally:
            K.set_isa(None)
        assert (got == want).all(), f"{isa}: {(got != want).sum()} of {got.size} differ from ORT"


def _run_ms(node, inits, shape, x):
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qlinearmul_matches_ort(seed):
    rng = np.random.default_rng(seed + 10)
    shape = (1, 8, 9, 37)
    a = rng.integers(0, 256, shape, dtype=np.uint8)
    b = rng.integers(0, 256, shape, dtype=np.uint8)
    sa, sb = (np.float32(v) for v in rng.uniform(0.01, 0.1, 2))
    sy = np.float32(sa * sb * 64 * rng.uniform(0.5, 2))
    za, zb, zy = (np.uint8(v) for v in rng.integers(0, 256, 3))
    inits = {"as": np.array(sa), "az": np.array(za), "b": b, "bs": np.array(sb), "bz": np.array(zb),
             "ys": np.array(sy), "yz": np.array(zy)}
    node = helper.make_node("QLinearMul", ["x", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"],
                            domain="com.microsoft")
    want = _run_ms(node, inits, shape, a)
    q = BinaryQuant(a_scale=sa, a_zp=int(za), b_scale=sb, b_zp=int(zb), y_scale=sy, y_zp=int(zy))
    ref = R.mul(a, b, q)
    assert (ref == want).all(), f"reference vs ORT: {(ref != want).sum()} of {ref.size} differ"
    for isa in K.available_isas():
        K.set_isa(isa)
        try:
            got = K.mul(a, b, q)
        finally:
            K.set_isa(None)
        assert (got == want).all(), f"{isa}: {(got != want).sum()} of {got.size} differ from ORT"
