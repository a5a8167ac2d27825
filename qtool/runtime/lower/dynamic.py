"""Dynamic quantization (what `quantize_dynamic` and qtool's per-layer dynamic inputs write), in either
of the two forms ONNX has for it:

Before:
    DynamicQuantizeLinear(x) -> (y, s, z) -> MatMulInteger(y, w_q, z, w_z) -> Cast -> Mul(., s * s_w)
    DynamicQuantizeLinear(x) -> (y, s, z) -> DequantizeLinear(y, s, z) -> MatMul(., DQ(w_int8, s_w, axis=1))
After:
    DynamicQuantizeStep(x) -> (y_u8, s, z) -> DynamicGemmStep(y_u8, s, z; w packed once) -> float32

A following Add of a constant row (the layer's bias) runs in the same step. In the second form the
DequantizeLinear becomes no step when every reader is such a MatMul (a *dynamic view*); else it runs
in fp32 and the MatMuls with it. The weight: int8 with zero point 0 (or uint8 with 128), one scale or
one per output column. Arithmetic: qtool/runtime/dynamic_quant.py."""
from __future__ import annotations

import numpy as np
import onnx

from qtool.runtime import saturating
from qtool.runtime import steps as S
from qtool.runtime.dynamic_quant import k_chunks
from qtool.runtime.lower.common import only_reader
from qtool.runtime.program import Entry, node_attrs
from qtool.runtime.steps_dynamic import DynamicGemmStep, DynamicQuantizeStep


def rule_dynamic_quantize(c, node):
    return quantize(c, node, node.input[0])


def quantize(c, node, x_name, multiplier=None, fused=()):
    """DynamicQuantizeLinear `node` of float `x_name` (times `multiplier` [n] over the last axis, the Mul
    `fused` made of it) -> DynamicQuantizeStep; the MatMulIntegers reading it looked at (_integer_chain)."""
    outs = list(node.output) + [""] * (3 - len(node.output))
    if not all(outs):
        return "not all three outputs are used"
    x = c.float_input(x_name)
    slots = [c.add_val(o, "f", rank=r).slot for o, r in zip(outs, (c.ranks.get(node.input[0]), 0, 0))]
    name = node.name or node.op_type
    c.steps.append(DynamicQuantizeStep(name, c.K, x, *slots, multiplier=multiplier))
    c.done.add(id(node))  # (reached from the Mul before it, ahead of its turn)
    c.dynamic[outs[0]] = (outs[1], outs[2])
    for r in c.consumers.get(outs[0], []):
        if r.op_type == "MatMulInteger":
            chain = _integer_chain(c, r, outs[1], outs[2])
            if not isinstance(chain, str):
                c.integer_chains[id(r)] = chain
                scale_mul = chain[2]
                if all(n is chain[1] for n in c.consumers.get(scale_mul.output[0], [])) \
                        and scale_mul.output[0] not in c.graph_outputs:
                    c.done.add(id(scale_mul))  # (s * s_w: the step multiplies by it itself)
    for f in fused:
        c.done.add(id(f))
        c.entries.append(Entry(f.name or f.op_type, f.op_type, "fused", f"into {name}"))
    c.entries.append(Entry(name, node.op_type, "int8", "uint8 per tensor, at run time"
                           + (", of the Mul's product" if fused else "")))
    return None


def rule_scaled_quantize(c, node, F):
    """Mul(x, a float32 row [n] over x's last axis) read only by a DynamicQuantizeLinear (a migration's
    1/s, quantize/migrate.py) -> one DynamicQuantizeStep of x with the row as its multiplier."""
    if F is None or node.op_type != "Mul" or len(node.input) != 2:
        return "not a Mul"
    dql = only_reader(c, node.output[0], "DynamicQuantizeLinear")
    if dql is None:
        return "not read by one DynamicQuantizeLinear alone"
    for x, k in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
        m = c.consts.get(k)
        if x in c.consts or m is None or m.dtype != np.float32 or m.ndim < 1 or any(d != 1 for d in m.shape[:-1]):
            continue
        rank = c.ranks.get(x)
        if rank is None or m.ndim > rank or c.elem_types.get(x, onnx.TensorProto.FLOAT) != onnx.TensorProto.FLOAT:
            continue
        if m.shape[-1] == 1 or c.last_dims.get(x) != m.shape[-1]:
            continue  # (a scalar, or a row x's last axis would broadcast over: the Mul as it is)
        return quantize(c, dql, x, m.reshape(-1), fused=(node,))
    return "not a Mul by a float32 row over the last axis"


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
    w = _weight(c, node.input[1])
    if isinstance(w, str):
        _dequantized(c, node.input[0])
        return w
    wq, sw = w
    _emit(c, node, y, np.ascontiguousarray(wq.T), sw, node, c.qconst[node.input[1]].q.dtype)
    return None


