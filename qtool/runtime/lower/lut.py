"""Elementwise functions of one uint8 tensor -> a 256-entry table (one per channel for per-channel
ops): a single op between a DequantizeLinear and a QuantizeLinear (rule_lut), or a chain/DAG of
elementwise fp32 ops the quantizer left in float (rule_region). Tables are computed once at load
with the fp32 ops, as ORT would run them."""
from __future__ import annotations

import numpy as np

from qtool.runtime import steps as S
from qtool.runtime.fp32_ops import FP32_OPS
from qtool.runtime.lower.common import uint8_input
from qtool.runtime.program import Entry, node_attrs

LUT_OPS = {"Relu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "LeakyRelu", "Tanh", "Exp", "Neg", "Abs",
           "Sqrt", "Erf", "Gelu", "BatchNormalization", "Identity"}

ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Relu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish",
               "Tanh", "LeakyRelu", "Exp", "Log", "Neg", "Abs", "Min", "Max", "Erf", "Gelu", "Identity", "Reciprocal"}

REGION_MAX_ROUNDS = 64  # growth rounds of a region (each adds the ops reading what it produces)


def _dequantized_256(zp, scale):
    """The float32 values of the 256 uint8 codes."""
    return ((np.arange(256, dtype=np.int32) - zp).astype(np.float32) * np.float32(scale)).astype(np.float32)


def _emit_table(c, node, src_name, out_q, lut):
    """The LutStep for `lut` on uint8 tensor `src_name`, producing the output of the QuantizeLinear
    out_q = (Q node, (scale, zp), nodes fused); a per-tensor table is remembered for Mul's x * f(x)."""
    qnode, qy, fused = out_q
    srcv = c.vals[src_name]
    v = c.emit_q(qnode, nhwc=srcv.nhwc, q=qy, rank=srcv.rank, fused=fused, op_node=node)
    st = S.LutStep(node.name or node.op_type, node.op_type, srcv.slot, v.slot, lut, c.K)
    c.steps.append(st)
    if lut.ndim == 1:
        c.luts[qnode.output[0]] = (src_name, lut, st)


def rule_lut(c, node):
    """DQ -> elementwise op -> Q == a table lookup on the uint8 values (per channel for BN)."""
    x = uint8_input(c, node)
    if isinstance(x, str):
        return x
    if not all(c.is_const(i) for i in node.input[1:]):
        return "a non-constant second input"
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    qnode, qy, lo, hi, fused = oq
    src = c.vals[x.src]
    at = node_attrs(node)
    at["_n_outputs"] = 1
    vals = _dequantized_256(x.zp, x.scale)
    extra = [c.consts[i] if i else None for i in node.input[1:]]
    if node.op_type == "BatchNormalization":
        if not (src.nhwc and src.rank == 4) or any(len(node.output) > 1 and o for o in node.output[1:]):
            return "BatchNormalization on a tensor that is not NHWC rank 4"
        ch = extra[0].reshape(-1).shape[0]
        xin = np.ascontiguousarray(np.broadcast_to(vals, (1, ch, 256)))
    else:
        xin = vals
    y = FP32_OPS[node.op_type]([xin] + extra, at)[0].astype(np.float32)
    q = np.clip(np.clip(np.rint(y / np.float32(qy[0])) + np.float32(qy[1]), 0, 255), lo, hi).astype(np.uint8)
    lut = q.reshape(-1, 256) if node.op_type == "BatchNormalization" else q.reshape(256)
    _emit_table(c, node, x.src, (qnode, qy, fused), lut)
    c.entries.append(Entry(node.name or node.op_type, node.op_type, "int8", "lookup table" + (" per channel" if lut.ndim == 2 else "")))
    return None


def _region_input(c, node):
    """(uint8 tensor, scale, zp, names of its dq views) when every input of `node` is a dq view of
    one uint8 tensor or a constant; else the reason."""
    views = {i: c.views[i] for i in node.input if i and i in c.views}
    if not views or any(i and i not in views and not c.is_const(i) for i in node.input):
        return "inputs are not one uint8 tensor and constants"
    keys = {(v.src, float(v.scale), v.zp) for v in views.values()}
    if len(keys) != 1:
        return "inputs come from different uint8 tensors"
    src_name, scale, zp = next(iter(keys))
    return src_name, scale, zp, set(views)


