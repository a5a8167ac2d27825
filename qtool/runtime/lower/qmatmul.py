"""MatMul of two dequantized uint8 activations (attention: Q K^T, probabilities x V) -> one QMatMulStep:

Before:  DQ(a_u8) , DQ(b_u8) -> MatMul -> [Q(y)]
After:   QMatMulStep(a_u8, b_u8) -> uint8 y (requantized to Q's scale) or float32 (no Q after)."""
from __future__ import annotations

import numpy as np

from qtool.runtime.backend import conv_multiplier
from qtool.runtime.program import Entry
from qtool.runtime.steps_qmatmul import QMatMulStep


def rule_qmatmul(c, node):
    a, b = c.views.get(node.input[0]), c.views.get(node.input[1])
    if a is None or b is None:
        return "its inputs are not both dequantized uint8 tensors"
    va, vb = c.vals[a.src], c.vals[b.src]
    ranks = (va.rank, vb.rank)
    if None in ranks or min(ranks) < 2:
        return "an input of unknown rank or rank 1"
    qa, qb = (a.zp, bool(va.nhwc)), (b.zp, bool(vb.nhwc))
    oq = c.out_quant(node.output[0])
    name = node.name or node.op_type
    rank = max(ranks)
    if isinstance(oq, str):
        mult = np.float32(np.float32(a.scale) * np.float32(b.scale))
        v = c.add_val(node.output[0], "f", rank=rank)
        c.steps.append(QMatMulStep(name, va.slot, vb.slot, v.slot, qa, qb, (mult, None, 0, 255)))
        detail = "float output"
    else:
        qnode, qy, lo, hi, fused = oq
        mult = conv_multiplier(c.K, a.scale, np.float32(b.scale), qy[0]).reshape(-1)[0]
        v = c.emit_q(qnode, nhwc=False, q=qy, rank=rank, fused=fused, op_node=node)
        c.steps.append(QMatMulStep(name, va.slot, vb.slot, v.slot, qa, qb, (mult, qy[1], lo, hi)))
        detail = ""
    c.entries.append(Entry(name, node.op_type, "int8", ("activation x activation " + detail).strip()))
    return None
