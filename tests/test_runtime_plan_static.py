"""Steps computed once per plan (plan_static.py): the shape arithmetic torch exports write around
attention is left out of a plan's later runs, and outputs stay right for new values and new shapes."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.runtime import NativeSession
from qtool.runtime.bench import make_feeds


def _model():
    """x [B, L, 8] -> Reshape to [B, L, 2, 4] with the shape built from Shape(x) (Gather, Unsqueeze,
    Concat), then Mul by Range(0, L) (positions: a value from a shape), and NonZero's count."""
    c = lambda n, v: numpy_helper.from_array(np.array(v, np.int64), n)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["l"], axis=0),
        helper.make_node("Unsqueeze", ["b", "ax0"], ["bu"]),
        helper.make_node("Unsqueeze", ["l", "ax0"], ["lu"]),
        helper.make_node("Concat", ["bu", "lu", "two", "four"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Range", ["zero", "l", "one"], ["pos"]),
        helper.make_node("Cast", ["pos"], ["posf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["posf", "ax123"], ["posu"]),
        helper.make_node("Mul", ["r", "posu"], ["y"]),
        helper.make_node("NonZero", ["x"], ["nz"]),
        helper.make_node("Shape", ["nz"], ["nzs"]),
    ]
    inits = [c("i0", 0), c("i1", 1), c("ax0", [0]), c("two", [2]), c("four", [4]), c("zero", 0), c("one", 1),
             c("ax123", [0, 2, 3])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "L", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("nzs", TensorProto.INT64, None)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_shape_chain_runs_once_per_plan(tmp_path):
    import onnxruntime as ort
    p = tmp_path / "m.onnx"
    onnx.save(_model(), p)
    sess = NativeSession(str(p), threads=1)
    ref = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for shape in ((1, 5, 8), (1, 5, 8), (2, 3, 8), (1, 5, 8)):
        x = rng.standard_normal(shape).astype(np.float32)
        x[x < 0.3] = 0  # NonZero's count changes with the values: its Shape must run every time
        for a, b in zip(sess.run(None, {"x": x}), ref.run(None, {"x": x})):
            np.testing.assert_array_equal(a, b)
    plan = next(iter(sess._plans.values()))
    run_ops = [st.op for st, _ in plan.steps_calls]
    assert "Concat" not in run_ops and "Range" not in run_ops and "Gather" not in run_ops
    assert run_ops.count("Shape") == 1 and "NonZero" in run_ops and "Reshape" in run_ops


def test_bench_feeds_for_text_models(tmp_path):
    """Token ids and masks are integers: ids 0/1 (an index of any table), masks all ones."""
    nodes = [helper.make_node("Cast", ["ids"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["f", "m"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "L"]),
                                       helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "L"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, tmp_path / "t.onnx")
    sess = NativeSession(str(tmp_path / "t.onnx"), threads=1)
    feeds = make_feeds(sess, 1, (1, 32))
    assert feeds["ids"].dtype == np.int64 and set(np.unique(feeds["ids"])) <= {0, 1}
    assert feeds["attention_mask"].dtype == np.int64 and np.all(feeds["attention_mask"] == 1)
    sess.run(None, feeds)
