"""Models from old exporters (IR 3, opset 9, weights listed as graph inputs, Dropout with its mask)
go through calibrate and quantize, and ONNX Runtime runs the int8 result."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from helpers import conv_bn, init, make_model, old_ir_conv_bn
from qtool import graph as G
from qtool.api import calibrate, quantize
from qtool.fuse import fuse_model
from qtool.fuse.upgrade_opset import MIN_OPSET, upgrade


def _samples(shape, n=4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def _ort(path_or_model, x):
    m = path_or_model.SerializeToString() if isinstance(path_or_model, onnx.ModelProto) else path_or_model
    s = ort.InferenceSession(m, providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def _sqnr(a, b):
    return 10 * np.log10(np.sum(a.astype(np.float64) ** 2) / np.sum((a.astype(np.float64) - b) ** 2))


def test_ir3_model_with_weights_as_inputs_quantizes_and_runs(tmp_path):
    m = old_ir_conv_bn(hw=8)
    p = str(tmp_path / "old.onnx")
    onnx.save(m, p)
    calibrate(p, _samples((1, 3, 8, 8)), workdir=str(tmp_path / "w"))
    q = quantize(str(tmp_path / "w"))
    q8 = onnx.load(q.path)
    onnx.checker.check_model(q8)
    assert G.opset(q8) >= MIN_OPSET and q8.ir_version >= 7
    assert {n.op_type for n in q8.graph.node} >= {"QuantizeLinear", "DequantizeLinear", "Conv"}
    x = _samples((1, 3, 8, 8), 1, seed=5)[0]
    assert _sqnr(_ort(p, x), _ort(q.path, x)) > 25


def test_ir3_model_with_unlisted_initializers_is_read_as_ir4(tmp_path):
    """IR 3 wants every initializer listed as a graph input; waifu2x's upconv7 (IR 3, opset 8) lists none. ONNX
    Runtime runs it; the checker refused it and calibrate stopped (exit 1). Now it is read as IR 4, said in a note."""
    from qtool.modelio import load_model

    m = old_ir_conv_bn(hw=8)
    del m.graph.input[1:]  # only x listed
    p = str(tmp_path / "old.onnx")
    onnx.save(m, p)
    notes = []
    assert load_model(p, notes=notes).ir_version == 4
    assert any("not listed as graph inputs" in n for n in notes), notes
    calibrate(p, _samples((1, 3, 8, 8)), workdir=str(tmp_path / "w"))
    q = quantize(str(tmp_path / "w"))
    x = _samples((1, 3, 8, 8), 1, seed=5)[0]
    assert _sqnr(_ort(p, x), _ort(q.path, x)) > 25


def _opset9_classifier():
    """Conv -> Relu -> Dropout (mask written, unread) -> GlobalAveragePool -> Softmax, opset 9, IR 3,
    weights listed as inputs: SqueezeNet as the old Caffe2 export wrote it."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Dropout", ["r"], ["d", "mask"], ratio=0.5, name="drop"),
             helper.make_node("GlobalAveragePool", ["d"], ["g"], name="gap"),
             helper.make_node("Softmax", ["g"], ["y"], name="softmax")]
    inits = [init("w", rng.standard_normal((6, 3, 3, 3)) * 0.5), init("b", rng.standard_normal(6) * 0.1)]
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])] + [
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    g = helper.make_graph(nodes, "sq", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 1, 1])],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)])
    m.ir_version = 3
    onnx.checker.check_model(m)
    return m


def test_opset9_classifier_calibrates_on_the_graph_quantize_writes(tmp_path):
    """Planned on opset 9, calibration recorded no range for the pooled tensor that quantize, planning
    on opset 13, wanted: the job stopped with 'calibration table has no range'."""
    p = str(tmp_path / "sq.onnx")
    onnx.save(_opset9_classifier(), p)
    calibrate(p, _samples((1, 3, 8, 8), 6), workdir=str(tmp_path / "w"))
    fused = onnx.load(str(tmp_path / "w" / "fused.onnx"))
    assert G.opset(fused) == MIN_OPSET and "Dropout" not in {n.op_type for n in fused.graph.node}
    q = quantize(str(tmp_path / "w"))
    x = _samples((1, 3, 8, 8), 1, seed=9)[0]
    assert _sqnr(_ort(p, x), _ort(q.path, x)) > 25


def test_upgrade_names_the_nodes_the_converter_adds():
    """An opset-11 Dropout whose mask is read becomes Dropout-13 with a ratio Constant the converter
    leaves unnamed: plans refer to nodes by name, so two unnamed nodes were one."""
    nodes = [helper.make_node("Dropout", ["x"], ["d", "mask"], ratio=0.25, name="drop"),
             helper.make_node("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Add", ["d", "mf"], ["y"], name="add")]
    m = make_model(nodes, [], [("x", [2, 4])], [("y", [2, 4])], opset=11)
    notes = []
    up = upgrade(m, notes)
    names = [n.name for n in up.graph.node]
    assert G.opset(up) == MIN_OPSET and len(names) == len(set(names)) and all(names), names
    assert notes and "upgraded from 11" in notes[0]
    assert G.opset(m) == 11 and m.ir_version == 8  # the caller's model is untouched


def test_upgrade_of_ir3_graph_without_weights_as_inputs():
    """The cleaned graph drops the weights from the inputs but was left at IR 3; the converter then
    stopped with 'Input w is undefined'."""
    m = old_ir_conv_bn(hw=8)
    keep = [i for i in m.graph.input if i.name == "x"]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    up = upgrade(m, [])
    onnx.checker.check_model(up)
    assert G.opset(up) == MIN_OPSET and up.ir_version >= 7 and m.ir_version == 3
    x = _samples((1, 3, 8, 8), 1)[0]
    np.testing.assert_allclose(_ort(up, x), _ort(old_ir_conv_bn(hw=8), x), rtol=1e-5, atol=1e-5)


def test_fuse_upgrades_old_opsets_first():
    r = fuse_model(old_ir_conv_bn(hw=8))
    assert G.opset(r.model) == MIN_OPSET and any("upgraded from 9" in s for s in r.messages)


def test_a_model_without_onnx_domain_ops_is_not_upgraded():
    """An ai.onnx.ml-only graph (ArrayFeatureExtractor) has no default-domain opset; the upgrade took it for
    opset 1, failed, and quantize refused a model it had nothing to do to."""
    vi = helper.make_tensor_value_info
    g = helper.make_graph([helper.make_node("ArrayFeatureExtractor", ["x", "i"], ["y"], domain="ai.onnx.ml")], "ml",
                          [vi("x", TensorProto.FLOAT, [2, 4]), vi("i", TensorProto.INT64, [1])],
                          [vi("y", TensorProto.FLOAT, [2, 1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("ai.onnx.ml", 1)])
    m.ir_version = 8
    notes = []
    assert upgrade(m, notes) is m and notes == []