def _integer_chain(c, node, s, z):
    """MatMulInteger `node` reading a DynamicQuantizeLinear's uint8 output with its zero point `z`, an
    int8 (zero point 0) or uint8 (128) 2-D constant weight, its int32 output only cast to float and
    multiplied by (`s` times a constant s_w, one or one per column): (Cast, Mul, the Mul making s * s_w,
    int8 w [K, N], s_w [N], the weight's stored type); else the reason."""
    if len(node.input) < 3 or node.input[2] != z:
        return "its first input's zero point is not the DynamicQuantizeLinear's"
    wq = c.consts.get(node.input[1])
    if wq is None or wq.ndim != 2 or wq.dtype not in (np.int8, np.uint8):
        return "its second input is not a 2-D int8 constant"
    zw = c.consts.get(node.input[3]) if len(node.input) > 3 and node.input[3] else np.zeros((), wq.dtype)
    if zw is None or zw.dtype != wq.dtype or zw.size not in (1, wq.shape[1]) \
            or np.any(zw != (128 if wq.dtype == np.uint8 else 0)):
        return "its weight's zero point is not 0 (int8) or 128 (uint8)"
    cast = only_reader(c, node.output[0], "Cast")
    if cast is None or node_attrs(cast).get("to") != onnx.TensorProto.FLOAT:
        return "its int32 output is not only cast to float"
    mul = only_reader(c, cast.output[0], "Mul")
    if mul is None or mul.input[0] == mul.input[1]:
        return "its float output is not only multiplied by the scales"
    scale_mul = c.producers.get(mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0])
    if scale_mul is None or scale_mul.op_type != "Mul" or s not in scale_mul.input:
        return "its float output is not multiplied by the DynamicQuantizeLinear's scale times the weight's"
    sw = c.consts.get(scale_mul.input[1] if scale_mul.input[0] == s else scale_mul.input[0])
    if sw is None or sw.dtype != np.float32 or sw.size not in (1, wq.shape[1]) or sw.ndim > 1:
        return "its weight scale is not a constant float32, one or one per column"
    q = (wq.astype(np.int16) - 128).astype(np.int8) if wq.dtype == np.uint8 else wq
    return cast, mul, scale_mul, q, np.broadcast_to(sw.reshape(-1), (wq.shape[1],)).astype(np.float32), wq.dtype


def rule_matmul_integer(c, node):
    """MatMulInteger -> Cast -> Mul(s * s_w) on a DynamicQuantizeLinear (_integer_chain) -> DynamicGemmStep."""
    chain = c.integer_chains.get(id(node))
    if chain is None:
        return ("its first input is not a DynamicQuantizeLinear's output" if node.input[0] not in c.dynamic
                else _integer_chain(c, node, *c.dynamic[node.input[0]]))
    cast, mul, scale_mul, wq, sw, stored = chain
    _emit(c, node, node.input[0], np.ascontiguousarray(wq.T), sw, mul, stored)
    for n in (cast, mul) + ((scale_mul,) if id(scale_mul) in c.done else ()):
        c.done.add(id(n))
        c.entries.append(Entry(n.name or n.op_type, n.op_type, "fused", f"into {node.name or node.op_type}"))
    return None


def _emit(c, node, y, w_nk, sw, last, stored):
    """The DynamicGemmStep of `node` on uint8 `y` (a DynamicQuantizeLinear's) and int8 w [N, K] (stored as
    `stored`, int8 or uint8), per-column scales sw; it writes `last`'s output (the node, or the Mul closing
    its chain), or that of a bias Add after it."""
    s, z = c.dynamic[y]
    K = saturating if c.saturates_stored(stored, lambda: w_nk) else c.K
    chunks = [(k0, k1, K.pack_gemm(np.ascontiguousarray(w_nk[:, k0:k1]), None, x_zp=0, multiplier=1.0,
                                   out_dtype="float32")) for k0, k1 in k_chunks(w_nk)]
    ins = [c.vals[y].slot, c.vals[s].slot, c.vals[z].slot]
    add, bias = _bias_add(c, last, w_nk.shape[0], c.vals[y].rank)
    v = c.add_val((add or last).output[0], "f", rank=c.vals[y].rank)
    st = DynamicGemmStep(node.name or node.op_type, K, chunks, w_nk.astype(np.int64).sum(axis=1), sw, ins, v.slot)
    st.bias = bias
    c.steps.append(st)
    detail = f"{st.kernel}" + (f", K in {len(chunks)} chunks" if len(chunks) > 1 else "")
    if add is not None:
        c.done.add(id(add))
        c.entries.append(Entry(add.name or add.op_type, add.op_type, "fused", f"into {node.name or node.op_type}"))
    c.entries.append(Entry(node.name or node.op_type, node.op_type, "int8", detail))


def _bias_add(c, node, n, rank):
    """The Add of a constant float32 row [N] (any leading 1s) that alone reads the node's output:
    (Add node, bias) to add in the same step (after the float32 product, one more rounding, as the
    separate Add gives), else (None, None)."""
    out = node.output[0]
    add = only_reader(c, out, "Add")
    if add is None:
        return None, None
    other = add.input[1] if add.input[0] == out else add.input[0]
    b = c.consts.get(other)
    if b is None or add.input[0] == add.input[1] or b.dtype != np.float32 or b.size != n or b.shape[-1] != n \
            or rank is None or b.ndim > rank:
        return None, None
    return add, np.ascontiguousarray(b.reshape(-1))


RULES = {"DynamicQuantizeLinear": rule_dynamic_quantize, "DequantizeLinear": rule_dynamic_view,
         "MatMulInteger": rule_matmul_integer}
