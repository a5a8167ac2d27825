"""Ops that move uint8 values without computing new ones: Concat, Pad, and the shape ops (Reshape,
Transpose, Slice, nearest Resize, Gather, ...) run by their fp32 op on the uint8 data."""
from __future__ import annotations

import numpy as np

from qtool.runtime import steps as S
from qtool.runtime.lower import embedding
from qtool.runtime.lower.common import plain_output, uint8_input
from qtool.runtime.program import Entry, node_attrs

NCHW_TO_NHWC_AXIS = {0: 0, 1: 3, 2: 1, 3: 2}


def rule_concat(c, node):
    xs = [c.views.get(i) for i in node.input]
    if any(x is None for x in xs):
        return "an input is not a dequantized uint8 tensor"
    oq = plain_output(c, node)
    if isinstance(oq, str):
        return oq
    qnode, qy, _, _, fused = oq
    axis = node_attrs(node)["axis"]
    vs = [c.vals[x.src] for x in xs]
    rank = next((v.rank for v in vs if v.rank is not None), None)
    if rank is None:
        return "unknown input rank"
    axis %= rank
    if rank == 4 and any(v.nhwc for v in vs):
        slots = [c.nhwc_input(x.src) for x in xs]
        axis = NCHW_TO_NHWC_AXIS[axis]
        nhwc = True
    else:
        slots = [v.slot for v in vs]
        nhwc = False
    v = c.emit_q(qnode, nhwc=nhwc, q=qy, rank=rank, fused=fused, op_node=node)
    c.steps.append(S.ConcatStep(node.name or "Concat", c.K, slots, v.slot, axis, [(x.scale, x.zp) for x in xs], qy))
    c.entries.append(Entry(node.name or "Concat", "Concat", "int8", "concat"))
    return None


def rule_shape_op(c, node):
    x = uint8_input(c, node)
    if isinstance(x, str):
        return x
    if not all(c.is_const(i) for i in node.input[1:]):
        return "its shape/axes input is not constant"
    if node.op_type in ("Resize", "Upsample"):
        mode = node_attrs(node).get("mode", b"nearest")
        if (mode.decode() if isinstance(mode, bytes) else mode) != "nearest":
            return "only nearest Resize selects values (others interpolate)"
    oq = plain_output(c, node)
    if isinstance(oq, str):
        return oq
    qnode, qy, _, _, fused = oq
    src = c.vals[x.src]
    extra = [c.consts[i] if i else None for i in node.input[1:]]
    same = (np.float32(x.scale), x.zp) == (np.float32(qy[0]), qy[1])
    rank = c.ranks.get(node.output[0])
    v = c.emit_q(qnode, nhwc=False, q=qy, rank=rank, fused=fused, op_node=node)
    st = S.ShapeOpStep(node.name or node.op_type, node.op_type, src.slot, v.slot, extra, node_attrs(node), src.nhwc,
                       None if same else ((x.scale, x.zp), qy))
    c.steps.append(st)
    c.entries.append(Entry(node.name or node.op_type, node.op_type, "int8", "on uint8 data" + ("" if same else " + requantize")))
    return None


def _hw_pads(c, node):
    """(top, left, bottom, right) of a constant Pad of a rank-4 tensor's H and W, or the reason."""
    if len(node.input) < 2 or not all(c.is_const(i) for i in node.input[1:]) or (len(node.input) > 3 and node.input[3]):
        return "pads/value not constant, or an axes input"
    pads = [int(p) for p in c.consts[node.input[1]]]
    if len(pads) != 8 or any(pads[i] for i in (0, 1, 4, 5)) or min(pads) < 0:
        return "padding other than non-negative H/W padding of a rank-4 tensor"
    return pads[2], pads[3], pads[6], pads[7]


def rule_pad(c, node):
    x = uint8_input(c, node)
    if isinstance(x, str):
        return x
    mode = node_attrs(node).get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "constant":
        return f"mode={mode}"
    p4 = _hw_pads(c, node)
    if isinstance(p4, str):
        return p4
    src = c.vals[x.src]
    if not src.nhwc or src.rank not in (4, None):
        return "input is not an NHWC tensor"
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    qnode, qy, lo, hi, fused = oq
    if (np.float32(qy[0]), qy[1]) != (np.float32(x.scale), x.zp) or lo != 0 or hi != 255:
        return "the QuantizeLinear after it changes the scale"
    value = float(c.consts[node.input[2]].reshape(-1)[0]) if len(node.input) > 2 and node.input[2] else 0.0
    fill = int(np.clip(np.rint(np.float32(value) / np.float32(x.scale)) + x.zp, 0, 255))
    v = c.emit_q(qnode, nhwc=True, q=qy, rank=4, fused=fused, op_node=node)
    st = S.PadStep(node.name or "Pad", src.slot, v.slot, p4, fill)
    c.steps.append(st)
    c.pads[qnode.output[0]] = (x.src, p4, fill, st)
    c.entries.append(Entry(node.name or "Pad", "Pad", "int8", "pad"))
    return None


def rule_gather(c, node):
    """A Gather of an int8 embedding lookup (lower/embedding.py), else a shape op on uint8 data."""
    if embedding.rule_embedding(c, node) is None:
        return None
    return rule_shape_op(c, node)


SHAPE_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Slice", "Resize", "Upsample",
             "GatherElements", "Expand", "Tile", "DepthToSpace", "SpaceToDepth", "ReduceMax", "ReduceMin")

RULES = {"Concat": rule_concat, "Pad": rule_pad, "Gather": rule_gather, **{op: rule_shape_op for op in SHAPE_OPS}}
