"""fuse/inline_functions.py and modelio.inlined_size: a model's local functions become ordinary nodes, and a
model whose nested calls would inline past the limit is refused at load, before anything builds it."""
from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from helpers import init, run, save, weight
from qtool.errors import QtoolError
from qtool.fuse import fuse_model
from qtool.modelio import MAX_INLINED_NODES, inlined_size, load_model

OPSET = [helper.make_opsetid("", 17), helper.make_opsetid("lib", 1)]


def _conv_relu_function():
    """lib:ConvRelu(x, w, b) = Relu(Conv(x, w, b)), and lib:Block = two ConvRelu calls (a call inside a call)."""
    conv_relu = helper.make_function("lib", "ConvRelu", ["x", "w", "b"], ["y"], [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"])], opset_imports=OPSET)
    block = helper.make_function("lib", "Block", ["x", "w1", "b1", "w2", "b2"], ["y"], [
        helper.make_node("ConvRelu", ["x", "w1", "b1"], ["h"], domain="lib"),
        helper.make_node("ConvRelu", ["h", "w2", "b2"], ["y"], domain="lib")], opset_imports=OPSET)
    return [conv_relu, block]


def _model_with_functions():
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Block", ["x", "w1", "b1", "w2", "b2"], ["a"], domain="lib", name="block"),
             helper.make_node("ConvRelu", ["a", "w3", "b3"], ["b"], domain="lib", name="last"),
             helper.make_node("GlobalAveragePool", ["b"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["y"], name="flat")]
    inits = [weight(rng, "w1", 8, 3, 3, 3), weight(rng, "b1", 8, scale=0.1), weight(rng, "w2", 8, 8, 3, 3, scale=0.2),
             weight(rng, "b2", 8, scale=0.1), weight(rng, "w3", 8, 8, 3, 3, scale=0.2), weight(rng, "b3", 8, scale=0.1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], inits)
    m = helper.make_model(g, opset_imports=OPSET, functions=_conv_relu_function())
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def test_local_functions_are_inlined_and_their_convs_quantized(tmp_path):
    import warnings

    from rules_util import quantize_tiny

    m = _model_with_functions()
    fused = fuse_model(m)
    assert not fused.model.functions
    assert not any(n.domain == "lib" for n in fused.model.graph.node)
    assert sum(n.op_type == "Conv" for n in fused.model.graph.node) == 3
    assert any("2 call(s) of 2 local function(s) inlined" in s for s in fused.messages), fused.messages
    x = np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32)
    np.testing.assert_allclose(run(fused.model, {"x": x})[0], run(m, {"x": x})[0], rtol=1e-5, atol=1e-5)
    # the whole pipeline: every Conv int8 (before, the calls stayed fp32 with "no int8 rule for this op")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, d, feeds = quantize_tiny(m, tmp_path, {"x": (2, 3, 16, 16)})
    assert sorted(v.status for k, v in d.items() if v.op_type == "Conv") == ["int8"] * 3
    assert not out.model.functions


def _doubling(depth):
    """f0 = Relu; f_k calls f_(k-1) twice: 2^depth Relus once inlined, from a file of a few kB."""
    funcs = [helper.make_function("lib", "f0", ["x"], ["y"], [helper.make_node("Relu", ["x"], ["y"])], opset_imports=OPSET)]
    for k in range(1, depth + 1):
        funcs.append(helper.make_function("lib", f"f{k}", ["x"], ["y"], [
            helper.make_node(f"f{k - 1}", ["x"], ["h"], domain="lib"),
            helper.make_node(f"f{k - 1}", ["h"], ["y"], domain="lib")], opset_imports=OPSET))
    g = helper.make_graph([helper.make_node(f"f{depth}", ["x"], ["y"], domain="lib")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    m = helper.make_model(g, opset_imports=OPSET, functions=funcs)
    m.ir_version = 8
    return m


def test_inlined_size_counts_nested_calls_without_building_them():
    assert inlined_size(_doubling(10)) == 1024
    t = time.perf_counter()
    assert inlined_size(_doubling(60)) > MAX_INLINED_NODES  # 2^60: counted, never built
    assert time.perf_counter() - t < 5


def test_a_function_bomb_is_refused_at_load_with_one_line(tmp_path):
    path = save(_doubling(40), tmp_path / "bomb.onnx")
    with pytest.raises(QtoolError) as e:
        load_model(str(path))
    msg = str(e.value)
    assert "bomb.onnx" in msg and "local function" in msg and "\n" not in msg


def test_a_function_that_calls_itself_is_refused(tmp_path):
    f = helper.make_function("lib", "loop", ["x"], ["y"], [helper.make_node("loop", ["x"], ["y"], domain="lib")],
                             opset_imports=OPSET)
    g = helper.make_graph([helper.make_node("loop", ["x"], ["y"], domain="lib")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    m = helper.make_model(g, opset_imports=OPSET, functions=[f])
    m.ir_version = 8
    path = save(m, tmp_path / "loop.onnx")
    with pytest.raises(QtoolError, match="loop.onnx: local function lib:loop calls itself"):
        load_model(str(path))
