"""Embedding tables in int8, one symmetric scale per row.

A Gather whose data is a 2-D float initializer [V, D] and whose indices are computed (a graph input or
an op's output) is a lookup table: a transformer's word, position and token-type embeddings, a
tagger's word vectors. They are most of such a model's file and stay fp32 in the QDQ plan (the data
input is a constant, not an activation). Each row is one token's vector, so each row gets its own
scale (max |row| / 127): a rare token's small vector is not rounded on a common one's grid. A table
under MIN_TABLE_BYTES stays fp32: a token-type or segment table of a few rows is added to every token,
so its rounding error is in every position (MiniLM's 2-row table: 0.4 dB of output SQNR), for a
saving of kilobytes.

Before:  table[V, D] (float) -> Gather(axis 0, ids) -> y
After:   table_q[V, D] (int8) -> Gather(ids) -> Cast(float) ----------------> Mul -> y
         row_scale[V] (float) -> Gather(ids) -> Unsqueeze(axes [-1]) ----------^

y[.., d] = q[id, d] * s[id]: the dequantized table's rows, exactly (one float multiply per value, the
same on every CPU). ONNX Runtime runs it as two Gathers, a Cast and a Mul: no int8 arithmetic, nothing
that can saturate, and the table stays int8 in memory (a DequantizeLinear of the whole table before the
Gather would make a float table of it at load). qtool's runtime reads exactly this form.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from qtool import graph as G
from qtool import qparams as Q

MIN_TABLE_BYTES = 64 * 1024  # fp32 bytes


@dataclass
class EmbeddingInfo:
    node: str
    rows: int
    width: int
    weight_sqnr_db: float  # of the int8 table against the fp32 one


def embedding_gathers(model, exclude: dict | None = None) -> list:
    """The Gather nodes of `model` that read a 2-D float initializer of at least MIN_TABLE_BYTES along
    axis 0 with computed indices, in graph order, but those `exclude` names (kept fp32 by the user)."""
    inits = G.initializers(model)
    found = []
    for node in model.graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.name in (exclude or {}):
            continue
        t = inits.get(node.input[0])
        if t is None or t.data_type != TensorProto.FLOAT or len(t.dims) != 2:
            continue
        if G.attr(node, "axis", 0) not in (0, -2) or node.input[1] in inits \
                or 4 * t.dims[0] * t.dims[1] < MIN_TABLE_BYTES:
            continue
        found.append(node)
    return found


def quantize_table(table: np.ndarray) -> tuple:
    """(int8 table, float32 scale per row): symmetric, max |row| / 127 (qparams' weight rule, axis 0)."""
    scale = Q.weight_scales(table, 0)
    return Q.quantize_weight(table, scale, 0), scale


def write_embedding(g, node) -> EmbeddingInfo:
    """Rewrite `node` (one of embedding_gathers) in `g` (qdq's graph writer) into the int8 form above;
    its output tensor keeps its name."""
    table = numpy_helper.to_array(g.inits[node.input[0]]).astype(np.float32)
    q, scale = quantize_table(table)
    base, ids, out = node.input[0], node.input[1], node.output[0]
    qn = g.add_init(base + "_quantized", q)
    sn = g.add_init(base + "_row_scale", scale)
    axes = g.add_init("embedding_unsqueeze_axes", np.array([-1], np.int64))
    rows_q, rows_f, s, s1 = (g.name(out + suffix) for suffix in ("_quantized", "_int", "_scale", "_row_scale"))
    nodes = [helper.make_node("Gather", [qn, ids], [rows_q], name=rows_q, axis=0),
             helper.make_node("Cast", [rows_q], [rows_f], name=rows_f, to=TensorProto.FLOAT),
             helper.make_node("Gather", [sn, ids], [s], name=s, axis=0),
             helper.make_node("Unsqueeze", [s, axes], [s1], name=s1),
             helper.make_node("Mul", [rows_f, s1], [out], name=node.name)]
    g.m.graph.node.remove(node)
    g.m.graph.node.extend(nodes)
    err = Q.dequantize_weight(q, scale, 0) - table
    sqnr = 10 * np.log10(max(float((table.astype(np.float64) ** 2).sum()), 1e-30)
                         / max(float((err.astype(np.float64) ** 2).sum()), 1e-30))
    return EmbeddingInfo(node.name, int(table.shape[0]), int(table.shape[1]), float(sqnr))
