"""Inline the model's local functions before any other pass.

A node that calls a model-local function (ONNX FunctionProto: PyTorch's `export_modules_as_functions`,
its dynamo exporter without optimization, onnxscript) is one opaque op to every rule: the Convs
inside it stayed fp32 ("no int8 rule for this op"), calibration saw none of its tensors, and an
experiment graph built without the function list could not load in ONNX Runtime. Inlined, its body
is ordinary nodes of the graph, and everything after works on them as on any other.

Nested calls multiply (a function that calls another twice, ten levels deep, is 1024 copies of the
innermost body): load_model has counted the size the graph reaches and refused a model past
modelio.MAX_INLINED_NODES before anything, ONNX Runtime included, inlined it.
"""
from __future__ import annotations

import onnx

from qtool import graph as G
from qtool.errors import QtoolError


def _all_nodes(nodes):
    for n in nodes:
        yield n
        for g in G._subgraphs(n):
            yield from _all_nodes(g.node)


def inline(model: onnx.ModelProto, notes: list) -> onnx.ModelProto:
    """`model` itself if it has no local functions, else a copy with every call inlined (a note says how many)."""
    if not model.functions:
        return model
    funcs = {(f.domain, f.name) for f in model.functions}
    calls = sum((n.domain, n.op_type) in funcs for n in _all_nodes(model.graph.node))
    from onnx import inliner
    try:
        m = inliner.inline_local_functions(model, convert_version=True)
    except Exception as e:  # (onnx's own message: a function at an opset it cannot convert)
        raise QtoolError(f"inlining its local functions failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    del m.functions[:]
    G.name_nodes(m)
    notes.append(f"{calls} call(s) of {len(funcs)} local function(s) inlined")
    return m
