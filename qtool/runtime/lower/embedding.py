"""An int8 embedding table as quantize/embedding.py writes it (int8 rows, one float32 scale per row):

Before:
    Gather(table_int8, ids) -> Cast(float) -> Mul(., Unsqueeze(Gather(row_scale, ids), -1))
After:
    EmbeddingStep(ids): float32(table_int8[ids]) * row_scale[ids], the nodes' one float32 multiply

One numpy step for the five nodes (each a Python call and an array; after another engine's run has
taken the caches, the five cost the zoo MiniLM ~60 us at 32 tokens). Reached from whichever of the two
Gathers comes first; anything else about them and the nodes run one by one."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from qtool.runtime.lower.common import only_reader
from qtool.runtime.program import Entry, node_attrs
from qtool.runtime.steps_f32 import EmbeddingStep


def _axis0(node) -> bool:
    return int(node_attrs(node).get("axis", 0)) == 0


def lookup(c, node):
    """(row Gather, Cast, scale Gather, Unsqueeze, Mul, int8 table [V, D], scales [V]) of the lookup `node`
    is one of, else None."""
    if node.op_type != "Gather" or len(node.input) != 2:
        return None
    ids = node.input[1]
    gathers = [g for g in c.consumers.get(ids, []) if g.op_type == "Gather" and len(g.input) == 2
               and g.input[1] == ids and _axis0(g) and g.input[0] in c.consts]
    rows = [g for g in gathers if c.consts[g.input[0]].dtype == np.int8 and c.consts[g.input[0]].ndim == 2]
    for rg in rows:
        cast = only_reader(c, rg.output[0], "Cast")
        mul = cast is not None and node_attrs(cast).get("to") == TensorProto.FLOAT and only_reader(c, cast.output[0], "Mul")
        if not mul:
            continue
        other = mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0]
        unsq = c.producers.get(other)
        if unsq is None or unsq.op_type != "Unsqueeze" or only_reader(c, unsq.output[0], "Mul") is not mul:
            continue
        axes = c.consts.get(unsq.input[1]) if len(unsq.input) > 1 and unsq.input[1] else node_attrs(unsq).get("axes")
        sg = c.producers.get(unsq.input[0])
        if sg is None or not any(sg is g for g in gathers) or only_reader(c, sg.output[0], "Unsqueeze") is not unsq:
            continue
        table, scale = c.consts[rg.input[0]], c.consts[sg.input[0]]
        rank = c.ranks.get(ids)
        if axes is None or rank is None or [int(a) for a in np.reshape(axes, -1)] not in ([-1], [rank]) \
                or scale.dtype != np.float32 or scale.shape != (table.shape[0],) or not (node is rg or node is sg):
            continue
        return rg, cast, sg, unsq, mul, table, scale
    return None


def rule_embedding(c, node):
    """The lookup `node` is part of -> one EmbeddingStep (the five nodes done), or the reason."""
    found = lookup(c, node)
    if found is None:
        return "not an int8 embedding lookup"
    *nodes, table, scale = found
    mul = nodes[-1]
    ids = c.float_input(node.input[1])
    v = c.add_val(mul.output[0], "f", rank=c.ranks.get(mul.output[0]))
    name = nodes[0].name or "Gather"
    c.steps.append(EmbeddingStep(name, ids, v.slot, table, scale))
    for n in nodes:
        c.done.add(id(n))
        if n is not nodes[0]:
            c.entries.append(Entry(n.name or n.op_type, n.op_type, "fused", f"into {name}"))
    c.entries.append(Entry(name, "Gather", "fp32", "int8 embedding rows times their scales, one step"))
    return None
