"""`inspect`: what qtool will do with a model, before any data is needed.

model -> fused graph -> plan, reported per op: quantized (int8), passed through in int8,
fused into its producer's clamp, or kept fp32 and why; the opset and whether quantizing
upgrades it; every input (float ones are calibrated, integer ones pass untouched) and
output; parameter count; multiply-accumulates of Conv/Gemm/MatMul at the given (or the
model's static) input shapes.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
from onnx import helper

from qtool import graph as G
from qtool.data.tensors import model_inputs
from qtool.errors import UsageError, printable
from qtool.fuse import fuse_model
from qtool.fuse.upgrade_opset import MIN_OPSET
from qtool.modelio import load_model
from qtool.plan import make_plan
from qtool.rules.activations import activation_inputs



@dataclass
class Inspection:
    model: str
    opset: int
    opset_note: str
    inputs: list = field(default_factory=list)  # {name, dtype, dims, role}
    outputs: list = field(default_factory=list)  # {name, dtype, dims}
    params: int = 0
    macs: int | None = None  # None when a shape is dynamic and not given
    macs_shapes: dict = field(default_factory=dict)
    macs_batch_one: bool = False  # the only dynamic dim was the batch: MACs counted for one sample
    quantized_ops: dict = field(default_factory=dict)  # op type -> count of int8 ops already in the model
    ops_before: dict = field(default_factory=dict)
    ops_after: dict = field(default_factory=dict)
    fuse_counts: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    nodes: list = field(default_factory=list)  # {name, op_type, status, reason}
    activations: dict = field(default_factory=dict)  # tensor -> activation it feeds (range fitted to its output)

    def to_dict(self) -> dict:
        return asdict(self)


def _dims(vi) -> list:
    return [d if isinstance(d, int) else (d or "?") for d in G.input_dims(vi)]


def _dtype(vi) -> str:
    et = vi.type.tensor_type.elem_type
    return np.dtype(helper.tensor_dtype_to_np_dtype(et)).name if et else "?"


def parse_shapes(specs, model: onnx.ModelProto) -> dict:
    """'name=1,3,48,192' (or '1,3,48,192' for a single-input model) -> {name: [dims]}."""
    names = [i.name for i in G.real_inputs(model)]
    out = {}
    for s in specs or ():
        name, _, dims = s.rpartition("=")
        if not name:
            if len(names) != 1:
                raise UsageError(f"--shape {s}: the model has {len(names)} inputs; write NAME=DIMS")
            name = names[0]
        if name not in names:
            raise UsageError(f"--shape {s}: no input named '{name}' (inputs: {', '.join(names)})")
        try:
            out[name] = [int(v) for v in dims.split(",")]
        except ValueError:
            raise UsageError(f"--shape {s}: dims must be integers separated by commas") from None
    return out


def _static_shapes(model: onnx.ModelProto, shapes: dict) -> onnx.ModelProto | None:
    """A weightless copy with every input shape fixed, shapes inferred; None if some input stays dynamic."""
    m = G.skeleton(model)
    for inp in G.real_inputs(m):
        dims = inp.type.tensor_type.shape.dim
        given = shapes.get(inp.name)
        if given is not None:
            if len(given) != len(dims):
                raise UsageError(f"--shape: input '{inp.name}' has rank {len(dims)}, got {given}")
            for d, v in zip(dims, given):
                d.Clear()
                d.dim_value = v
        elif any(not (d.HasField("dim_value") and d.dim_value > 0) for d in dims):
            return None
    try:
        return onnx.shape_inference.infer_shapes(m, strict_mode=False)
    except Exception:
        return None


def batch_one_shapes(model: onnx.ModelProto, shapes: dict) -> dict:
    """`shapes` plus, for every input not given whose only dynamic dim is the first (the batch),
    that input at batch 1; {} when some input has another dynamic dim."""
    out = dict(shapes)
    for inp in G.real_inputs(model):
        if inp.name in out:
            continue
        dims = G.input_dims(inp)
        if not dims or any(not isinstance(d, int) for d in dims[1:]):
            return {}
        out[inp.name] = [1] + list(dims[1:])
    return out


def count_macs(model: onnx.ModelProto, shapes: dict) -> int | None:
    if _static_shapes(model, shapes) is None:  # (an input neither given nor static)
        return None
    return G.count_macs(model, shapes)


def count_params(model: onnx.ModelProto) -> int:
    """Elements of float initializers (weights, biases, BatchNorm statistics), as the model ships."""
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16)
    n = sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.data_type in floats)
    for node in model.graph.node:  # Constant nodes (Paddle writes hundreds) hold parameters too
        if node.op_type == "Constant":
            v = G.attr(node, "value")
            if v is not None and v.data_type in floats:
                n += int(np.prod(v.dims))
    return n


def inspect_model(path: str, shapes=None, exclude: dict | None = None) -> Inspection:
    model = load_model(path)
    shapes = parse_shapes(shapes, model) if not isinstance(shapes, dict) else shapes
    v = G.opset(model)
    note = (f"opset {v} is upgraded to {MIN_OPSET} when cleaning the graph (per-axis DequantizeLinear needs {MIN_OPSET})"
            if v < MIN_OPSET else f"opset {v} is kept")
    ins = []
    for spec, vi in zip(model_inputs(model), G.real_inputs(model)):
        role = ("float32: calibrated and quantized where an int8 op reads it" if spec.is_float
                else f"{spec.dtype.name}: passed through untouched")
        ins.append({"name": vi.name, "dtype": _dtype(vi), "dims": _dims(vi), "role": role})
    outs = [{"name": o.name, "dtype": _dtype(o), "dims": _dims(o)} for o in model.graph.output]
    params, quantized = count_params(model), G.quantized_ops(model)
    # everything about the original is read: fuse it in place, so a model of several GB is held once
    fused = fuse_model(model, {}, inplace=True)
    del model
    plan = make_plan(fused.model, exclude)
    macs, batch_one = count_macs(fused.model, shapes), False
    if macs is None:
        ones = batch_one_shapes(fused.model, shapes)
        if ones:
            macs, batch_one = count_macs(fused.model, ones), True
    return Inspection(
        model=os.path.abspath(path), opset=v, opset_note=note, inputs=ins, outputs=outs,
        params=params, macs=macs, macs_shapes=shapes, macs_batch_one=batch_one and macs is not None,
        quantized_ops=quantized, ops_before=fused.ops_before,
        ops_after=fused.ops_after, fuse_counts=fused.counts, summary=plan.summary(),
        nodes=[{"name": d.name, "op_type": d.op_type, "status": d.status, "reason": d.reason} for d in plan.decisions],
        activations={t: label for t, (label, _f) in activation_inputs(fused.model).items()})


def render(r: Inspection, all_nodes: bool = False) -> str:
    # every name comes from the model file: printed escaped, so a name cannot send terminal codes
    lines = [f"{printable(r.model)}"]
    if r.quantized_ops:
        q = r.quantized_ops
        kind = "QDQ" if "QuantizeLinear" in q or "DequantizeLinear" in q else "QOperator"
        lines.append(f"  already int8 ({kind}: " + ", ".join(f"{k} x{v}" for k, v in sorted(q.items()))
                     + "): qtool quantizes fp32 models; inspect, calibrate and quantize the fp32 original")
    lines.append(f"  {r.opset_note}")
    for i in r.inputs:
        lines.append(printable(f"  input  {i['name']}: {i['dtype']}{i['dims']} ({i['role']})"))
    for o in r.outputs:
        lines.append(printable(f"  output {o['name']}: {o['dtype']}{o['dims']} (left fp32)"))
    macs = (f"{r.macs / 1e9:.3f} GMAC" + (" per sample (batch 1)" if r.macs_batch_one else "")
            + (f" at {r.macs_shapes}" if r.macs_shapes else "")
            if r.macs is not None else "MACs unknown (dynamic input shape: pass --shape NAME=1,3,H,W)")
    lines.append(f"  {r.params / 1e6:.3f} M parameters, {macs}")
    if r.fuse_counts:
        lines.append("  graph cleanup: " + ", ".join(f"{k} x{v}" for k, v in sorted(r.fuse_counts.items())))
    if r.quantized_ops and not all_nodes:
        return "\n".join(lines)  # a plan for an int8 model would list its DequantizeLinear weights as fp32 ops
    s = r.summary
    lines.append(f"  plan: {s.get('int8', 0)} ops int8, {s.get('passthrough', 0)} pass int8 through, "
                 f"{s.get('fused', 0)} activations fused, {s.get('fp32', 0)} stay fp32")
    groups = {}
    for d in r.nodes:
        reason = "range clamp of its producer's output" if d["status"] == "fused" else d["reason"]
        groups.setdefault((d["status"], d["op_type"], reason), []).append(d["name"])
    order = {"int8": 0, "passthrough": 1, "fused": 2, "fp32": 3}
    for (status, op, reason), names in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1])):
        text = f"    {status:12s}{op:20s}x{len(names):<4d}"
        if reason:
            text += f" {reason}"
        if all_nodes or status == "fp32":
            shown = names if all_nodes else names[:4]
            text += f"  [{', '.join(shown)}{', ...' if len(names) > len(shown) else ''}]"
        lines.append(printable(text))
    if r.activations:
        c = {}
        for label in r.activations.values():
            c[label] = c.get(label, 0) + 1
        lines.append(printable("  activation patterns: " + ", ".join(f"{k} x{v}" for k, v in sorted(c.items()))))
    return "\n".join(lines)
