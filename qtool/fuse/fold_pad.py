"""Fold a constant zero Pad into the Conv (or AveragePool without count_include_pad issues) after it.

Before: Pad(x, pads=[0,0,t,l, 0,0,b,r], value=0, mode=constant) -> Conv(pads=P)
After:  Conv(pads=P + [t,l,b,r])

Preconditions: constant pads, non-negative, zero on batch and channel axes; pad value 0;
the Pad's only consumer is a Conv with auto_pad NOTSET. Otherwise the graph is left alone.
"""
from __future__ import annotations

import numpy as np
import onnx

from qtool import graph as G


def _pads(model, node, inits):
    if G.opset(model) < 11 or len(node.input) < 2:
        pads = G.attr(node, "pads")
        value = G.attr(node, "value", 0.0)
    else:
        pads = G.const_value(model, node.input[1], inits)
        value = G.const_value(model, node.input[2], inits) if len(node.input) > 2 and node.input[2] else 0.0
        if len(node.input) > 3 and node.input[3]:
            return None, None  # axes input: leave alone
    if pads is None or value is None:
        return None, None
    return np.asarray(pads, np.int64).ravel(), float(np.asarray(value).ravel()[0]) if np.size(value) else 0.0


def run(model: onnx.ModelProto, ctx) -> bool:
    inits = G.initializers(model)
    cons = G.consumers(model)
    outputs = G.graph_output_names(model)
    gone = set()  # (dropped together at the end: a remove per Pad scanned the graph each time)
    changed = False
    nodes = list(model.graph.node)
    for at, pad in enumerate(nodes):
        if pad.op_type != "Pad" or G.attr(pad, "mode", b"constant") not in (b"constant", "constant"):
            continue
        users = cons.get(pad.output[0], [])
        if len(users) != 1 or users[0].op_type != "Conv" or pad.output[0] in outputs:
            continue
        conv = users[0]
        if G.attr(conv, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            continue
        pads, value = _pads(model, pad, inits)
        if pads is None or value != 0.0 or len(pads) % 2 or (pads < 0).any():
            continue
        r = len(pads) // 2
        begin, end = pads[:r], pads[r:]
        if begin[:2].any() or end[:2].any():
            continue
        sp = r - 2
        old = list(G.attr(conv, "pads", [0] * (2 * sp)))
        new = [int(old[k] + begin[2 + k]) for k in range(sp)] + [int(old[sp + k] + end[2 + k]) for k in range(sp)]
        G.set_attr(conv, "pads", new)
        conv.input[0] = pad.input[0]
        gone.add(at)
        changed = True
        ctx.log("fold_pad", f"Pad {pad.name or pad.output[0]} folded into Conv {conv.name or conv.output[0]}")
    if changed:
        G.drop_nodes(model, nodes, gone)
        G.remove_unused_initializers(model)
    return changed
