"""Two-input elementwise ops on uint8 tensors: Add, and Mul (x * f(x), f a table, folds into one table)."""
from __future__ import annotations

import numpy as np

from qtool.runtime import steps as S
from qtool.runtime.program import Entry

NOT_UINT8_PAIR = "an input is not a dequantized uint8 tensor"


def _binary_slots(c, a, b):
    """Buffers for a two-input op: both as they are when their layouts agree, else both NHWC."""
    va, vb = c.vals[a.src], c.vals[b.src]
    if va.nhwc != vb.nhwc:
        return c.nhwc_input(a.src), c.nhwc_input(b.src), True
    return va.slot, vb.slot, va.nhwc


def _uint8_pair(c, node):
    """(a, b, the output's quantization) of a binary op whose two inputs are uint8, or the reason not."""
    a, b = (c.views.get(i) for i in node.input)
    if a is None or b is None:
        return NOT_UINT8_PAIR
    oq = c.out_quant(node.output[0])
    return oq if isinstance(oq, str) else (a, b, oq)


def rule_add(c, node):
    got = _uint8_pair(c, node)
    if isinstance(got, str):
        return got
    a, b, oq = got
    return _emit_binary(c, node, a, b, oq, S.AddStep)


def _emit_binary(c, node, a, b, oq, step_type):
    """The int8 step of a binary op (AddStep, MulStep) on two uint8 inputs, its output quantized as `oq`."""
    qnode, qy, lo, hi, fused = oq
    sa, sb, nhwc = _binary_slots(c, a, b)
    v = c.emit_q(qnode, nhwc=nhwc, q=qy, rank=c.vals[a.src].rank, fused=fused, op_node=node)
    st = step_type(node.name or node.op_type, c.K, sa, sb, v.slot, (a.scale, a.zp), (b.scale, b.zp),
                   S.OutQuant(qy[0], qy[1], lo, hi))
    c.steps.append(st)
    c.entries.append(Entry(node.name or node.op_type, node.op_type, "int8", st.kernel))
    return None


def _times_table(c, node, a, b, oq):
    """x * f(x) with f(x) a table on x read here alone (SiLU = x * Sigmoid(x)): one table replacing
    f's. -> True when it applied."""
    qnode, qy, lo, hi, fused = oq
    for x, g in ((a, b), (b, a)):
        t = c.luts.get(g.src)
        only_here = len(c.consumers.get(g.src, [])) == 1 and sum(
            len(c.consumers.get(d.output[0], [])) for d in c.consumers.get(g.src, [])) == 1
        if t is None or t[0] != x.src or not only_here:
            continue
        src_name, table, lut_step = t
        xs = np.arange(256, dtype=np.int32)
        p = (xs - x.zp) * (table.astype(np.int32) - g.zp)
        ratio = np.float32(np.float32(np.float32(x.scale) * np.float32(g.scale)) / np.float32(qy[0]))
        f = (p.astype(np.float32) * ratio).astype(np.float32) + np.float32(qy[1])
        lut = np.clip(np.rint(f), lo, hi).astype(np.uint8)
        c.steps.remove(lut_step)
        for e in c.entries:
            if e.node == lut_step.name and e.mode == "int8":
                e.mode, e.detail = "fused", f"into {node.name or 'Mul'} (one table for x * f(x))"
        src = c.vals[x.src]
        v = c.emit_q(qnode, nhwc=src.nhwc, q=qy, rank=src.rank, fused=fused, op_node=node)
        st = S.LutStep(node.name or "Mul", "Mul", src.slot, v.slot, lut, c.K)
        c.steps.append(st)
        c.luts[qnode.output[0]] = (x.src, lut, st)
        c.entries.append(Entry(node.name or "Mul", "Mul", "int8", "lookup table x * f(x)"))
        return True
    return False


def rule_mul(c, node):
    got = _uint8_pair(c, node)
    if isinstance(got, str):
        return got
    a, b, oq = got
    if _times_table(c, node, a, b, oq):
        return None
    va, vb = c.vals[a.src], c.vals[b.src]
    if va.rank != vb.rank or va.rank is None:
        return "inputs of different or unknown rank"
    return _emit_binary(c, node, a, b, oq, S.MulStep)


RULES = {"Add": rule_add, "Mul": rule_mul}
