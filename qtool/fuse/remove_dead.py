"""Remove nodes whose outputs reach no graph output, and initializers nobody reads.

Before: x -> A -> (unused)      After: x
"""
from __future__ import annotations

import onnx

from qtool import graph as G


def run(model: onnx.ModelProto, ctx) -> bool:
    needed = set(G.graph_output_names(model))
    keep = []
    for node in reversed(model.graph.node):
        if any(o in needed for o in node.output if o):
            keep.append(node)
            needed.update(G.node_reads(node))  # (subgraphs read outer tensors by name)
    removed = len(model.graph.node) - len(keep)
    if removed:
        keep.reverse()
        del model.graph.node[:]
        model.graph.node.extend(keep)
        ctx.log("remove_dead", f"removed {removed} unused nodes")
    return bool(G.remove_unused_initializers(model)) or bool(removed)
