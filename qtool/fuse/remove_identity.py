"""Remove Identity, inference-mode Dropout, and Cast to the type a tensor already has.

Before: x -> Identity -> y -> consumers      After: x -> consumers
If y is a graph output, the producer of x is renamed to write y instead (when x is
produced by a node and used nowhere else); otherwise the node stays.
"""
from __future__ import annotations

import numpy as np
import onnx

from qtool import graph as G


def _removable(node, model, types, used) -> bool:
    if node.op_type == "Identity":
        return True
    if node.op_type == "Dropout":
        # at inference a Dropout copies its input; its mask (opset 7-11 exports name it) must go unread,
        # and a training_mode input must be a constant false
        if len(node.input) > 2 and node.input[2]:
            mode = G.const_value(model, node.input[2])
            if mode is None or bool(np.any(mode)):
                return False
        return not any(o in used for o in node.output[1:] if o)
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
    # (removing nodes only makes fewer tensors read, so this stays a safe over-estimate)
    used = set(outputs) | {t for n in model.graph.node for t in G.node_reads(n)}
    changed = False
    for node in list(model.graph.node):
        if not _removable(node, model, types, used):
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
