"""An int8 embedding lookup as quantize writes it (Gather int8 rows -> Cast -> Mul by Unsqueeze(Gather row
scales)) is one step in the native runtime, ONNX Runtime's output bit for bit (negative ids too); a lookup
whose parts are read elsewhere runs node by node."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ort = pytest.importorskip("onnxruntime")

from qtool.runtime import NativeSession  # noqa: E402

V, D = 50, 12


def _lookup_model(extra_output=None, scale_first=False):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.integers(-127, 128, (V, D)).astype(np.int8), "table_q"),
             numpy_helper.from_array((rng.random(V) * 0.05 + 1e-3).astype(np.float32), "row_scale"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    rows = [helper.make_node("Gather", ["table_q", "ids"], ["rq"], name="rows", axis=0),
            helper.make_node("Cast", ["rq"], ["rf"], name="cast", to=TensorProto.FLOAT)]
    scales = [helper.make_node("Gather", ["row_scale", "ids"], ["s"], name="scales", axis=0),
              helper.make_node("Unsqueeze", ["s", "axes"], ["s1"], name="unsq")]
    nodes = (scales + rows if scale_first else rows + scales) + [helper.make_node("Mul", ["rf", "s1"], ["e"], name="mul")]
    outs = [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)]
    if extra_output:
        outs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "t"])], outs,
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("extra_output,scale_first,fused", [(None, False, True), (None, True, True), ("rf", False, False)])
def test_an_int8_embedding_lookup_is_one_step(tmp_path, extra_output, scale_first, fused):
    m = _lookup_model(extra_output, scale_first)
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    ids = np.array([[0, 3, 49, -1, -50, 7]], np.int64)
    sess = NativeSession(str(path), threads=1)
    got = sess.run(None, {"ids": ids})
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    ops = [st.op for st in sess.program.steps]
    assert (ops == ["Gather"]) == fused, ops
