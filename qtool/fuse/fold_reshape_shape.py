"""Replace a run-time computed Reshape target by a constant that keeps dynamic dims dynamic.

Before: Shape(x) -> Gather(0) -> Unsqueeze -> Concat([-1]) -> Reshape(x, shape)
After:  Reshape(x, [0, -1])

The target shape is evaluated under three instantiations of the free dimensions, and the veto
sizes where they compute (see fold_constants). An entry equal in all stays a constant; an entry that changes but
always equals the input's dimension at the same position becomes 0 ("copy", allowzero=0);
at most one other changing entry becomes -1. Anything else leaves the node alone.
"""
from __future__ import annotations

import numpy as np
import onnx

from qtool import graph as G
from qtool.fuse.fold_constants import VARIANTS, VETOS, instantiate


def run(model: onnx.ModelProto, ctx) -> bool:
    inits = G.initializers(model)
    todo = [n for n in model.graph.node if n.op_type == "Reshape" and n.input[1] not in inits
            and not G.attr(n, "allowzero", 0)]
    if not todo:
        return False
    main = [instantiate(model, v, ctx.input_pins) for v in VARIANTS]  # (shapes, values) of each
    vetos = [instantiate(model, v, ctx.input_pins) for v in VETOS]
    changed = False
    taken = G.taken_names(model)
    for n in todo:
        x, s = n.input[0], n.input[1]
        if any(s not in vals or x not in shapes for shapes, vals in main):
            continue
        runs = main + [v for v in vetos if s in v[1] and x in v[0]]  # (the veto sizes, where they compute)
        targets = [vals[s].astype(np.int64).ravel() for _, vals in runs]
        if any(t.shape != targets[0].shape for t in targets):
            continue
        new, minus = [], 0
        for k, entries in enumerate(zip(*targets)):
            p = entries[0]
            if all(q == p for q in entries):
                new.append(int(p))
                minus += p == -1
            elif all(k < len(shapes[x]) and q == shapes[x][k] for q, (shapes, _) in zip(entries, runs)):
                new.append(0)
            else:
                new.append(-1)
                minus += 1
        if minus > 1:
            continue
        name = G.unique_name(model, s + "_const", taken)
        G.set_initializer(model, name, np.array(new, np.int64), inits)
        n.input[1] = name
        changed = True
        ctx.log("fold_reshape_shape", f"Reshape {n.name or n.output[0]} target {new}")
    return changed
