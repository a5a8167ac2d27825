"""Half-precision models: the cleaned graph computes in float32 behind Casts, so their layers quantize
(before, every one stayed fp32, "input is not float32") and the int8 model keeps float16 inputs and outputs."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from helpers import run, save, small_convnet, write_config, write_images
from qtool.api import calibrate, evaluate, quantize
from qtool.fuse import fuse_model
from qtool.fuse.upcast_float16 import upcast


def to_float16(m: onnx.ModelProto) -> onnx.ModelProto:
    """The model as a half-precision export writes it: float16 weights, constants, Casts and I/O."""
    m2 = onnx.ModelProto()
    m2.CopyFrom(m)
    for t in m2.graph.initializer:
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
    for v in list(m2.graph.input) + list(m2.graph.output):
        if v.type.tensor_type.elem_type == TensorProto.FLOAT:
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
    del m2.graph.value_info[:]
    onnx.checker.check_model(m2)
    return m2


def _x(shape, seed=0, dtype=np.float16):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _sqnr(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return 10 * np.log10(np.sum(a ** 2) / np.sum((a - b) ** 2))


def test_upcast_keeps_float16_io_and_the_function():
    m16 = to_float16(small_convnet())
    m = onnx.ModelProto()
    m.CopyFrom(m16)
    notes = []
    assert upcast(m, notes) and "float16 model computed in float32" in notes[0]
    onnx.checker.check_model(m)
    assert m.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert m.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert all(t.data_type != TensorProto.FLOAT16 for t in m.graph.initializer)
    x = _x((2, 3, 16, 16))
    a, b = run(m16, {"x": x})[0], run(m, {"x": x})[0]
    assert b.dtype == np.float16 and _sqnr(a, b) > 50  # (the float16 original rounds between ops; this does not)
    assert not upcast(small_convnet(), [])  # a float32 model is left alone


def test_upcast_widens_subgraphs_constants_and_casts():
    """An If whose branches compute in float16, a Constant and a Cast to float16 inside the graph."""
    vi = helper.make_tensor_value_info
    c16 = numpy_helper.from_array(np.array([2.0], np.float16), "c")
    then_g = helper.make_graph([helper.make_node("Mul", ["x", "k"], ["t"])], "then", [], [vi("t", TensorProto.FLOAT16, None)])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [vi("e", TensorProto.FLOAT16, None)])
    nodes = [helper.make_node("Constant", [], ["k"], value=c16),
             helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
             helper.make_node("Greater", ["sf", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["r"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Cast", ["r"], ["y"], to=TensorProto.FLOAT16)]
    g = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT16, [4])], [vi("y", TensorProto.FLOAT16, [4])],
                          [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    m16 = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m16.ir_version = 8
    onnx.checker.check_model(m16)
    r = fuse_model(m16)
    onnx.checker.check_model(r.model)
    for x in (np.array([1, 2, 3, 4], np.float16), np.array([-1, -2, 0.5, 1], np.float16)):
        np.testing.assert_array_equal(run(m16, {"x": x})[0], run(r.model, {"x": x})[0])


def test_float16_model_quantizes_and_keeps_float16_io(tmp_path):
    m16 = to_float16(small_convnet())
    path = save(m16, tmp_path / "half.onnx")
    samples = [_x((1, 3, 16, 16), seed=k) for k in range(8)]
    calibrate(path, samples, workdir=str(tmp_path / "w"))
    q = quantize(str(tmp_path / "w"))
    q8 = onnx.load(q.path)
    ops = {n.op_type for n in q8.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops and q.report["summary"].get("int8", 0) >= 3
    assert q8.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert q8.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert any("float16 model computed in float32" in n for n in q.report["notes"])
    x = _x((1, 3, 16, 16), seed=99)
    assert _sqnr(run(m16, {"x": x})[0], run(q8, {"x": x})[0]) > 25
    r = evaluate(workdir=str(tmp_path / "w"), data=samples)
    assert r["output_sqnr_db"] > 25


def test_float16_model_calibrates_from_images(tmp_path):
    """Images are handed to a float16 input as float16 (before: 'no float32 input to feed images to')."""
    write_images(tmp_path / "d", 6)
    cfg = write_config(tmp_path / "c.toml", size=16)
    path = save(to_float16(small_convnet()), tmp_path / "half.onnx")
    from qtool.data.config import load_config
    calibrate(path, str(tmp_path / "d"), config=load_config(cfg), workdir=str(tmp_path / "w"))
    q = quantize(str(tmp_path / "w"))
    assert q.report["summary"].get("int8", 0) >= 3
    r = evaluate(workdir=str(tmp_path / "w"), data=str(tmp_path / "d"))
    assert r["output_sqnr_db"] > 25
