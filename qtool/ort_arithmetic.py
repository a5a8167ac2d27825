"""Which integer arithmetic this machine's ONNX Runtime applies to u8 x s8 layers, found by asking it.

CPU flags would only be a guess at what MLAS dispatches to (it changes between releases and
with AVX-VNNI, AVX-512 without VNNI, AMX, ARM), so one tiny QDQ model is run instead: a Conv and
a Gemm whose int8 weights have neighbouring pairs that saturate int16 for large uint8 inputs
(qtool/arithmetic.py). ORT's output is compared with the exact result and with the emulated
x86-without-VNNI result, computed here in numpy. The answer is cached for the process.
"""
from __future__ import annotations

import functools

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from qtool import qparams as Q
from qtool.arithmetic import EXACT, ORT_X86_NOVNNI, saturating_pairs, saturation_correction

UNKNOWN = "unknown"
_K = 16  # inputs per output channel
_N = 8  # output channels
_M = 32  # rows (pixels of a 1x1 conv, rows of the Gemm)


def _probe_tensors():
    rng = np.random.default_rng(0)
    w = rng.choice(np.array([127, 120, 100, -127, -110, 3], np.int8), size=(_N, _K))
    xu8 = rng.choice(np.array([255, 250, 240, 0, 7], np.uint8), size=(_M, _K))
    return w, xu8


def _expected(w, xu8, x_zp, arithmetic):
    acc = (xu8.astype(np.int64) - x_zp) @ w.astype(np.int64).T
    if arithmetic == ORT_X86_NOVNNI:
        acc = acc + saturation_correction(xu8, w, saturating_pairs(w))
    return acc


def _model(w, x_scale, x_zp, w_scale, y_scale, y_zp):
    f = np.float32
    inits = [numpy_helper.from_array(np.array(x_scale, f), "xs"), numpy_helper.from_array(np.array(x_zp, np.uint8), "xz"),
             numpy_helper.from_array(w.reshape(_N, _K, 1, 1), "wc"), numpy_helper.from_array(w, "wg"),
             numpy_helper.from_array(np.full(_N, w_scale, f), "ws"), numpy_helper.from_array(np.zeros(_N, np.int8), "wz"),
             numpy_helper.from_array(np.array(y_scale, f), "ys"), numpy_helper.from_array(np.array(y_zp, np.uint8), "yz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("QuantizeLinear", ["x4", "xs", "xz"], ["xq4"]),
             helper.make_node("DequantizeLinear", ["xq4", "xs", "xz"], ["xd4"]),
             helper.make_node("DequantizeLinear", ["wc", "ws", "wz"], ["wcd"], axis=0),
             helper.make_node("DequantizeLinear", ["wg", "ws", "wz"], ["wgd"], axis=0),
             helper.make_node("Conv", ["xd4", "wcd"], ["c"]),
             helper.make_node("Gemm", ["xd", "wgd"], ["g"], transB=1),
             helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["cq"]),
             helper.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["conv"]),
             helper.make_node("QuantizeLinear", ["g", "ys", "yz"], ["gq"]),
             helper.make_node("DequantizeLinear", ["gq", "ys", "yz"], ["gemm"])]
    g = helper.make_graph(nodes, "ort_arithmetic_probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [_M, _K]),
                           helper.make_tensor_value_info("x4", TensorProto.FLOAT, [1, _K, _M, 1])],
                          [helper.make_tensor_value_info("conv", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("gemm", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


@functools.lru_cache(maxsize=None)
def ort_int8_arithmetic() -> str:
    """"exact", "ort-x86-novnni" or "unknown" (neither: an arithmetic qtool does not know)."""
    import onnxruntime as ort

    w, xu8 = _probe_tensors()
    x_scale, x_zp, w_scale = 0.02, 7, 1e-3
    x = ((xu8.astype(np.float32) - x_zp) * np.float32(x_scale)).astype(np.float32)
    exact = _expected(w, xu8, x_zp, EXACT)
    y_scale = float(np.abs(exact).max() * x_scale * w_scale / 100.0)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(_model(w, x_scale, x_zp, w_scale, y_scale, 128).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    conv, gemm = sess.run(None, {"x": x, "x4": np.ascontiguousarray(x.T.reshape(1, _K, _M, 1))})
    got = [conv.reshape(_N, _M).T, gemm]
    mult = np.full(_N, np.float32(np.float32(x_scale) * np.float32(w_scale)) / np.float32(y_scale), np.float32)
    qp = Q.ActQParams(y_scale, 128)
    for arith in (EXACT, ORT_X86_NOVNNI):
        want = Q.dequantize(Q.requantize(_expected(w, xu8, x_zp, arith).astype(np.int32), mult, 128), qp)
        if all(np.array_equal(g, want) for g in got):
            return arith
    return UNKNOWN


def describe(arithmetic: str) -> str:
    """One line for `qtool info` and eval's warning."""
    if arithmetic == EXACT:
        return "exact: int8 x int8 sums in int32 (VNNI, AMX or ARM dot products)"
    if arithmetic == ORT_X86_NOVNNI:
        return ("NOT exact for int8 weights: ONNX Runtime adds neighbouring u8 x s8 products in a saturating int16 "
                "here (its x86 path without VNNI); models quantized with the default --target portable are exact")
    return "unknown: differs from both the exact and the x86-without-VNNI arithmetic qtool knows"
