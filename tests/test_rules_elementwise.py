"""rules/elementwise.py: Sigmoid, HardSigmoid and Mul of two activations (SiLU, SE gates) in int8."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from helpers import init, make_model, weight
from rules_util import output_sqnr, quantize_tiny


def _silu_net(rng):
    """Conv -> SiLU (Sigmoid * Mul) -> Conv."""
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["c"], name="conv0", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Sigmoid", ["c"], ["s"], name="sig"),
             helper.make_node("Mul", ["c", "s"], ["m"], name="silu"),
             helper.make_node("Conv", ["m", "w1", "b1"], ["y"], name="conv1", kernel_shape=[1, 1])]
    inits = [weight(rng, "w0", 8, 3, 3, 3, scale=0.4), weight(rng, "b0", 8, scale=0.1),
             weight(rng, "w1", 4, 8, 1, 1, scale=0.4), weight(rng, "b1", 4, scale=0.1)]
    return make_model(nodes, inits, [("x", ["N", 3, 8, 8])], [("y", ["N", 4, 8, 8])])


def _se_net(rng):
    """Squeeze-and-excitation: Conv -> Relu -> GAP -> Conv -> Relu -> Conv -> HardSigmoid -> Mul(features) -> Conv."""
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["c"], name="conv0", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["c"], ["f"], name="relu0"),
             helper.make_node("GlobalAveragePool", ["f"], ["g"], name="gap"),
             helper.make_node("Conv", ["g", "w1", "b1"], ["h"], name="squeeze", kernel_shape=[1, 1]),
             helper.make_node("Relu", ["h"], ["hr"], name="relu1"),
             helper.make_node("Conv", ["hr", "w2", "b2"], ["e"], name="excite", kernel_shape=[1, 1]),
             helper.make_node("HardSigmoid", ["e"], ["gate"], name="hsig", alpha=0.2, beta=0.5),
             helper.make_node("Mul", ["f", "gate"], ["scaled"], name="se_mul"),
             helper.make_node("Conv", ["scaled", "w3", "b3"], ["y"], name="conv3", kernel_shape=[1, 1])]
    inits = [weight(rng, "w0", 8, 3, 3, 3, scale=0.4), weight(rng, "b0", 8, scale=0.1),
             weight(rng, "w1", 2, 8, 1, 1, scale=0.5), weight(rng, "b1", 2, scale=0.1),
             weight(rng, "w2", 8, 2, 1, 1, scale=1.0), weight(rng, "b2", 8, scale=0.1),
             weight(rng, "w3", 4, 8, 1, 1, scale=0.4), weight(rng, "b3", 4, scale=0.1)]
    return make_model(nodes, inits, [("x", ["N", 3, 8, 8])], [("y", ["N", 4, 8, 8])])


def test_silu_sigmoid_and_mul_int8(tmp_path):
    m = _silu_net(np.random.default_rng(0))
    out, d, feeds = quantize_tiny(m, tmp_path, {"x": (2, 3, 8, 8)})
    assert d["sig"].status == "int8" and d["silu"].status == "int8"
    assert {"c", "s", "m"} <= set(out.plan.tensors)
    q = out.model
    mul = next(n for n in q.graph.node if n.op_type == "Mul")
    assert all(i.endswith("_dequantized") for i in mul.input)  # DQ -> Mul -> Q: ORT runs QLinearMul
    assert output_sqnr(m, q, feeds) > 25


def test_squeeze_excitation_int8(tmp_path):
    m = _se_net(np.random.default_rng(1))
    out, d, feeds = quantize_tiny(m, tmp_path, {"x": (2, 3, 8, 8)})
    for name in ("gap", "squeeze", "excite", "hsig", "se_mul", "conv3"):
        assert d[name].status == "int8", (name, d[name])
    assert output_sqnr(m, out.model, feeds) > 22


def test_mul_by_constant_stays_fp32(tmp_path):
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c"], name="conv0", kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Mul", ["r", "k"], ["m"], name="scale"),
             helper.make_node("Conv", ["m", "w1"], ["y"], name="conv1", kernel_shape=[1, 1])]
    m = make_model(nodes, [weight(rng, "w0", 4, 3, 1, 1), init("k", 0.5), weight(rng, "w1", 2, 4, 1, 1)],
                   [("x", ["N", 3, 4, 4])], [("y", ["N", 2, 4, 4])])
    out, d, _ = quantize_tiny(m, tmp_path, {"x": (2, 3, 4, 4)})
    assert d["scale"].status == "fp32" and "constant" in d["scale"].reason


def test_ort_runs_qlinear_mul(tmp_path):
    """ONNX Runtime turns the DQ -> Mul -> Q unit into its integer kernel (checked on the optimized graph)."""
    import onnxruntime as ort
    m = _silu_net(np.random.default_rng(3))
    out, _, _ = quantize_tiny(m, tmp_path, {"x": (2, 3, 8, 8)})
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(out.model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ops = {n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node}
    assert "QLinearMul" in ops and "QLinearConv" in ops, ops


def _float_ended(rng, tail):
    """Conv -> Relu -> ConvTranspose -> `tail` -> graph output: the last op has no
    weights and writes the graph output fp32."""
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["c"], name="conv0", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["c"], ["r"], name="relu0"),
             helper.make_node("ConvTranspose", ["r", "wt"], ["u"], name="up", kernel_shape=[2, 2], strides=[2, 2])]
    if tail == "sigmoid":
        nodes.append(helper.make_node("Sigmoid", ["u"], ["y"], name="last"))
    else:  # a Mul of two activations, itself read by a Sigmoid: both end fp32
        nodes += [helper.make_node("Sigmoid", ["u"], ["s"], name="gate"),
                  helper.make_node("Mul", ["u", "s"], ["v"], name="mul"),
                  helper.make_node("Sigmoid", ["v"], ["y"], name="last")]
    inits = [weight(rng, "w0", 4, 3, 3, 3, scale=0.4), weight(rng, "b0", 4, scale=0.1),
             weight(rng, "wt", 4, 1, 2, 2, scale=2.0)]
    return make_model(nodes, inits, [("x", ["N", 3, 8, 8])], [("y", ["N", 1, 16, 16])])


def test_weightless_op_writing_fp32_output_runs_fp32(tmp_path):
    """A Sigmoid whose output is the graph output does no int8 work in ONNX Runtime: its input's Q/DQ
    only rounded the logits (DBNet's probability map: steps of 0.8 at the 0.3 threshold)."""
    for tail in ("sigmoid", "silu"):
        m = _float_ended(np.random.default_rng(4), tail)
        out, d, feeds = quantize_tiny(m, tmp_path / tail, {"x": (2, 3, 8, 8)})
        assert d["last"].status == "fp32" and "only round" in d["last"].reason, d["last"]
        assert d["conv0"].status == "int8"
        assert "u" not in out.plan.tensors and "r" in out.plan.tensors
        if tail == "silu":  # the SiLU now feeds only fp32: it runs fp32 too, and nothing after conv0 is rounded
            assert d["mul"].status == "fp32" and d["gate"].status == "fp32"
            assert not {"s", "v"} & set(out.plan.tensors)
        q = out.model
        assert not any(n.op_type == "QuantizeLinear" and n.input[0] in ("u", "v") for n in q.graph.node)
        # only conv0's input and output are rounded: the output is as close as conv0 alone allows
        assert output_sqnr(m, q, feeds) > 25


def test_weightless_op_feeding_int8_stays_int8(tmp_path):
    """The same Sigmoid inside the network (its output quantized for an int8 reader) stays int8."""
    m = _silu_net(np.random.default_rng(5))
    _, d, _ = quantize_tiny(m, tmp_path, {"x": (2, 3, 8, 8)})
    assert d["sig"].status == "int8" and d["silu"].status == "int8"
