"""fp32 nodes left over by the int8 rules that have a native float32 kernel (qtool.kernels.f32): tried
by the compiler's fallback before the numpy op. A rule returns None when it emitted a step (the other
nodes of a fused chain marked done), or the reason it does not apply.

  LayerNormalization over the last axis                    -> LayerNormStep
  ReduceMean -> Sub -> Pow 2 -> ReduceMean -> Add eps -> Sqrt -> Div [-> Mul gamma [-> Add beta]]
      (a LayerNorm as torch exports it at opset < 17, over the last axis)   -> LayerNormStep
  Add(a, b) -> either LayerNorm (a residual sum; kept too when read elsewhere) -> AddLayerNormStep
  Softmax over the last axis                               -> SoftmaxStep
  [Div(x, k) | Mul(x, k) ->] [Add(., mask) ->] Softmax, x from a MatMul (attention) -> ScaledSoftmaxStep
  Div(x, k) | Mul(x, k) -> Erf -> Add c -> Mul x -> Mul h   (the erf GELU)   -> GeluStep
  Erf                                                      -> ErfStep
  Mul(x, row [n]) read only by a DynamicQuantizeLinear      -> DynamicQuantizeStep of x times the row
      (lower/dynamic.py: a migration's 1/s before a dynamic layer)
  MatMul of two activations of rank >= 2 (attention)      -> MatMulStep
  ConvTranspose of rank 4 with constant weights (and bias)  -> ConvTransposeStep
Every intermediate of a chain must have exactly one reader (Sub's output: Pow and Div) and not be a
graph output; otherwise the nodes run one by one. Backends without the float kernels (the numpy
reference) keep the numpy ops."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from qtool.runtime.lower import dynamic
from qtool.runtime.lower.common import deconv_geometry, only_reader
from qtool.runtime.program import Entry, node_attrs
from qtool.runtime.steps_f32 import (Affine, AddLayerNormStep, ConvTransposeStep, ErfStep, MatMulStep, GeluConsts, GeluStep, LayerNormStep, ScaledSoftmaxStep,
                                     SoftmaxStep)


FLOAT = TensorProto.FLOAT


def _scalar(c, name):
    """The value of a one-element float32 constant, or None."""
    v = c.consts.get(name)
    if v is None or v.size != 1 or v.dtype != np.float32:
        return None
    return float(v.reshape(()))


def _row(c, name):
    """A float32 constant shaped [..1, n] (a per-channel row over the last axis), flattened, or None."""
    v = c.consts.get(name)
    if v is None or v.dtype != np.float32 or v.ndim < 1 or any(d != 1 for d in v.shape[:-1]):
        return None
    return np.ascontiguousarray(v.reshape(-1))


def _other(node, name):
    """The input of a two-input node that is not `name` (None if both or neither are)."""
    a, b = node.input[0], node.input[1] if len(node.input) > 1 else ""
    if a == name and b != name:
        return b
    if b == name and a != name:
        return a
    return None


def _last_axis(c, name, axis) -> bool:
    rank = c.ranks.get(name)
    return axis == -1 or (rank is not None and axis == rank - 1)


def _emit(c, x, nodes, step_of, detail):
    """One step for the chain `nodes` (nodes[0] = the node being compiled) from input `x` to the last
    node's output 0."""
    first = nodes[0]
    out = nodes[-1].output[0]
    xs = c.float_input(x)
    v = c.add_val(out, "f", rank=c.ranks.get(out, c.ranks.get(x)))
    name = first.name or first.op_type
    st = step_of(name, xs, v.slot)
    c.steps.append(st)
    for n in nodes[1:]:
        c.done.add(id(n))
        c.entries.append(Entry(n.name or n.op_type, n.op_type, "fused", f"into {name}"))
    c.entries.append(Entry(name, first.op_type, "fp32", detail))
    return None


