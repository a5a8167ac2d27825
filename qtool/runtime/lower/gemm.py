"""Gemm and MatMul with a constant int8 weight -> one GemmStep (uint8 output, or float when no
QuantizeLinear follows, e.g. the logits)."""
from __future__ import annotations

import numpy as np

from qtool.runtime import saturating
from qtool.runtime import steps as S
from qtool.runtime.backend import conv_multiplier
from qtool.runtime.lower import dynamic, qmatmul
from qtool.runtime.lower.common import uint8_input
from qtool.runtime.program import Entry, node_attrs


def _gemm_like(c, node, wq_nk, sw, bias_name, x):
    src = c.vals[x.src]
    if src.nhwc and src.rank == 4:
        return "its input is a rank-4 NHWC tensor"
    oq = c.out_quant(node.output[0])
    bias = c.bias(bias_name, x.scale, sw, wq_nk, x.zp)
    K = saturating if c.saturates(node.input[1], lambda: wq_nk) else c.K
    if isinstance(oq, str):  # float output (e.g. the logits): y = acc * s_x * s_w
        mult = (np.float32(x.scale) * sw).astype(np.float32)
        packed = K.pack_gemm(wq_nk, bias, x_zp=x.zp, multiplier=mult, out_dtype="float32")
        v = c.add_val(node.output[0], "f", rank=src.rank)
        detail = "float output"
    else:
        qnode, qy, lo, hi, fused = oq
        mult = conv_multiplier(c.K, x.scale, sw, qy[0])
        packed = K.pack_gemm(wq_nk, bias, x_zp=x.zp, multiplier=mult, y_zp=qy[1], lo=lo, hi=hi)
        v = c.emit_q(qnode, nhwc=False, q=qy, rank=src.rank, fused=fused, op_node=node)
        detail = ""
    st = S.GemmStep(node.name or node.op_type, node.op_type, K, packed, src.slot, v.slot)
    st.k = wq_nk.shape[1]
    c.steps.append(st)
    c.entries.append(Entry(node.name or node.op_type, node.op_type, "int8", (st.kernel + " " + detail).strip()))
    return None


def rule_gemm(c, node):
    x = uint8_input(c, node)
    if isinstance(x, str):
        return x
    at = node_attrs(node)
    if at.get("transA", 0) or at.get("alpha", 1.0) != 1.0 or (len(node.input) > 2 and at.get("beta", 1.0) != 1.0):
        return "transA/alpha/beta other than the defaults"
    trans_b = at.get("transB", 0)
    w = c.weight(node.input[1], 0 if trans_b else 1)
    if isinstance(w, str):
        return w
    wq, sw = w
    wq_nk = wq if trans_b else np.ascontiguousarray(wq.T)
    if len(node.input) > 2 and node.input[2] and c.consts.get(node.input[2], np.zeros(1)).ndim > 1:
        return "a bias that is not a vector"
    return _gemm_like(c, node, wq_nk, sw, node.input[2] if len(node.input) > 2 else "", x)


def rule_matmul(c, node):
    if node.input[0] in c.dynamic_views:
        return dynamic.rule_dynamic_matmul(c, node)
    if node.input[1] in c.views:
        return qmatmul.rule_qmatmul(c, node)
    x = uint8_input(c, node)
    if isinstance(x, str):
        return x
    if node.input[1] not in c.qconst or c.qconst[node.input[1]].q.ndim != 2:
        return "its second input is not a 2-D quantized constant"
    w = c.weight(node.input[1], 1)
    if isinstance(w, str):
        return w
    wq, sw = w
    return _gemm_like(c, node, np.ascontiguousarray(wq.T), sw, "", x)


RULES = {"Gemm": rule_gemm, "MatMul": rule_matmul}
