"""Compute a float16 model in float32, keeping its float16 inputs and outputs.

Models exported in half precision (for a GPU, or to halve the file) have float16 weights and
activations; qtool's rules and ONNX Runtime's int8 kernels take float32 between Q/DQ pairs, so every
layer of such a model stayed fp32 ("input is not float32"). Widening float16 to float32 is exact, so
the cleaned graph computes what the original does, only without float16's rounding between ops:

Before: x:fp16 -> Conv(W:fp16) -> y:fp16
After:  x:fp16 -> Cast(fp32) -> x_fp32 -> Conv(W:fp32) -> y_fp32 -> Cast(fp16) -> y:fp16

The callers' data stays float16 and the int8 model is a drop-in replacement. Widened: initializers,
Constant/ConstantOfShape values, Cast/CastLike targets and `dtype` attributes, value infos, subgraphs'
own inputs and outputs. Runs only when a graph input, output or initializer is float16.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool import graph as G
from qtool.modelio import PROVENANCE, set_provenance

F16, F32 = TensorProto.FLOAT16, TensorProto.FLOAT


def _widen_tensor(t: onnx.TensorProto) -> None:
    if t.data_type == F16:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))


def _widen_type(tp: onnx.TypeProto) -> None:
    while True:  # (a sequence or optional of tensors)
        if tp.HasField("tensor_type"):
            if tp.tensor_type.elem_type == F16:
                tp.tensor_type.elem_type = F32
            return
        if tp.HasField("sequence_type"):
            tp = tp.sequence_type.elem_type
        elif tp.HasField("optional_type"):
            tp = tp.optional_type.elem_type
        else:
            return


def _widen_graph(g: onnx.GraphProto, sub: bool) -> int:
    n = 0
    for t in g.initializer:
        n += t.data_type == F16
        _widen_tensor(t)
    for vi in list(g.value_info) + (list(g.input) + list(g.output) if sub else []):
        _widen_type(vi.type)
    for node in g.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                n += a.t.data_type == F16
                _widen_tensor(a.t)
            elif a.type == onnx.AttributeProto.INT and a.name in ("to", "dtype") and a.i == F16:
                a.i = F32
                n += 1
            elif a.type == onnx.AttributeProto.GRAPH:
                n += _widen_graph(a.g, True)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sg in a.graphs:
                    n += _widen_graph(sg, True)
    return n


def is_float16(model: onnx.ModelProto) -> bool:
    io = list(model.graph.input) + list(model.graph.output)
    return (any(v.type.tensor_type.elem_type == F16 for v in io)
            or any(t.data_type == F16 for t in model.graph.initializer))


def upcast(model: onnx.ModelProto, notes: list) -> bool:
    """Widen `model` in place (see the module's docstring); False when it holds no float16."""
    if not is_float16(model):
        return False
    g = model.graph
    inits = {t.name for t in g.initializer}
    taken = set()
    front, back = [], []
    for vi in g.input:
        if vi.type.tensor_type.elem_type == F16 and vi.name not in inits:
            wide = G.unique_name(model, vi.name + "_fp32", taken)
            G.rewire(model, vi.name, wide)
            front.append(helper.make_node("Cast", [vi.name], [wide], name=wide, to=F32))
    produced = {t for node in g.node for t in node.output}
    outputs = [o for o in g.output if o.type.tensor_type.elem_type == F16 and o.name in produced]
    for o in outputs:
        wide = G.unique_name(model, o.name + "_fp32", taken)
        for node in g.node:  # the producer writes the wide tensor; every reader inside reads it too
            for k, t in enumerate(node.output):
                if t == o.name:
                    node.output[k] = wide
        G.rewire(model, o.name, wide)
        back.append(helper.make_node("Cast", [wide], [o.name], name=o.name + "_to_fp16", to=F16))
    n = _widen_graph(g, False)
    nodes = front + list(g.node) + back
    del g.node[:]
    g.node.extend(nodes)
    set_provenance(model, widened_float16=n)
    notes.append(_note(n))
    return True


def _note(n) -> str:
    return f"float16 model computed in float32 (exact widening of {n} float16 constants and types; its float16 " \
           f"inputs and outputs stay float16 through Casts)"


def noted(model: onnx.ModelProto, notes: list) -> None:
    """Say so in `notes` when `model` is a graph this module widened (the cleaned graph quantize reads)."""
    n = next((p.value for p in model.metadata_props if p.key == PROVENANCE + "widened_float16"), None)
    if n is not None:
        notes.append(_note(n))
