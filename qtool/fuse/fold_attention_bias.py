"""Drop the bias of an attention's key projection, and move its value projection's bias into the output
projection's: the same function, two Adds fewer per attention.

Key:   K = X Wk + bk -> [Reshape | Transpose | Mul/Div by a scalar]* -> S = Q' @ K' -> [Mul/Div k] [+ mask]
       -> Softmax over the last axis.
       bk adds to each score row i the term Q'_i . bk', the same for every key j (bk' is constant along K''s
       last axis, the keys): Softmax over that axis cancels it. K = X Wk instead.
Value: V = X Wv + bv -> [layout ops]* -> C = P @ V', P straight from such a Softmax (its rows sum to 1)
       -> [layout ops]* -> Y = C' Wo + bo.
       bv' is constant along V''s axis -2 (the keys), so P @ (V0' + bv') = P @ V0' + bv': the bias passes
       through the attention unchanged, and through the layout ops back to its own layout, into
       Y = C0' Wo + (bv Wo + bo).

Why: ONNX Runtime fuses a MatMul's bias into its int8 MatMul only from its own dynamic form, not from the
QDQ form qtool writes, so each bias Add left is a node of its own (a thread-pool hand-off on 2 threads);
these two are removed exactly. The int8 model also gains: the key and value activations lose an offset.

Proof, not name matching: the bias is followed as a small tensor through each op to the MatMul
(fuse/attention.py, on the graph's inferred shapes). Anything not proven: the Adds stay.
"""
from __future__ import annotations

import numpy as np
import onnx

from qtool import graph as G
from qtool.fuse.attention import Walk


def _out_bias(walk: Walk, matmul):
    """The Add of a constant bias after an output projection MatMul(C, Wo): (add, its bias input's name, bias)."""
    wo = G.const_value(walk.model, matmul.input[1], walk.inits)
    add = walk.next_op(matmul.output[0])
    if wo is None or wo.ndim != 2 or add is None or add.op_type != "Add":
        return None
    other = add.input[1] if add.input[0] == matmul.output[0] else add.input[0]
    bo = G.const_value(walk.model, other, walk.inits)
    if bo is None or bo.size != wo.shape[1] or any(s != 1 for s in bo.shape[:-1]):
        return None
    return add, other, wo, bo


def run(model: onnx.ModelProto, ctx) -> bool:
    """One walk over the graph's bias Adds (one shape inference): those proven are dropped or moved."""
    if not any(n.op_type == "Softmax" for n in model.graph.node):
        return False
    walk = Walk(model)
    if not walk.dims:
        return False
    # drop: (a bias Add, the tensor its readers read instead); new_bias: id(an output projection's Add) -> (that
    # Add, its bias input, the bias with the value's moved in)
    drop, new_bias = [], {}
    for add in list(model.graph.node):
        if add.op_type != "Add" or (proj := walk.projection(add)) is None:
            continue
        src, b, rank = proj
        small = b.reshape((1,) * (rank - 1) + (b.size,)).astype(np.float64)
        found = walk.to_matmul(add.output[0], small)
        if found is None:
            continue
        mm, read, small = found
        if mm.input[1] == read and mm.input[0] != read and small.shape[-1] == 1 and walk.softmax_after(mm):
            drop.append((add, src.output[0]))
            ctx.log("fold_attention_bias", f"key bias {add.name or add.output[0]} dropped: Softmax cancels it")
            continue
        p = walk.prod.get(mm.input[0])
        if not (mm.input[1] == read and mm.input[0] != read and small.ndim >= 2 and small.shape[-2] == 1
                and p is not None and walk.softmax_last(p) and walk.only_reader(p.output[0], mm)):
            continue
        # the value's bias, now after the attention: follow it to the output projection
        out = walk.to_matmul(mm.output[0], small)
        if out is None:
            continue
        omm, oread, osmall = out
        tail = _out_bias(walk, omm) if omm.input[0] == oread else None
        if tail is None or any(s != 1 for s in osmall.shape[:-1]):
            continue
        oadd, bo_name, wo, bo = tail
        if osmall.shape[-1] != wo.shape[0] or id(oadd) in new_bias:
            continue
        moved = osmall.reshape(-1) @ wo.astype(np.float64)
        new_bias[id(oadd)] = (oadd, bo_name, (bo.astype(np.float64) + moved.reshape(bo.shape)).astype(bo.dtype))
        drop.append((add, src.output[0]))
        ctx.log("fold_attention_bias", f"value bias {add.name or add.output[0]} moved into {oadd.name or oadd.output[0]}")
    if not drop:
        return False
    taken = G.taken_names(model)
    for oadd, bo_name, value in new_bias.values():
        name = G.unique_name(model, bo_name + "_attention", taken)
        G.set_initializer(model, name, value, walk.inits)
        oadd.input[list(oadd.input).index(bo_name)] = name
    renames = {add.output[0]: x for add, x in drop}
    gone_ids = {id(a) for a, _ in drop}
    nodes = list(model.graph.node)
    G.drop_nodes(model, nodes, {k for k, n in enumerate(nodes) if id(n) in gone_ids})
    G.rewire_many(model, renames)
    G.remove_unused_initializers(model)
    return True
