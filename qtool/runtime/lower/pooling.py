"""A masked mean as sentence encoders export their pooling (sentence-transformers' mean pooling):

Before:
    c = Cast(Expand(m, shape))                      (m: the mask, unsqueezed; shape: the token states')
    Div(ReduceSum(Mul(h, c), axes), Clip(ReduceSum(c, axes), lo, hi))
After:
    MaskedMeanStep(h, m, shape): the same ops on m cast first and broadcast as a view

The expanded mask is never written: Expand and Cast on [batch, tokens, width] were the two costliest of the
seven numpy steps, and seven Python calls become one (the zoo MiniLM at 32 tokens, after another engine's run
has taken the caches: ~100 us of 1.7 ms). The values are the nodes' (a cast commutes with a broadcast; the
sums, the clip and the division are the same numpy ops on the same values). Reached from the Expand; anything
else about the seven nodes and they run one by one."""
from __future__ import annotations

from onnx import TensorProto

from qtool.runtime.program import Entry, node_attrs
from qtool.runtime.steps_f32 import MaskedMeanStep


def _only_reader(c, name, op):
    r = c.consumers.get(name, [])
    return r[0] if len(r) == 1 and r[0].op_type == op and name not in c.graph_outputs else None


def _reduce_axes(c, node):
    """(axes, keepdims) of a ReduceSum with constant axes, or None."""
    at = node_attrs(node)
    axes = c.consts.get(node.input[1]) if len(node.input) > 1 and node.input[1] else at.get("axes")
    if axes is None or at.get("noop_with_empty_axes", 0) or (len(node.input) > 1 and node.input[1] not in c.consts):
        return None
    return tuple(int(a) for a in list(axes)), int(at.get("keepdims", 1))


def pattern(c, expand):
    """(Cast, Mul, ReduceSum of the product, ReduceSum of the mask, Clip, Div, token states) from `expand`, or None."""
    cast = _only_reader(c, expand.output[0], "Cast")
    if cast is None or node_attrs(cast).get("to") != TensorProto.FLOAT or cast.output[0] in c.graph_outputs:
        return None
    readers = c.consumers.get(cast.output[0], [])
    mul = next((r for r in readers if r.op_type == "Mul"), None)
    rs_mask = next((r for r in readers if r.op_type == "ReduceSum" and r.input[0] == cast.output[0]), None)
    if len(readers) != 2 or mul is None or rs_mask is None or mul.input[0] == mul.input[1]:
        return None
    h = mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0]
    rs_prod = _only_reader(c, mul.output[0], "ReduceSum")
    clip = _only_reader(c, rs_mask.output[0], "Clip")
    div = rs_prod is not None and _only_reader(c, rs_prod.output[0], "Div")
    if not div or clip is None or _only_reader(c, clip.output[0], "Div") is not div or list(div.input) != \
            [rs_prod.output[0], clip.output[0]] or rs_prod.input[0] != mul.output[0] or h in c.consts:
        return None
    ra, rb = _reduce_axes(c, rs_prod), _reduce_axes(c, rs_mask)
    if ra is None or ra != rb or any(i and i not in c.consts for i in clip.input[1:]):
        return None
    return cast, mul, rs_prod, rs_mask, clip, div, h


def rule_masked_mean(c, node):
    found = pattern(c, node) if node.op_type == "Expand" and len(node.input) == 2 else None
    if found is None:
        return "not a masked mean's Expand"
    *nodes, h = found
    cast, mul, rs_prod, rs_mask, clip, div = nodes
    axes, keepdims = _reduce_axes(c, rs_prod)
    bounds = [c.consts[i] if i else None for i in list(clip.input[1:]) + [""] * (3 - len(clip.input))][:2]
    bounds = [b if b is not None else v for b, v in zip(bounds, (node_attrs(clip).get("min"), node_attrs(clip).get("max")))]
    ins = [c.float_input(h), c.float_input(node.input[0]), c.float_input(node.input[1])]
    v = c.add_val(div.output[0], "f", rank=c.ranks.get(div.output[0]))
    name = node.name or "Expand"
    c.steps.append(MaskedMeanStep(name, ins, v.slot, axes, keepdims, bounds))
    for n in nodes:
        c.done.add(id(n))
        c.entries.append(Entry(n.name or n.op_type, n.op_type, "fused", f"into {name}"))
    c.entries.append(Entry(name, "Expand", "fp32", "a masked mean (7 nodes) as one step"))
    return None
