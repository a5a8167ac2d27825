"""Remove Identity, inference-mode Dropout, and Cast to the type a tensor already has.

Before: x -> Identity -> y -> consumers      After: x -> consumers
If y is a graph output, the producer of x is renamed to write y instead (when x is
produced by a node and used nowhere else); otherwise the node stays.
"""
from __future__ import annotations

import onnx

from qtool import graph as G


def _removable(node, model, types) -> bool:
    if node.op_type == "Identity":
        return True
    if node.op_type == "Dropout":
        return len([o for o in node.output if o]) == 1
    if node.op_type == "Cast":
        return types.get(node.input[0]) == G.attr(node, "to")
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
    types = _elem_types(model) if any(n.op_type == "Cast" for n in model.graph.node) else {}
    outputs = G.graph_output_names(model)
    changed = False
    for node in list(model.graph.node):
        if not _removable(node, model, types):
            continue
        x, y = node.input[0], node.output[0]
        if y in outputs:
            prod = G.producers(model).get(x)
            if prod is None or len(G.consumers(model).get(x, [])) != 1 or x in outputs:
                continue
            prod.output[list(prod.output).index(x)] = y
        else:
            G.rewire(model, y, x)
        model.graph.node.remove(node)
        changed = True
        ctx.log("remove_identity", f"removed {node.op_type} {node.name or y}")
    return changed
