"""MaxPool, AveragePool, GlobalAveragePool on uint8 NHWC tensors."""
from __future__ import annotations

import numpy as np

from qtool.runtime import steps as S
from qtool.runtime.lower.common import image_input, window_attrs
from qtool.runtime.program import Entry


def _pool_common(c, node):
    """-> (input view, attributes, out_quant) of a pooling window the kernels take, or the reason."""
    x = image_input(c, node, "pooling")
    if isinstance(x, str):
        return x
    wa = window_attrs(node)
    if isinstance(wa, str):
        return wa
    at, _ = wa
    if len(node.output) > 1 and node.output[1]:
        return "MaxPool with an Indices output"
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    return x, at, oq


def rule_maxpool(c, node):
    r = _pool_common(c, node)
    if isinstance(r, str):
        return r
    x, at, (qnode, qy, lo, hi, fused) = r
    if at.get("storage_order", 0):
        return "storage_order=1"
    same = (np.float32(x.scale), x.zp) == (np.float32(qy[0]), qy[1]) and lo == 0 and hi == 255
    if not same and (lo != 0 or hi != 255):
        return "MaxPool followed by Relu/Clip and a different scale"
    xs = c.nhwc_input(x.src)
    if same:
        v = c.emit_q(qnode, nhwc=True, q=qy, rank=4, fused=fused, op_node=node)
        c.steps.append(S.MaxPoolStep(node.name or "MaxPool", c.K, xs, v.slot, at))
    else:  # max commutes with the monotonic requantization: pool, then requantize
        mid = c.add_val(node.output[0] + "#pooled", "q", nhwc=True, q=(x.scale, x.zp), rank=4)
        c.steps.append(S.MaxPoolStep(node.name or "MaxPool", c.K, xs, mid.slot, at))
        v = c.emit_q(qnode, nhwc=True, q=qy, rank=4, fused=fused, op_node=node)
        c.steps.append(S.RequantStep(node.name + " requantize", c.K, mid.slot, v.slot, (x.scale, x.zp), qy))
    c.entries.append(Entry(node.name or "MaxPool", "MaxPool", "int8", "maxpool" + ("" if same else " + requantize")))
    return None


def rule_avgpool(c, node):
    r = _pool_common(c, node)
    if isinstance(r, str):
        return r
    x, at, (qnode, qy, lo, hi, fused) = r
    if at.get("ceil_mode", 0) and at.get("count_include_pad", 0):
        return "ceil_mode with count_include_pad"
    if tuple(at.get("dilations", [1, 1])) != (1, 1):
        return "dilated AveragePool"
    xs = c.nhwc_input(x.src)
    v = c.emit_q(qnode, nhwc=True, q=qy, rank=4, fused=fused, op_node=node)
    c.steps.append(S.AvgPoolStep(node.name or "AveragePool", c.K, xs, v.slot, at, (x.scale, x.zp),
                                 S.OutQuant(qy[0], qy[1], lo, hi)))
    c.entries.append(Entry(node.name or "AveragePool", "AveragePool", "int8", "avgpool"))
    return None


def rule_gap(c, node):
    x = image_input(c, node, "input")
    if isinstance(x, str):
        return x
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    qnode, qy, lo, hi, fused = oq
    xs = c.nhwc_input(x.src)
    v = c.emit_q(qnode, nhwc=True, q=qy, rank=4, fused=fused, op_node=node)
    c.steps.append(S.GlobalAvgPoolStep(node.name or "GlobalAveragePool", c.K, xs, v.slot, (x.scale, x.zp),
                                       S.OutQuant(qy[0], qy[1], lo, hi)))
    c.entries.append(Entry(node.name or "GlobalAveragePool", "GlobalAveragePool", "int8", "global_avgpool"))
    return None


RULES = {"MaxPool": rule_maxpool, "AveragePool": rule_avgpool, "GlobalAveragePool": rule_gap}
