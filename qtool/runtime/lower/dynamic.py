"""Dynamic quantization (what `quantize_dynamic` and qtool's per-layer dynamic inputs write):

Before:
    DynamicQuantizeLinear(x) -> (y, s, z) -> DequantizeLinear(y, s, z) -> MatMul(., DQ(w_int8, s_w, axis=1))
After:
    DynamicQuantizeStep(x) -> (y_u8, s, z) -> DynamicGemmStep(y_u8, s, z; w packed once) -> float32

The DequantizeLinear becomes no step when every reader is such a MatMul (a *dynamic view*); else it
runs in fp32 and the MatMuls with it. The weight: int8 with zero point 0 (or uint8 with 128), one
scale or one per output column. Arithmetic: qtool/runtime/dynamic_quant.py."""
from __future__ import annotations

import numpy as np

from qtool.runtime import saturating
from qtool.runtime import steps as S
from qtool.runtime.dynamic_quant import k_chunks
from qtool.runtime.program import Entry
from qtool.runtime.steps_dynamic import DynamicGemmStep, DynamicQuantizeStep


def rule_dynamic_quantize(c, node):
    outs = list(node.output) + [""] * (3 - len(node.output))
    if not all(outs):
        return "not all three outputs are used"
    x = c.float_input(node.input[0])
    slots = [c.add_val(o, "f", rank=r).slot for o, r in zip(outs, (c.ranks.get(node.input[0]), 0, 0))]
    c.steps.append(DynamicQuantizeStep(node.name or node.op_type, c.K, x, *slots))
    c.dynamic[outs[0]] = (outs[1], outs[2])
    c.entries.append(Entry(node.name or node.op_type, node.op_type, "int8", "uint8 per tensor, at run time"))
    return None


def _weight(c, name):
    if name not in c.qconst or c.qconst[name].q.ndim != 2:
        return "its second input is not a 2-D quantized constant"
    return c.weight(name, 1)


def rule_dynamic_view(c, node):
    """DequantizeLinear(y, s, z) of a DynamicQuantizeLinear read only as the first input of MatMuls:
    no step. A MatMul that cannot take it (its weight is not int8) has it dequantized then."""
    y = node.input[0]
    if y not in c.dynamic or tuple(node.input[1:3]) != c.dynamic[y]:
        return "not a dequantized uint8 tensor"
    out = node.output[0]
    readers = c.consumers.get(out, [])
    if out in c.graph_outputs or not readers:
        return "its output is a graph output"
    for r in readers:
        if r.op_type != "MatMul" or r.input[0] != out:
            return f"read by {r.op_type}, not as the first input of a MatMul"
    c.dynamic_views[out] = (y, node)
    c.entries.append(Entry(node.name or node.op_type, node.op_type, "fused", "into the dynamic MatMuls reading it"))
    return None


def _dequantized(c, name):
    """The float32 of dynamic view `name`, as one fp32 DequantizeLinear step (made once)."""
    if name not in c.vals:
        y, dq = c.dynamic_views[name]
        s, z = c.dynamic[y]
        v = c.add_val(name, "f", rank=c.vals[y].rank)
        ins = [c.vals[y].slot, c.vals[s].slot, c.vals[z].slot]
        c.steps.append(S.FP32Step(dq.name or dq.op_type, "DequantizeLinear", ins, [v.slot], {"_n_outputs": 1},
                                  "read by a MatMul that has no int8 weight"))
    return c.vals[name].slot


def rule_dynamic_matmul(c, node):
    """MatMul(dynamic view, DQ(int8 weight)) -> DynamicGemmStep (float32 output)."""
    y, _ = c.dynamic_views[node.input[0]]
    s, z = c.dynamic[y]
    w = _weight(c, node.input[1])
    if isinstance(w, str):
        _dequantized(c, node.input[0])
        return w
    wq, sw = w
    w_nk = np.ascontiguousarray(wq.T)
    K = saturating if c.saturates(node.input[1], lambda: w_nk) else c.K
    chunks = [(k0, k1, K.pack_gemm(np.ascontiguousarray(w_nk[:, k0:k1]), None, x_zp=0, multiplier=1.0,
                                   out_dtype="float32")) for k0, k1 in k_chunks(w_nk)]
    ins = [c.vals[y].slot, c.vals[s].slot, c.vals[z].slot]
    add, bias = _bias_add(c, node, w_nk.shape[0])
    v = c.add_val((add or node).output[0], "f", rank=c.vals[y].rank)
    st = DynamicGemmStep(node.name or node.op_type, K, chunks, w_nk.astype(np.int64).sum(axis=1), sw, ins, v.slot)
    st.bias = bias
    c.steps.append(st)
    detail = f"{st.kernel}" + (f", K in {len(chunks)} chunks" if len(chunks) > 1 else "")
    if add is not None:
        c.done.add(id(add))
        c.entries.append(Entry(add.name or add.op_type, add.op_type, "fused", f"into {node.name or node.op_type}"))
    c.entries.append(Entry(node.name or node.op_type, node.op_type, "int8", detail))
    return None


def _bias_add(c, node, n):
    """The Add of a constant float32 row [N] (any leading 1s) that alone reads the MatMul's output:
    (Add node, bias) to add in the same step (after the float32 product, one more rounding, as the
    separate Add gives), else (None, None)."""
    out = node.output[0]
    readers = c.consumers.get(out, [])
    if out in c.graph_outputs or len(readers) != 1 or readers[0].op_type != "Add":
        return None, None
    add = readers[0]
    other = add.input[1] if add.input[0] == out else add.input[0]
    b = c.consts.get(other)
    if b is None or add.input[0] == add.input[1] or b.dtype != np.float32 or b.size != n or b.shape[-1] != n \
            or b.ndim > c.vals[c.dynamic_views[node.input[0]][0]].rank:
        return None, None
    return add, np.ascontiguousarray(b.reshape(-1))


RULES = {"DynamicQuantizeLinear": rule_dynamic_quantize, "DequantizeLinear": rule_dynamic_view}
