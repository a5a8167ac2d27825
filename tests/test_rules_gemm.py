"""rules/gemm.py with plan.py: a weighted MatMul/Gemm whose output only fp32 ops read keeps no output
Q/DQ pair, even when an int8 op follows further on: ONNX Runtime runs DQ -> MatMul as
MatMulIntegerToFloat (DQ -> Gemm as QGemm with a float output), so the pair only rounded the sum
before the fp32 bias Add, and the next int8 op quantizes again after it."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from helpers import weight, make_model
from rules_util import output_sqnr, quantize_tiny


def _block(rng):
    """A transformer's feed-forward: MatMul -> Add(bias) -> Relu -> MatMul -> Add(bias) -> y,
    with the first bias Add's output read by an fp32 op only (the Relu is fused nowhere: it reads an Add)."""
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["m0"], name="mm0"),
             helper.make_node("Add", ["m0", "b0"], ["a0"], name="bias0"),
             helper.make_node("Relu", ["a0"], ["r0"], name="relu0"),
             helper.make_node("MatMul", ["r0", "w1"], ["m1"], name="mm1"),
             helper.make_node("Add", ["m1", "b1"], ["y"], name="bias1")]
    inits = [weight(rng, "w0", 16, 32, scale=0.3), weight(rng, "b0", 32, scale=0.5),
             weight(rng, "w1", 32, 8, scale=0.3), weight(rng, "b1", 8, scale=0.5)]
    return make_model(nodes, inits, [("x", ["N", 5, 16])], [("y", ["N", 5, 8])])


def test_matmul_before_fp32_bias_add_keeps_a_float_output(tmp_path):
    m = _block(np.random.default_rng(0))
    out, d, feeds = quantize_tiny(m, tmp_path, {"x": (2, 5, 16)})
    assert d["mm0"].status == "int8" and d["mm1"].status == "int8"
    assert "m0" not in out.plan.tensors  # no pair between the MatMul and its bias
    assert "r0" in out.plan.tensors  # mm1's input is quantized after the fp32 ops
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(out.model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    optimized = [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node]
    assert optimized.count("MatMulIntegerToFloat") == 2, optimized  # both still int8 in ONNX Runtime
    assert output_sqnr(m, out.model, feeds) > 30
