"""A masked mean as sentence encoders export their pooling (Expand the mask to the token states' shape, Cast,
Mul, ReduceSum, and ReduceSum -> Clip of the mask, Div) is one step in the native runtime: ONNX Runtime's
output (float sums: to float32 rounding), and the nodes run one by one where a part is read elsewhere."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ort = pytest.importorskip("onnxruntime")

from qtool.runtime import NativeSession  # noqa: E402


def _pooling_model(extra_output=None, keepdims=0):
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "axes_u"),
             numpy_helper.from_array(np.array([1], np.int64), "axes_r"),
             numpy_helper.from_array(np.array(1e-9, np.float32), "lo")]
    nodes = [helper.make_node("Relu", ["x"], ["h"]),  # (token states made by an op, as an encoder's are)
             helper.make_node("Unsqueeze", ["mask", "axes_u"], ["m"]),
             helper.make_node("Shape", ["h"], ["shp"]),
             helper.make_node("Expand", ["m", "shp"], ["me"], name="expand"),
             helper.make_node("Cast", ["me"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["h", "mf"], ["hm"]),
             helper.make_node("ReduceSum", ["hm", "axes_r"], ["num"], keepdims=keepdims),
             helper.make_node("ReduceSum", ["mf", "axes_r"], ["cnt"], keepdims=keepdims),
             helper.make_node("Clip", ["cnt", "lo", ""], ["den"]),
             helper.make_node("Div", ["num", "den"], ["pooled"])]
    outs = [helper.make_tensor_value_info("pooled", TensorProto.FLOAT, None)]
    if extra_output:
        outs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", 16]),
                                       helper.make_tensor_value_info("mask", TensorProto.INT64, ["b", "t"])],
                          outs, initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("extra_output,keepdims,fused", [(None, 0, True), (None, 1, True), ("mf", 0, False)])
def test_a_masked_mean_is_one_step(tmp_path, extra_output, keepdims, fused):
    m = _pooling_model(extra_output, keepdims)
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 9, 16)).astype(np.float32)
    mask = np.ones((2, 9), np.int64)
    mask[0, 5:] = 0
    mask[1, :] = 0  # an all-padding row: the clip keeps the division finite
    sess = NativeSession(str(path), threads=1)
    got = sess.run(None, {"x": x, "mask": mask})
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x, "mask": mask})
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    ops = [st.op for st in sess.program.steps]
    assert ("MaskedMean" in ops) == fused and ("Expand" in ops) != fused, ops
