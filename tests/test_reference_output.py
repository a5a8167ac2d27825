"""graph.reference_output: the tensor quantize's experiments judge a model by."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool import graph as G


def _model(nodes, inits, out_shape):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_selection_that_prepares_the_input_is_not_the_reference():
    # a speech front end: frames picked from the waveform (GatherElements), then the mel MatMul and a Log:
    # the selection reads the model input, which no int8 layer changes; the output is what int8 moves
    m = _model([helper.make_node("GatherElements", ["x", "idx"], ["framed"], axis=1),
                helper.make_node("MatMul", ["framed", "w"], ["mel"]),
                helper.make_node("Abs", ["mel"], ["a"]),
                helper.make_node("Log", ["a"], ["y"])],
               {"idx": np.tile(np.arange(8, dtype=np.int64)[::-1], (1, 1)), "w": np.ones((8, 4), np.float32)},
               [1, 4])
    onnx.checker.check_model(m)
    assert G.reference_output(m) == "y"


def test_a_selection_at_the_end_judges_by_the_dense_tensor_before_it():
    # an NMS-free detector: scores from a MatMul, the top 2 picked at the end
    m = _model([helper.make_node("MatMul", ["x", "w"], ["scores"]),
                helper.make_node("TopK", ["scores", "k"], ["y", "i"], axis=1)],
               {"w": np.ones((8, 4), np.float32), "k": np.array([2], np.int64)}, [1, 2])
    onnx.checker.check_model(m)
    assert G.reference_output(m) == "scores"
