"""Remove Identity, inference-mode Dropout, and Cast to the type a tensor already has.

Before: x -> Identity -> y -> consumers      After: x -> consumers
If y is a graph output, the producer of x is renamed to write y instead (when x is
produced by a node and used nowhere else); otherwise the node stays.
"""
from __future__ import annotations

import numpy as np
import onnx

from qtool import graph as G


def _removable(node, model, types, used, now) -> bool:
    """`now(name)`: the tensor a name read stands for once the nodes removed before are gone."""
    if node.op_type == "Identity":
        return True
    if node.op_type == "Dropout":
        # at inference a Dropout copies its input; its mask (opset 7-11 exports name it) must go unread,
        # and a training_mode input must be a constant false
        if len(node.input) > 2 and node.input[2]:
            mode = G.const_value(model, now(node.input[2]))
            if mode is None or bool(np.any(mode)):
                return False
        return not any(o in used for o in node.output[1:] if o)
    if node.op_type == "Cast":
        return types.get(now(node.input[0])) == G.attr(node, "to")
    return False


def _elem_types(model):
    try:
        inferred = onnx.shape_inference.infer_shapes(G.skeleton(model), strict_mode=False)
    except Exception:
        return {}
    vis = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
    types = {v.name: v.type.tensor_type.elem_type for v in vis if v.type.tensor_type.elem_type}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return types


def run(model: onnx.ModelProto, ctx) -> bool:
    """One walk: the removed nodes' readers are renamed together at the end (graph.rewire_many), and who
    writes and who reads each tensor is kept up to date on the way, as removing and renaming one node at a
    time would leave it (that was quadratic: a 10,000-node chain took 86 s)."""
    types = _elem_types(model) if any(n.op_type == "Cast" for n in model.graph.node) else {}
    outputs = G.graph_output_names(model)
    # (removing nodes only makes fewer tensors read, so this stays a safe over-estimate)
    used = set(outputs) | {t for n in model.graph.node for t in G.node_reads(n)}
    renames = {}  # a removed node's output -> the tensor its readers read instead

    def now(t):  # (a graph read in order renames a node's input before the node is seen: one step)
        while t in renames:
            t = renames[t]
        return t

    prods = G.producers(model)
    nodes = list(model.graph.node)
    readers = {}  # tensor -> positions in `nodes` of the nodes reading it (in their subgraphs too)
    for k, n in enumerate(nodes):
        for t in G.node_reads(n):
            readers.setdefault(t, set()).add(k)
    gone = set()
    with G.initializers_frozen(model):
        for k, node in enumerate(nodes):
            if not _removable(node, model, types, used, now):
                continue
            x, y = now(node.input[0]), node.output[0]
            if y in outputs:
                prod = prods.get(x)
                if prod is None or len(readers.get(x, ())) != 1 or x in outputs:
                    continue
                prod.output[list(prod.output).index(x)] = y
                prods[y] = prods.pop(x)
            else:
                renames[y] = x
                readers.setdefault(x, set()).update(readers.pop(y, ()))
            for t in {now(i) for i in G.node_reads(node)}:
                readers.get(t, set()).discard(k)
            gone.add(k)
            ctx.log("remove_identity", f"removed {node.op_type} {node.name or y}")
    if not gone:
        return False
    G.rewire_many(model, renames)
    G.drop_nodes(model, nodes, gone)
    return True
