"""Fold run-time shape arithmetic and constant subgraphs into initializers.

Before: Shape(x) -> Gather -> Sub -> ConstantOfShape -> Concat -> ... -> Pad(x, pads)
After:  Pad(x, pads=<initializer>)

Precondition for each node: every input is a constant, or the node is Shape of a tensor
whose shape is known. Dynamic dimensions stay dynamic: the graph is evaluated under three
different instantiations of every unknown dimension (batch 1, 2 and 3, other free dims 33, 64
and 200: different parities and residues, so padding that depends on size mod stride shows),
and a value is folded only where all agree, so nothing that depends on the batch (or on a free
spatial size) is frozen. Two were not enough: 33 and 64 both shrink to 2 at stride 32, and a
detector's attention reshape [N, 2, 128, H*W] froze H*W at 4. Three more sizes veto where they
compute (VETOS): 7 (a Slice of 32 learned positions gives 32 rows for every length above 32), 1
(a test of `dim == 1`) and 1031 (a threshold above 200, as max(length, 256)).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from qtool import graph as G
from qtool.limits import MAX_FOLD_ELEMS, MAX_FOLD_TOTAL_BYTES, elems, fold_elems

# ops whose output is not a function of their inputs, or that have subgraphs
_NEVER = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
          "Bernoulli", "If", "Loop", "Scan", "QuantizeLinear", "DequantizeLinear"}
# do not materialize huge tensors that a graph computes on the fly: the size of every output is
# bounded from the inputs' shapes and values *before* the node is evaluated (a 1.8 KB model with
# ConstantOfShape([1e5, 1e5]) must not allocate 40 GB), and all values computed for one graph
# together stay under MAX_FOLD_TOTAL_BYTES
_MAX_FOLD_ELEMS = MAX_FOLD_ELEMS
FREE_DIMS = (33, 64, 200, 7, 1, 1031)  # a free dim in each instantiation
BATCH = (1, 2, 3, 4, 1, 5)  # the batch in each
VARIANTS = range(3)  # where a value must be computed, and equal
VETOS = (3, 4, 5)  # where a value computed must be equal too; a graph whose shapes do not work at that size
# does not compute it there. 7, small: a Slice of 32 learned positions clamps every larger length to 32.
# 1: a branch on `dim == 1` (pyannote's segmentation model takes its 1-channel path on Shape(x)[1] == 1).
# 1031, large: padding to whole frames of max(length, 256) (swift-f0) is 0 for every length below 256.

def _pinned(model: onnx.ModelProto, variant: int, pins: dict) -> onnx.ModelProto:
    m = G.skeleton(model)
    del m.graph.value_info[:]
    for inp in G.real_inputs(model):
        inp = next(i for i in m.graph.input if i.name == inp.name)
        dims = inp.type.tensor_type.shape.dim
        pin = pins.get(inp.name)
        for k, d in enumerate(dims):
            if pin is not None and k < len(pin) and pin[k] and k > 0:
                d.dim_value = int(pin[k])
            elif not (d.HasField("dim_value") and d.dim_value > 0):
                d.dim_value = BATCH[variant] if k == 0 else FREE_DIMS[variant]
    return m


def _shapes(model: onnx.ModelProto) -> dict:
    try:
        inferred = G.infer_shapes_guarded(model, strict_mode=False, data_prop=True)  # (our sizes: may abort)
    except Exception:
        return {}
    out = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            out[vi.name] = tuple(d.dim_value for d in dims)
    return out


def _constant_elems(node: onnx.NodeProto) -> int | None:
    for a in node.attribute:
        if a.name in ("value", "sparse_value"):
            return elems(a.t.dims if a.name == "value" else a.sparse_tensor.dims)
        if a.name.startswith("value_"):
            return max(len(a.floats), len(a.ints), len(a.strings), 1)
    return None


def _run(node: onnx.NodeProto, opset: int, feeds: dict, memo: dict | None, key):
    """The node evaluated by ONNX's reference evaluator; a node whose inputs do not depend on the free
    dims (`key` not None: its index) is evaluated once for every instantiation (EfficientNet-Lite0's
    400 Constant nodes took 0.6 s, six times over)."""
    if memo is not None and key is not None and key in memo:
        return memo[key]
    outs = ReferenceEvaluator(node, opsets={"": opset}).run(None, feeds)
    if memo is not None and key is not None:
        memo[key] = outs
    return outs


def _eval(node: onnx.NodeProto, feeds: dict, opset: int, shapes: dict, memo: dict | None = None, key=None):
    if node.op_type == "Constant":
        n = _constant_elems(node)
        if n is None or n > _MAX_FOLD_ELEMS:
            return None
        try:
            return [np.asarray(_run(node, opset, {}, memo, key)[0])]
        except Exception:
            return None
    if node.op_type == "Shape":
        shp = shapes.get(node.input[0])
        if shp is None:
            return None
        start, end = G.attr(node, "start", 0), G.attr(node, "end", None)
        return [np.array(shp[start:end], np.int64)]
    if node.op_type in _NEVER or node.domain not in ("", "ai.onnx"):
        return None
    names = [i for i in node.input if i]
    if any(i not in feeds for i in names):
        return None
    bound = fold_elems(node.op_type, [feeds[i] if i else None for i in node.input], G.attrs(node))
    if bound is None:  # no bound from the inputs: the shapes inference found for the outputs
        outs = [shapes.get(o) for o in node.output if o]
        bound = None if not outs or any(o is None for o in outs) else max(elems(o) for o in outs)
    if bound is None or bound > _MAX_FOLD_ELEMS:
        return None
    try:
        outs = _run(node, opset, {i: feeds[i] for i in names}, memo, key)
    except Exception:
        return None
    return [np.asarray(o) for o in outs]


def _values(model: onnx.ModelProto, variant: int, pins: dict, shapes: dict | None = None,
            memo: dict | None = None) -> dict:
    """`memo`: shared by the instantiations of one run, for what does not depend on the free dims."""
    shapes = _shapes(_pinned(model, variant, pins)) if shapes is None else shapes
    inits = {t.name: t for t in model.graph.initializer}
    fixed = set(inits)  # tensors whose value cannot depend on the free dims (nothing downstream of a Shape)
    vals = {}
    op = G.opset(model)
    computed = 0  # bytes of values evaluated here (weights read from the model do not count)
    for k, node in enumerate(model.graph.node):
        reads = G.node_reads(node)
        if node.op_type != "Shape" and all(i in fixed for i in reads):
            fixed.update(o for o in node.output if o)
        if node.op_type == "Shape" or all(i in vals or i in inits for i in reads):
            for i in node.input:
                if i and i not in vals and i in inits:  # weights are read only when a node folds them
                    vals[i] = numpy_helper.to_array(inits[i])
            outs = _eval(node, vals, op, shapes, memo, k if node.output and node.output[0] in fixed else None)
            if outs is None:
                continue
            computed += sum(int(getattr(v, "nbytes", 0)) for v in outs)
            if computed > MAX_FOLD_TOTAL_BYTES:
                break  # enough: what is folded so far stays folded, the rest is computed at run time
            for name, v in zip(node.output, outs):
                if name:
                    vals[name] = v
    return vals


def instantiate(model: onnx.ModelProto, variant: int, pins: dict) -> tuple[dict, dict]:
    """(shapes, constant values) of every tensor under one instantiation of the free dims."""
    shapes = _shapes(_pinned(model, variant, pins))
    return shapes, _values(model, variant, pins, shapes)


def run(model: onnx.ModelProto, ctx) -> bool:
    inits = {t.name for t in model.graph.initializer}
    foldable = [n for n in model.graph.node if n.op_type in ("Constant", "Shape")
                or (n.input and all((i in inits) or not i for i in n.input))]
    if not any(n.op_type in ("Constant", "Shape") for n in model.graph.node) and not foldable:
        return False
    memo = {}
    a, *rest = [_values(model, v, ctx.input_pins, memo=memo) for v in VARIANTS]
    vetos = [_values(model, v, ctx.input_pins, memo=memo) for v in VETOS]
    outputs = G.graph_output_names(model)
    fold, nodes = [], list(model.graph.node)
    for at, n in enumerate(nodes):
        outs = [o for o in n.output if o]
        if not outs or any(o not in v for o in outs for v in [a] + rest):
            continue
        same = all(a[o].shape == b[o].shape and a[o].dtype == b[o].dtype and np.array_equal(a[o], b[o])
                   for o in outs for b in rest + vetos if o in b)
        if same and all(a[o].size <= _MAX_FOLD_ELEMS for o in outs) and not (set(outs) & outputs and n.op_type != "Constant"):
            fold.append(at)
    if not fold:
        return False
    folded_outputs = {o for at in fold for o in nodes[at].output if o}
    gone = set(fold)  # (positions: `n not in fold` compared node messages field by field, quadratic)
    needed = {i for k, n in enumerate(nodes) if k not in gone for i in G.node_reads(n)} | outputs
    G.drop_nodes(model, nodes, gone)
    index = G.initializers(model)
    for name in sorted(folded_outputs & needed):
        if name not in inits:
            G.set_initializer(model, name, a[name], index)
    G.remove_unused_initializers(model)
    ctx.log("fold_constants", f"folded {len(fold)} nodes into constants")
    return True