def _layernorm_affine(c, node):
    """The Affine of a LayerNormalization node the kernel can run, or the reason."""
    at = node_attrs(node)
    if any(o and (o in c.graph_outputs or c.consumers.get(o)) for o in node.output[1:]):
        return "its Mean / InvStdDev outputs are read"
    if not _last_axis(c, node.input[0], int(at.get("axis", -1))) or int(at.get("stash_type", 1)) != 1:
        return "not over the last axis in float32"
    g = _row(c, node.input[1])
    b = _row(c, node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if g is None or (len(node.input) > 2 and node.input[2] and b is None):
        return "scale or bias is not a float32 row"
    return Affine(float(at.get("epsilon", 1e-5)), g, b)


def rule_layernorm(c, node, F):
    a = _layernorm_affine(c, node)
    if isinstance(a, str):
        return a
    return _emit(c, node.input[0], [node], lambda name, x, y: LayerNormStep(name, F, x, y, a, "native float32 kernel"),
                 "native LayerNorm kernel")


def _reduce_last(c, node) -> bool:
    """ReduceMean over the last axis only, keeping it."""
    at = node_attrs(node)
    if len(node.input) > 1 and node.input[1]:
        axes = c.consts.get(node.input[1])
        axes = None if axes is None else [int(a) for a in axes.reshape(-1)]
    else:
        axes = at.get("axes")
    return axes is not None and len(axes) == 1 and _last_axis(c, node.input[0], axes[0]) and int(at.get("keepdims", 1)) == 1


def _decomposed_chain(c, r1):
    """The nodes of a decomposed LayerNorm starting at ReduceMean r1 and its (eps, gamma, beta), or a reason."""
    x = r1.input[0]
    sub = only_reader(c, r1.output[0], "Sub")
    if not _reduce_last(c, r1) or sub is None or list(sub.input) != [x, r1.output[0]]:
        return "not a ReduceMean over the last axis read by Sub(x, mean)"
    d = sub.output[0]
    readers = c.consumers.get(d, [])
    pw = next((n for n in readers if n.op_type == "Pow"), None)
    dv = next((n for n in readers if n.op_type == "Div"), None)
    if d in c.graph_outputs or len(readers) != 2 or pw is None or dv is None or pw.input[0] != d \
            or _scalar(c, pw.input[1]) != 2.0 or dv.input[0] != d:
        return "x - mean is not read by Pow(., 2) and Div(., std) alone"
    r2 = only_reader(c, pw.output[0], "ReduceMean")
    add = r2 and only_reader(c, r2.output[0], "Add")
    eps = add and _scalar(c, _other(add, r2.output[0]) or "")
    sq = add and only_reader(c, add.output[0], "Sqrt")
    if r2 is None or not _reduce_last(c, r2) or eps is None or sq is None or only_reader(c, sq.output[0], "Div") is not dv \
            or dv.input[1] != sq.output[0]:
        return "the variance is not ReduceMean -> Add eps -> Sqrt -> Div"
    nodes, gamma, beta = [r1, sub, pw, r2, add, sq, dv], None, None
    mul = only_reader(c, dv.output[0], "Mul")
    if mul is not None and _row(c, _other(mul, dv.output[0]) or "") is not None:
        gamma = _row(c, _other(mul, dv.output[0]))
        nodes.append(mul)
        ab = only_reader(c, mul.output[0], "Add")
        if ab is not None and _row(c, _other(ab, mul.output[0]) or "") is not None:
            beta = _row(c, _other(ab, mul.output[0]))
            nodes.append(ab)
    return nodes, Affine(eps, gamma, beta)


def rule_decomposed_layernorm(c, node, F):
    r = _decomposed_chain(c, node)
    if isinstance(r, str):
        return r
    nodes, a = r
    return _emit(c, node.input[0], nodes, lambda name, x, y: LayerNormStep(name, F, x, y, a, "native float32 kernel"),
                 f"{len(nodes)} nodes of a LayerNorm as one native kernel")


def rule_add_layernorm(c, node, F):
    """Add(a, b) -> LayerNorm (the op, or the decomposed chain): the residual sum and the normalization in
    one pass; the sum is kept as well when something else reads it (a pre-LN block's next residual)."""
    a, b = node.input[0], node.input[1] if len(node.input) > 1 else ""
    if not b or a == b or a in c.consts or b in c.consts:
        return "not a sum of two activations"
    s = node.output[0]
    readers = c.consumers.get(s, [])
    ln = next((n for n in readers if n.op_type == "LayerNormalization" and n.input[0] == s), None)
    r1 = next((n for n in readers if n.op_type == "ReduceMean" and n.input[0] == s), None)
    if ln is not None:
        nodes, affine = [ln], _layernorm_affine(c, ln)
    elif r1 is not None:
        r = _decomposed_chain(c, r1)
        nodes, affine = (None, r) if isinstance(r, str) else r
    else:
        return "not read by a LayerNorm"
    if isinstance(affine, str):
        return affine
    chain = {id(n) for n in nodes}
    keep = s in c.graph_outputs or any(id(n) not in chain for n in readers)
    out = nodes[-1].output[0]
    xa, xb = c.float_input(a), c.float_input(b)
    y = c.add_val(out, "f", rank=c.ranks.get(out, c.ranks.get(s)))
    sv = c.add_val(s, "f", rank=c.ranks.get(s)).slot if keep else None
    name = node.name or node.op_type
    c.steps.append(AddLayerNormStep(name, F, (xa, xb), (y.slot, sv), affine, "native float32 kernel"))
    for n in nodes:
        c.done.add(id(n))
        c.entries.append(Entry(n.name or n.op_type, n.op_type, "fused", f"into {name}"))
    c.entries.append(Entry(name, "Add", "fp32", f"residual Add and LayerNorm ({len(nodes)} nodes) as one native kernel"))
    return None


def _softmax_last(c, node) -> bool:
    at = node_attrs(node)
    axis = int(at.get("axis", -1 if c.opset >= 13 else 1))
    rank = c.ranks.get(node.input[0])
    return (axis == -1 and c.opset >= 13) or (rank is not None and axis % rank == rank - 1)


def rule_softmax(c, node, F):
    if not _softmax_last(c, node):
        return "not over the last axis"
    return _emit(c, node.input[0], [node], lambda name, x, y: SoftmaxStep(name, F, x, y, "native float32 kernel"),
                 "native Softmax kernel")


def _gelu_chain(c, node):
    """Div(x, k) | Mul(x, k) -> Erf -> Add c -> Mul x -> Mul h from `node`: (x, nodes, consts) or None."""
    x = node.input[0]
    k = _scalar(c, node.input[1]) if len(node.input) > 1 else None
    if node.op_type == "Mul" and k is None:
        x, k = node.input[1], _scalar(c, node.input[0])
    if k is None or x in c.consts:
        return None
    erf = only_reader(c, node.output[0], "Erf")
    add = erf and only_reader(c, erf.output[0], "Add")
    k_add = add and _scalar(c, _other(add, erf.output[0]) or "")
    mx = add and only_reader(c, add.output[0], "Mul")
    if k_add is None or mx is None or _other(mx, add.output[0]) != x:
        return None
    half = only_reader(c, mx.output[0], "Mul")
    k_out = half and _scalar(c, _other(half, mx.output[0]) or "")
    if k_out is None:
        return None
    return x, [node, erf, add, mx, half], GeluConsts(k, node.op_type == "Div", k_add, k_out)


def rule_gelu(c, node, F):
    r = _gelu_chain(c, node)
    if r is None:
        return "not the start of an erf GELU"
    x, nodes, k = r
    return _emit(c, x, nodes, lambda name, x, y: GeluStep(name, F, x, y, k, "native float32 kernel"),
                 "erf GELU (5 nodes) as one native kernel")


def _scaled_softmax_chain(c, node):
    """[Div(x, k) | Mul(x, k) ->] [Add(., mask) ->] Softmax over the last axis, from `node`:
    (x, mask, scale, nodes) or None."""
    x, mask, scale, nodes, nxt = node.input[0], None, None, [node], node
    if node.op_type in ("Div", "Mul"):
        k = _scalar(c, node.input[1]) if len(node.input) > 1 else None
        if node.op_type == "Mul" and k is None:
            x, k = node.input[1], _scalar(c, node.input[0])
        src = c.producers.get(x)
        if k is None or src is None or src.op_type != "MatMul":  # the scores of an attention
            return None
        scale = (k, node.op_type == "Div")
        nxt = only_reader(c, node.output[0])
    if nxt is not None and nxt.op_type == "Add":
        mask = _other(nxt, nxt.input[0] if nxt is node else node.output[0])
        if mask is None:
            return None
        if nxt is not node:
            nodes.append(nxt)
        nxt = only_reader(c, nxt.output[0])
    if nxt is None or nxt.op_type != "Softmax" or not _softmax_last(c, nxt):
        return None
    return x, mask, scale, nodes + [nxt]


def rule_scaled_softmax(c, node, F):
    r = _scaled_softmax_chain(c, node)
    if r is None:
        return "not the scores of a Softmax"
    x, mask, scale, nodes = r
    if x in c.consts:
        return "constant scores"
    if mask and not (mask in c.consts or mask in c.vals or mask in c.views):
        return "the mask is computed after the scores' first node"
    m = c.float_input(mask) if mask else None
    return _emit(c, x, nodes, lambda name, xs, y: ScaledSoftmaxStep(name, F, xs, m, y, scale, "native float32 kernel"),
                 f"{'scaled ' if scale else ''}{'masked ' if mask else ''}Softmax ({len(nodes)} nodes) as one native kernel")


def rule_matmul(c, node, F):
    """A MatMul of two activations (no constant: a weight stays with numpy's BLAS, which blocks for cache)."""
    a, b = node.input[0], node.input[1]
    if a in c.consts or b in c.consts:
        return "a constant operand"
    if (c.ranks.get(a) or 0) < 2 or (c.ranks.get(b) or 0) < 2:
        return "an operand of rank 1 or unknown rank"
    out = node.output[0]
    xa, xb = c.float_input(a), c.float_input(b)
    v = c.add_val(out, "f", rank=c.ranks.get(out))
    name = node.name or node.op_type
    c.steps.append(MatMulStep(name, F, xa, xb, v.slot, "native float32 kernel"))
    c.entries.append(Entry(name, node.op_type, "fp32", "native float32 MatMul of two activations"))
    return None


def rule_erf(c, node, F):
    return _emit(c, node.input[0], [node], lambda name, x, y: ErfStep(name, F, x, y, "native float32 kernel"),
                 "native erf kernel")


def rule_conv_transpose(c, node, F):
    w = c.consts.get(node.input[1])
    b = node.input[2] if len(node.input) > 2 and node.input[2] else None
    if w is None or w.dtype != np.float32 or w.ndim != 4 or (b is not None and b not in c.consts):
        return "weights (or bias) not float32 constants of a 2-D ConvTranspose"
    if c.ranks.get(node.input[0]) not in (4, None):
        return "input not of rank 4"
    geometry = deconv_geometry(node, w.shape[2:], node_attrs(node).get("group", 1), phases=False)
    if isinstance(geometry, str):
        return geometry
    packed = F.pack_conv_transpose(w, c.consts[b] if b else None, geometry)
    xs = c.float_input(node.input[0])
    v = c.add_val(node.output[0], "f", rank=4)
    name = node.name or node.op_type
    c.steps.append(ConvTransposeStep(name, F, packed, xs, v.slot, "native float32 kernel"))
    c.entries.append(Entry(name, node.op_type, "fp32", "native float32 ConvTranspose"))
    return None


RULES = {"LayerNormalization": (rule_layernorm,), "ReduceMean": (rule_decomposed_layernorm,),
         "Softmax": (rule_softmax,), "Div": (rule_gelu, rule_scaled_softmax),
         "Mul": (rule_gelu, rule_scaled_softmax, dynamic.rule_scaled_quantize),
         "Add": (rule_scaled_softmax, rule_add_layernorm), "Erf": (rule_erf,),
         "MatMul": (rule_matmul,), "ConvTranspose": (rule_conv_transpose,)}


def rule_fp32(c, node):
    """The first rule for node's op that applies (None), else the last reason; 'no kernel' when none."""
    F = getattr(c.K, "f32", None)
    rules = RULES.get(node.op_type, ())
    if F is None or not rules:
        return "no native float32 kernel"
    if any(c.elem_types.get(i, FLOAT) != FLOAT for i in node.input[:1]) or \
            any(c.elem_types.get(o, FLOAT) != FLOAT for o in node.output[:1]):
        return "not float32 (the kernels are float32 only)"
    reason = None
    for rule in rules:
        reason = rule(c, node, F)
        if reason is None:
            return None
    return reason
