"""Gemm and MatMul with a constant weight: x uint8, W int8 per output feature, bias int32.

Gemm's output features are W's axis 0 when transB=1, axis 1 otherwise; MatMul's B is
[K, N], so per output feature means axis 1 (its last axis).
"""
from qtool import graph as G


def _gemm_check(node, model):
    if G.attr(node, "transA", 0):
        return "transA=1 is not supported"
    if G.const_value(model, node.input[1]) is None:
        return "B is not a constant"
    if G.attr(node, "alpha", 1.0) != 1.0 or G.attr(node, "beta", 1.0) != 1.0:
        return "alpha/beta other than 1"
    if len(node.input) > 2 and node.input[2]:
        c = G.const_value(model, node.input[2])
        if c is None or c.ndim > 1 and c.shape[0] != 1:
            return "C is not a constant vector"
    return None


def _matmul_check(node, model):
    b = G.const_value(model, node.input[1])
    if b is None:
        return "B is not a constant (activation x activation MatMul stays fp32)"
    if b.ndim != 2:
        return f"B has rank {b.ndim}, only 2-D weights are quantized"
    return None


RULES = {
    "Gemm": dict(kind="compute", act_inputs=lambda n: [0],
                 weight=lambda n, m: (1, 0 if G.attr(n, "transB", 0) else 1), bias=2, check=_gemm_check),
    "MatMul": dict(kind="compute", act_inputs=lambda n: [0], weight=lambda n, m: (1, 1), check=_matmul_check),
}
