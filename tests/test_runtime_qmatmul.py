"""The int8 MatMul of two activations (attention's Q K^T and probabilities x V) in the native runtime:
QDQ graphs of batched shapes, rank 3 and 4 (rank-4 uint8 tensors are stored NHWC), against ONNX
Runtime's QLinearMatMul bit for bit, and the step's BLAS sums against the exact int64 reference."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

ort = pytest.importorskip("onnxruntime")

from qtool.runtime import NativeSession  # noqa: E402
from qtool.runtime.steps_qmatmul import QMatMulStep, qmatmul_acc, qmatmul_reference  # noqa: E402


def qdq_matmul(a_shape, b_shape, qa, qb, qy=None, relu=False):
    """a, b float inputs -> Q -> DQ -> MatMul [-> Relu] [-> Q -> DQ] -> y."""
    inits = []
    nodes = []
    for n, (s, z) in (("a", qa), ("b", qb)):
        inits += [numpy_helper.from_array(np.array(s, np.float32), f"{n}_s"), numpy_helper.from_array(np.array(z, np.uint8), f"{n}_z")]
        nodes += [helper.make_node("QuantizeLinear", [n, f"{n}_s", f"{n}_z"], [f"{n}_q"]),
                  helper.make_node("DequantizeLinear", [f"{n}_q", f"{n}_s", f"{n}_z"], [f"{n}_d"])]
    nodes.append(helper.make_node("MatMul", ["a_d", "b_d"], ["mm"]))
    last = "mm"
    if relu:
        nodes.append(helper.make_node("Relu", ["mm"], ["r"]))
        last = "r"
    if qy is not None:
        inits += [numpy_helper.from_array(np.array(qy[0], np.float32), "y_s"), numpy_helper.from_array(np.array(qy[1], np.uint8), "y_z")]
        nodes += [helper.make_node("QuantizeLinear", [last, "y_s", "y_z"], ["y_q"]),
                  helper.make_node("DequantizeLinear", ["y_q", "y_s", "y_z"], ["y"])]
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape),
                                       helper.make_tensor_value_info("b", TensorProto.FLOAT, b_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


CASES = [  # a shape, b shape, (a scale, zp), (b scale, zp), (y scale, zp) or None, relu
    ((1, 4, 7, 16), (1, 4, 16, 7), (0.05, 128), (0.04, 120), (0.3, 110), False),    # Q K^T, rank 4 (NHWC-stored)
    ((1, 4, 7, 7), (1, 4, 7, 16), (1 / 255, 0), (0.05, 131), (0.02, 128), False),   # softmax x V
    ((2, 9, 32), (2, 32, 5), (0.02, 100), (0.03, 140), (0.1, 0), True),             # rank 3, fused Relu
    ((3, 12, 8), (8, 10), (0.02, 100), (0.03, 128), (0.25, 128), False),            # B broadcast over the batch
    ((2, 3, 300), (2, 300, 4), (0.01, 7), (0.01, 250), (2.0, 128), False),          # K past float32's exact range
    ((1, 2, 6, 8), (1, 2, 8, 6), (0.05, 128), (0.05, 128), None, False),            # float output
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}" for c in CASES])
def test_qmatmul_matches_ort(case, tmp_path):
    import onnx
    a_shape, b_shape, qa, qb, qy, relu = case
    rng = np.random.default_rng(sum(a_shape))
    a = (rng.standard_normal(a_shape) * 3).astype(np.float32)
    b = (rng.standard_normal(b_shape) * 3).astype(np.float32)
    m = qdq_matmul(a_shape, b_shape, qa, qb, qy, relu)
    onnx.save(m, tmp_path / "m.onnx")
    sess = NativeSession(str(tmp_path / "m.onnx"), threads=2)
    assert "QMatMulStep" in {type(st).__name__ for st in sess.program.steps}
    (y,) = sess.run(None, {"a": a, "b": b})
    (ref,) = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a, "b": b})
    if qy is None:  # ORT runs the float MatMul on the dequantized values: float rounding apart
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)
    else:
        np.testing.assert_array_equal(y, ref)


@pytest.mark.parametrize("k", [1, 64, 258, 259, 700])
def test_qmatmul_sums_exact(k):
    rng = np.random.default_rng(k)
    a = rng.integers(0, 256, (2, 3, 5, k)).astype(np.uint8)
    b = rng.integers(0, 256, (2, 3, k, 4)).astype(np.uint8)
    a[0, 0, 0] = 255
    b[0, 0, :, 0] = 0  # the extreme sums: 255 * 255 * k in magnitude
    want = np.matmul(a.astype(np.int64) - 0, b.astype(np.int64) - 255)
    np.testing.assert_array_equal(qmatmul_acc(a, 0, b, 255), want)
    for out in ((np.float32(0.001), 128, 0, 255), (np.float32(0.0007), None, 0, 255)):
        env = [a, b, None]
        QMatMulStep("mm", 0, 1, 2, (3, False), (128, False), out).run(env, None)
        np.testing.assert_array_equal(env[2], qmatmul_reference(a, 3, b, 128, out[0], out[1]))