def _grow_region(c, node, names):
    """The elementwise ops reachable from `node` that read only the region, `names` (the source's dq
    views) and constants, up to the one QuantizeLinear every path ends in.
    -> (region nodes in order, (tensor the Q reads, Q node)) or the reason."""
    region, ids, produced = [node], {id(node)}, {o for o in node.output if o}
    for _ in range(REGION_MAX_ROUNDS):
        if produced & c.graph_outputs:
            return "part of the chain is a graph output"
        ext = [(v, m) for v in produced for m in c.consumers.get(v, []) if id(m) not in ids]
        if len(ext) == 1 and ext[0][1].op_type == "QuantizeLinear" and c.scalar_q(ext[0][1]) is not None \
                and all(len([m for m in c.consumers.get(v, []) if id(m) not in ids]) == 0 for v in produced if v != ext[0][0]):
            return region, ext[0]
        added = False
        for v, m in ext:
            if id(m) in ids or id(m) in c.done:
                continue
            if m.op_type in ELEMENTWISE and all(not i or i in produced or i in names or c.is_const(i) for i in m.input):
                region.append(m)
                ids.add(id(m))
                produced |= {o for o in m.output if o}
                added = True
        if not added:
            return "the elementwise chain does not end in one QuantizeLinear"
    return "elementwise chain too long"


def _channels(c, region, srcv):
    """Length of the per-channel constants in the region (None: all scalars), or the reason."""
    per_channel = None
    for i in (i for m in region for i in m.input if i and c.is_const(i)):
        a = c.consts[i]
        if a.size > 1:
            sq = np.squeeze(a)
            if sq.ndim != 1 or not (srcv.nhwc and srcv.rank == 4) or a.ndim not in (3, 4) or a.shape[-1] != 1 or a.shape[-2] != 1:
                return f"constant of shape {list(a.shape)} is neither a scalar nor per channel"
            if per_channel not in (None, sq.shape[0]):
                return "per-channel constants of different lengths"
            per_channel = sq.shape[0]
    return per_channel


def _tabulate(c, region, env):
    """Runs the region's fp32 ops on `env` (its inputs' 256 values), adding their outputs. -> None
    or the reason."""
    for m in region:
        ins = []
        for i in m.input:
            if not i:
                ins.append(None)
            elif i in env:
                ins.append(env[i])
            else:
                a = c.consts[i]
                ins.append(a.reshape(()) if a.size == 1 else np.squeeze(a).reshape(-1, 1))
        at = node_attrs(m)
        at["_n_outputs"] = len(m.output)
        try:
            ys = FP32_OPS[m.op_type](ins, at)
        except Exception as e:  # an attribute combination the numpy op does not take
            return f"cannot tabulate {m.op_type}: {e}"
        for o, y in zip(m.output, ys):
            if o:
                env[o] = np.asarray(y, np.float32)
    return None


def rule_region(c, node):
    """A chain/DAG of elementwise fp32 ops whose only non-constant input is one uint8 tensor and
    which ends in one QuantizeLinear (e.g. hard-swish x * Clip(x + 3, 0, 6) / 6 left in float by
    the quantizer) is a function of that tensor's 256 values: one table (per channel when a
    constant is per channel)."""
    r = _region_input(c, node)
    if isinstance(r, str):
        return r
    src_name, scale, zp, names = r
    g = _grow_region(c, node, names)
    if isinstance(g, str):
        return g
    region, (out_name, qnode) = g
    qy = c.scalar_q(qnode)
    srcv = c.vals[src_name]
    per_channel = _channels(c, region, srcv)
    if isinstance(per_channel, str):
        return per_channel
    vals = _dequantized_256(zp, scale)
    if per_channel:
        vals = np.ascontiguousarray(np.broadcast_to(vals, (per_channel, 256)))
    env = {n: vals for n in names}
    err = _tabulate(c, region, env)
    if err is not None:
        return err
    y = np.broadcast_to(env[out_name], vals.shape).astype(np.float32)
    lut = np.clip(np.rint(y / np.float32(qy[0])) + np.float32(qy[1]), 0, 255).astype(np.uint8)
    for m in region[1:]:
        c.done.add(id(m))
        c.entries.append(Entry(m.name or m.op_type, m.op_type, "fused", f"into the table of {node.name or node.op_type}"))
    _emit_table(c, node, src_name, (qnode, qy, [qnode]), lut)
    c.entries.append(Entry(node.name or node.op_type, node.op_type, "int8",
                           f"lookup table of {len(region)} elementwise ops" + (" per channel" if lut.ndim == 2 else "")))
    return None


RULES = {op: rule_lut for op in LUT_OPS}
