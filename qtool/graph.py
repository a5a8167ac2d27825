"""Small helpers over onnx.ModelProto shared by graph passes, calibration and quantization."""
from __future__ import annotations

import contextlib
import heapq
import os
from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.errors import QtoolError


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def attrs(node: onnx.NodeProto) -> dict:
    """Every attribute of `node` as a python value (a tensor attribute stays a TensorProto)."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def set_attr(node: onnx.NodeProto, name: str, value) -> None:
    for i, a in enumerate(node.attribute):
        if a.name == name:
            del node.attribute[i]
            break
    node.attribute.append(helper.make_attribute(name, value))


def initializers(model: onnx.ModelProto) -> dict:
    return {t.name: t for t in model.graph.initializer}


_FROZEN: dict = {}  # id(model) -> its initializer index, while a reader that changes nothing runs


@contextlib.contextmanager
def initializers_frozen(model: onnx.ModelProto):
    """Within the block, const_value(model, name) looks names up in one index made here, not in
    one made per call: rules ask about every node's inputs, which made a plan quadratic in graph
    size (2.5 s at 3000 nodes). The model's initializers must not change inside the block."""
    if id(model) in _FROZEN:
        yield
        return
    _FROZEN[id(model)] = initializers(model)
    try:
        yield
    finally:
        del _FROZEN[id(model)]


def const_value(model: onnx.ModelProto, name: str, inits: dict | None = None):
    """The numpy value of an initializer, or None if `name` is not a constant."""
    if inits is None:
        inits = _FROZEN.get(id(model)) or initializers(model)
    t = inits.get(name)
    return None if t is None else numpy_helper.to_array(t)


def set_initializer(model: onnx.ModelProto, name: str, value: np.ndarray, inits: dict | None = None) -> None:
    """Set (or add) initializer `name`. `inits`: the pass's own index of the initializers (name -> tensor,
    as initializers() gives), kept up to date here: a pass setting one per node then costs one lookup
    each, not a scan of every initializer (quadratic on a long chain)."""
    t = numpy_helper.from_array(np.asarray(value), name)
    if inits is not None:
        if name in inits:
            inits[name].CopyFrom(t)
        else:
            model.graph.initializer.append(t)
            inits[name] = model.graph.initializer[len(model.graph.initializer) - 1]
        return
    for i, old in enumerate(model.graph.initializer):
        if old.name == name:
            model.graph.initializer[i].CopyFrom(t)
            return
    model.graph.initializer.append(t)


def producers(model: onnx.ModelProto) -> dict:
    return {o: n for n in model.graph.node for o in n.output if o}


def consumers(model: onnx.ModelProto) -> dict:
    """tensor -> the nodes that read it: as an input, or by name inside their subgraphs (an If's
    branch reading the outer graph's tensors and weights), so no pass takes such a tensor for unread."""
    c = defaultdict(list)
    for n in model.graph.node:
        for i in (node_reads(n) if _subgraphs(n) else dict.fromkeys(n.input)):
            if i:
                c[i].append(n)
    return c


def holds_op(graphs: list, ops) -> bool:
    """Whether a node of a type in `ops` sits in `graphs` (GraphProtos), their If/Loop/Scan bodies included,
    at any depth (iterative)."""
    todo = list(graphs)
    while todo:
        g = todo.pop()
        for n in g.node:
            if n.op_type in ops:
                return True
            todo.extend(_subgraphs(n))
    return False


def samples_interact(model: onnx.ModelProto) -> bool:
    """Whether a sample's output depends on the other samples run in the same batch: a DynamicQuantizeLinear
    takes its range from the whole tensor it reads, so batched, every sample's int8 rounding would follow the
    others' values. Such a model's samples run one at a time wherever its output is judged (eval, and
    quantize's measurements), each giving what the model gives it alone. If/Loop bodies included."""
    return holds_op([model.graph], ("DynamicQuantizeLinear",))


def _subgraphs(node: onnx.NodeProto) -> list:
    out = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def node_reads(node: onnx.NodeProto) -> set:
    """Tensors a node reads: its inputs, and the outer-scope tensors its subgraphs (If, Loop, Scan)
    read by name without listing them as inputs. Nested subgraphs are walked with a stack."""
    reads = {i for i in node.input if i}
    stack = [(g, frozenset()) for g in _subgraphs(node)]
    while stack:
        g, enclosing = stack.pop()
        scope = enclosing | {i.name for i in g.input} | {t.name for t in g.initializer} \
            | {o for n in g.node for o in n.output if o}
        for n in g.node:
            reads.update(i for i in n.input if i and i not in scope)
            stack.extend((sub, scope) for sub in _subgraphs(n))
    return reads


def topological_order(model: onnx.ModelProto) -> list:
    """The nodes ordered so that every tensor is written before it is read (Kahn's algorithm).
    Among nodes ready at the same time the earliest in the graph goes first, so an already sorted
    graph keeps its order. Iterative: exporters write graphs thousands of nodes deep."""
    nodes = list(model.graph.node)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    readers = defaultdict(list)  # node index -> indices of the nodes that read one of its outputs
    waiting = []  # per node: how many producers it still waits for
    for k, n in enumerate(nodes):
        deps = {producer[t] for t in node_reads(n) if t in producer}
        waiting.append(len(deps))
        for d in deps:
            readers[d].append(k)
    ready = [k for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(nodes[k])
        for r in readers[k]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) < len(nodes):
        stuck = next(n for k, n in enumerate(nodes) if waiting[k] > 0)
        raise QtoolError(f"the graph has a cycle: node '{stuck.name}' ({stuck.op_type}) is on one or after one")
    return order


def toposort(model: onnx.ModelProto) -> None:
    """Reorder the graph's nodes topologically (see topological_order)."""
    order = topological_order(model)
    del model.graph.node[:]
    model.graph.node.extend(order)


def tensors_reaching(model: onnx.ModelProto, targets: set, order: list | None = None) -> set:
    """Tensors from which some node named in `targets` can be reached (a target's own inputs
    included): one pass over the nodes in reverse topological order (`order`, if the caller has
    it), exact at any depth."""
    reaching = set()
    for n in reversed(topological_order(model) if order is None else order):
        if n.name in targets or any(o in reaching for o in n.output if o):
            reaching.update(node_reads(n))
    return reaching


def graph_output_names(model: onnx.ModelProto) -> set:
    return {o.name for o in model.graph.output}


def opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return 1


def drop_nodes(model: onnx.ModelProto, nodes: list, gone: set) -> None:
    """The graph's nodes become `nodes` (its nodes, as list(model.graph.node) gave them) without those at
    the positions in `gone`: one rewrite for a pass's removals (a graph.node.remove per node scans the
    graph each time)."""
    keep = [n for k, n in enumerate(nodes) if k not in gone]
    del model.graph.node[:]
    model.graph.node.extend(keep)


class Names(set):
    """Tensor names in use, and per base name the first suffix unique_name may still find free (names are
    only added: the ones below it stay taken), so that naming the k-th `w_folded` costs one step, not k."""

    def __init__(self, names=()):
        super().__init__(names)
        self.next_suffix = {}


def taken_names(model: onnx.ModelProto) -> Names:
    """Every tensor name of the main graph (node outputs, initializers, inputs): unique_name's `taken`,
    made once by a pass that names many new tensors."""
    return Names({o for n in model.graph.node for o in n.output} | {t.name for t in model.graph.initializer}
                 | {i.name for i in model.graph.input})


def unique_name(model: onnx.ModelProto, base: str, taken: set | None = None) -> str:
    """`base`, else the first of `base`_1, `base`_2, ... not in `taken` (default: the model's names)."""
    taken = taken if taken is not None else taken_names(model)
    start = taken.next_suffix.get(base, 1) if isinstance(taken, Names) else 1
    name, k = base, start
    if name in taken:
        name = f"{base}_{k}"
        while name in taken:
            name, k = f"{base}_{k + 1}", k + 1
        if isinstance(taken, Names):
            taken.next_suffix[base] = k + 1
    taken.add(name)
    return name


def remove_unused_initializers(model: onnx.ModelProto) -> int:
    used = {i for n in model.graph.node for i in node_reads(n)} | graph_output_names(model)
    keep = [t for t in model.graph.initializer if t.name in used]
    gone = {t.name for t in model.graph.initializer} - {t.name for t in keep}
    removed = len(gone)
    if removed:
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)
        # old exporters list weights as graph inputs too: those go with their initializer
        ins = [i for i in model.graph.input if i.name not in gone]
        del model.graph.input[:]
        model.graph.input.extend(ins)
    return removed


def real_inputs(model: onnx.ModelProto) -> list:
    """Graph inputs that are not initializers (old exporters list weights as inputs)."""
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def count_macs(model: onnx.ModelProto, inputs: dict) -> int | None:
    """Multiply-accumulates of the Conv, Gemm and MatMul nodes for inputs of these shapes (input name ->
    shape); None where one of those nodes' shapes cannot be inferred."""
    each = _macs_each(model, inputs)
    return None if each is None else sum(m for _, m in each)


def layer_macs(model: onnx.ModelProto, inputs: dict) -> dict | None:
    """node name -> multiply-accumulates of each Conv, Gemm and MatMul node for inputs of these shapes;
    None where one of those nodes' shapes cannot be inferred."""
    each = _macs_each(model, inputs)
    return None if each is None else {n.name: m for n, m in each}


def total_macs(model: onnx.ModelProto, inputs: dict, shapes: dict | None = None) -> int | None:
    """Multiply-accumulates of all Conv, Gemm and MatMul nodes for inputs of these shapes (nodes
    without names counted too); None where one of those nodes' shapes cannot be inferred. `shapes`:
    inferred_shapes(model, inputs), when the caller has it already."""
    each = _macs_each(model, inputs, shapes)
    return None if each is None else int(sum(m for _, m in each))


def _macs_each(model: onnx.ModelProto, inputs: dict, shapes: dict | None = None) -> list | None:
    known = {t.name: list(t.dims) for t in model.graph.initializer}
    known.update(inferred_shapes(model, inputs) if shapes is None else shapes)
    each = []
    for n in model.graph.node:
        if n.op_type not in ("Conv", "Gemm", "MatMul"):
            continue
        out = known.get(n.output[0]) if n.output else None
        w = known.get(n.input[1]) if len(n.input) > 1 else None
        if not out or not w or any(not d for d in out) or any(not d for d in w):
            return None
        if n.op_type == "Conv":  # every output value: Cin/group * kh * kw products
            macs = int(np.prod(out)) * int(np.prod(w[1:]))
        elif n.op_type == "Gemm":
            macs = int(np.prod(out)) * (w[1] if attr(n, "transB", 0) else w[0])
        else:
            a = known.get(n.input[0])
            macs = int(np.prod(out)) * (a[-1] if a and a[-1] else w[-2])
        each.append((n, macs))
    return each


# ops that pick entries by a computed order (ArgMax: a tagger's or a classifier's ids out of its scores)
SELECTING = ("TopK", "NonMaxSuppression", "GatherElements", "ArgMax", "ArgMin")


COMPUTE = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "LSTM", "GRU", "RNN")  # where int8 work happens


def reference_output(model: onnx.ModelProto) -> str:
    """The tensor quantize judges a model by (its experiments' SQNR, agreement, KL): the first float
    output (a tagger's int64 path or a detector's count come before its scores in some exports), else
    the first output; but where the graph ends by selecting entries in a computed order (an NMS-free
    detector's TopK of 300 boxes), the dense tensor they are selected from: int8 noise reorders the
    selection, and an SQNR over reordered boxes (YOLO26n: 3.8 dB for every range method) tells nothing."""
    prods, order = producers(model), topological_order(model)
    compute = {n.name for n in order if n.op_type in COMPUTE}
    before_compute = tensors_reaching(model, compute, order)  # tensors some compute reads, at any depth
    computed = set()  # tensors some compute wrote, at any depth
    for n in order:
        if n.op_type in COMPUTE or any(i in computed for i in node_reads(n)):
            computed.update(o for o in n.output if o)
    picked = []
    for n in model.graph.node:
        # only a selection at the end, made from what compute wrote: a GatherElements that frames a
        # waveform before an STFT and a mel MatMul (a speech front end) is input preparation, and the
        # tensor it reads is one no int8 layer touches (every experiment measured inf dB there)
        if n.op_type in SELECTING and n.input and n.input[0] in computed \
                and not any(o in before_compute for o in n.output if o):
            t = _before_filter(n.input[0], prods)
            p = prods.get(t)
            if p is not None and p.op_type in ("Split", "Slice"):  # (boxes and scores cut from one tensor)
                t = p.input[0]
            picked.append(t)
    if picked:
        return max(dict.fromkeys(picked), key=picked.count)
    return unmasked(model, first_output(model), prods)


def unmasked(model: onnx.ModelProto, t: str, prods: dict | None = None) -> str:
    """Where the output is Where(mask, values, NaN or inf): entries masked by design (caustic-nmr writes
    NaN for the shifts of atoms a residue lacks), the values. Judged by the output, every sample held a
    NaN and was left out: no experiment ran."""
    prods = producers(model) if prods is None else prods
    for _ in range(4):
        p = prods.get(t)
        if p is None or p.op_type != "Where" or len(p.input) < 3:
            break
        if _not_finite_constant(model, p.input[2], prods):
            t = p.input[1]
        elif _not_finite_constant(model, p.input[1], prods):
            t = p.input[2]
        else:
            break
    return t


def _not_finite_constant(model: onnx.ModelProto, name: str, prods: dict) -> bool:
    v = small_constant(model, name, prods, 64)
    return v is not None and v.dtype.kind == "f" and v.size > 0 and not np.isfinite(v).any()


def small_constant(model: onnx.ModelProto, name: str, prods: dict, max_elems: int, inits: dict | None = None):
    """The value the graph itself sets a tensor to, where it holds at most `max_elems` values: an
    initializer's, a Constant's, or the one a ConstantOfShape fills with (a NaN map of the values' shape);
    None for a computed tensor or a larger one, which is never read."""
    p = prods.get(name)
    if p is not None and p.op_type in ("Constant", "ConstantOfShape"):
        t = attr(p, "value")
    else:
        t = (inits if inits is not None else _FROZEN.get(id(model)) or initializers(model)).get(name)
    if not isinstance(t, onnx.TensorProto) or int(np.prod(t.dims)) > max_elems:
        return None
    return numpy_helper.to_array(t)


# indices that depend on the data: the candidates a score threshold keeps, the best k
_DATA_INDICES = ("NonZero", "TopK", "ArgMax", "ArgMin", "NonMaxSuppression")
_MOVEMENT = ("Unsqueeze", "Squeeze", "Reshape", "Transpose", "Flatten", "Identity", "Split", "Slice")


def _before_filter(t: str, prods: dict, depth: int = 12) -> str:
    """Where a selection reads candidates that a data-dependent gather picked (a YOLO export's NMS over
    the boxes whose score passed a threshold: NonZero, GatherND, box arithmetic, [1, K, 4], K varying),
    the dense tensor they were gathered from, back over data movement and a constant pick of one image
    ([N, 8400, 4 + classes]: its rows follow the samples); else t itself."""
    todo, seen = [(t, 0)], set()
    while todo:  # breadth first: the gather nearest the selection
        u, d = todo.pop(0)
        p = prods.get(u)
        if p is None or u in seen or d > depth:
            continue
        seen.add(u)
        if p.op_type in ("GatherND", "Gather", "Compress") and len(p.input) > 1 and _data_dependent(p.input[1], prods):
            v = p.input[0]
            while True:
                q = prods.get(v)
                if q is None or not q.input or not (q.op_type in _MOVEMENT or (
                        q.op_type == "Gather" and len(q.input) > 1 and q.input[1] not in prods)):
                    return v
                v = q.input[0]
        todo += [(i, d + 1) for i in p.input if i]
    return t


def _data_dependent(t: str, prods: dict, depth: int = 8) -> bool:
    todo, seen = [(t, 0)], set()
    while todo:
        u, d = todo.pop()
        p = prods.get(u)
        if p is None or u in seen or d > depth:
            continue
        seen.add(u)
        if p.op_type in _DATA_INDICES:
            return True
        todo += [(i, d + 1) for i in p.input if i]
    return False


def first_output(model: onnx.ModelProto) -> str:
    """The first float output, else the first output."""
    outs = list(model.graph.output)
    floats = [o for o in outs if o.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                                   onnx.TensorProto.DOUBLE)]
    return (floats or outs)[0].name


def input_dims(value_info) -> list:
    """Dims of a graph input: ints where known, the dim_param string (or None) where dynamic."""
    out = []
    for d in value_info.type.tensor_type.shape.dim:
        out.append(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or None))
    return out


def rewire(model: onnx.ModelProto, old: str, new: str) -> None:
    """Every consumer of tensor `old` reads `new` instead, subgraphs reading it by name included."""
    rewire_many(model, {old: new})


def rewire_many(model: onnx.ModelProto, renames: dict) -> None:
    """Every consumer of each tensor `old` in `renames` reads renames[old] instead, subgraphs reading it
    by name included: one walk over the graph however many names change. A pass removing k nodes gives
    them all here at once; a walk per removed node was quadratic (remove_identity on a 10,000-node chain
    of Identity/Dropout took 86 s in `qtool inspect`). Chains resolve as renaming one name after the
    other would: {b: a, c: b} makes c's readers read a."""
    renames = _resolved(renames)
    if renames:
        _rename_reads([(model.graph, False, renames)])


def _resolved(renames: dict) -> dict:
    out = {}
    for old in renames:
        seen, t = [], old
        while t in renames and t not in out and t not in seen:
            seen.append(t)
            t = renames[t]
        t = out.get(t, t)
        for s in seen:
            out[s] = t
    return {k: v for k, v in out.items() if k != v}


def rename_reads(node: onnx.NodeProto, old: str, new: str) -> None:
    """`node` reads `new` where it read `old`: as an input, and inside its subgraphs (by name)."""
    for k, i in enumerate(node.input):
        if i == old:
            node.input[k] = new
    _rename_reads([(g, True, {old: new}) for g in _subgraphs(node)])


def _rename_reads(stack: list) -> None:
    """Rename reads in each (graph, is a subgraph, {old: new}) of `stack`, and in their subgraphs."""
    while stack:
        g, sub, names = stack.pop()
        if sub:
            own = names.keys() & ({i.name for i in g.input} | {t.name for t in g.initializer}
                                  | {o for n in g.node for o in n.output})
            if own:  # (a subgraph's own tensor of that name hides the outer one)
                names = {k: v for k, v in names.items() if k not in own}
                if not names:
                    continue
        for n in g.node:
            for k, i in enumerate(n.input):
                if i in names:
                    n.input[k] = names[i]
            stack.extend((x, True, names) for x in _subgraphs(n))
        if sub:
            for o in g.output:  # a branch may return the outer tensor itself
                if o.name in names:
                    o.name = names[o.name]


SKELETON_MAX_ELEMS = 1024


def _repeated(f) -> bool:
    return f.is_repeated if hasattr(f, "is_repeated") else f.label == f.LABEL_REPEATED


def copy_fields(src, dst, skip=()) -> None:
    """Copy every set field of protobuf message `src` into `dst`, except the fields named in `skip`
    (which are never read: reading a bytes field copies it)."""
    for f in src.DESCRIPTOR.fields:
        if f.name in skip:
            continue
        if _repeated(f):
            if len(getattr(src, f.name)):
                getattr(dst, f.name).extend(getattr(src, f.name))
        elif src.HasField(f.name):
            if f.message_type is not None:
                getattr(dst, f.name).CopyFrom(getattr(src, f.name))
            else:
                setattr(dst, f.name, getattr(src, f.name))


def skeleton(model: onnx.ModelProto, max_elems: int = SKELETON_MAX_ELEMS, drop_tables: bool = True,
             nodes: bool = True) -> onnx.ModelProto:
    """A copy of the model without its large weights, for shape and type inference.

    Large initializers become graph inputs of the same type and shape, so inference sees
    every shape while never serializing hundreds of MB of weights; small ones (shapes,
    axes, pads) stay, since inference reads their values. The model itself is only read
    (its weights are neither copied nor moved). `drop_tables`: also without the long list attributes of
    ai.onnx.ml's and other domains' ops, which no shape depends on (False for the checker, which wants
    them: a required one missing fails it, as TreeEnsemble's at ai.onnx.ml opset 5, and for a size).
    `nodes`: False leaves the nodes out (a size measured a node at a time).
    """
    m = onnx.ModelProto()
    copy_fields(model, m, skip=("graph",))
    graph = model.graph
    copy_fields(graph, m.graph, skip=("initializer", "node"))
    for node in graph.node if nodes else ():
        # a tree ensemble's node and leaf tables (luscinia's LightGBM: 194 MB of attributes, 2.5 GB copied into
        # inference) say nothing about shapes; its class labels, which set the output type, are kept (only
        # ai.onnx.ml's and other domains' ops: a Constant's long value_floats is its output)
        n = m.graph.node.add()
        copy_fields(node, n, skip=("attribute",))
        n.attribute.extend(a for a in node.attribute if not drop_tables or node.domain in ("", "ai.onnx")
                           or "label" in a.name or max(len(a.ints), len(a.floats), len(a.strings)) <= max_elems)
    big = []
    for t in graph.initializer:
        if int(np.prod(t.dims)) <= max_elems:
            m.graph.initializer.append(t)
        else:
            big.append(t)
    have = {i.name for i in m.graph.input}
    for t in big:
        if t.name not in have:
            m.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return m


def name_nodes(model: onnx.ModelProto) -> None:
    """Give every node a unique name: plans, reports and exclusions refer to nodes by name."""
    seen = set()
    for k, n in enumerate(model.graph.node):
        if not n.name or n.name in seen:
            base = n.name or f"{n.op_type}_{k}"
            name, j = base, 1
            while name in seen:
                name, j = f"{base}_{j}", j + 1
            n.name = name
        seen.add(n.name)


QUANTIZED_OPS = ("QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger",
                 "MatMulInteger", "DynamicQuantizeLinear")


def quantized_ops(model: onnx.ModelProto) -> dict:
    """op type -> count of the ops that make a model quantized already (QDQ or QOperator form)."""
    c = {}
    for n in model.graph.node:
        if n.op_type in QUANTIZED_OPS:
            c[n.op_type] = c.get(n.op_type, 0) + 1
    return c


def infer_shapes_guarded(model: onnx.ModelProto, **kwargs) -> onnx.ModelProto:
    """onnx.shape_inference.infer_shapes(model, **kwargs) in a forked child process. onnx's C++ inference
    can abort the whole process instead of raising: with data propagation, waifu2x's CUNet at an input of
    1 x 1 (one of the sizes fold_constants tries) crops past its border and a Slice's bounds fail a
    libstdc++ assertion (SIGABRT, calibrate exit 134). A child that dies or fails raises ValueError here,
    as a failed inference would; the model is only read (the child gets it through fork, copy on write).
    Only for sizes qtool makes up (fold_constants' instantiations, while the process is small): a child
    forked from a process holding GBs of samples shares them, yet a tool summing its processes' RSS
    counts them twice (the zoo bench read PP-OCRv5's detector's quantize at 5.0 GB for 2.7)."""
    if not hasattr(os, "fork"):
        return onnx.shape_inference.infer_shapes(model, **kwargs)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: infer, write the result, leave without running any of the parent's cleanup
        code = 1
        try:
            os.close(r)
            import faulthandler
            faulthandler.disable()  # (an abort is expected here: no traceback dump of the parent's threads)
            data = onnx.shape_inference.infer_shapes(model, **kwargs).SerializeToString()
            with os.fdopen(w, "wb") as f:
                f.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        why = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
        raise ValueError(f"shape inference failed ({why})")
    out = onnx.ModelProto()
    out.ParseFromString(data)
    return out


def inferred_shapes(model: onnx.ModelProto, inputs: dict | None = None, symbols: bool = False) -> dict:
    """tensor -> its dims from ONNX shape inference (on the weightless skeleton): ints where known,
    None where symbolic or unknown ({} when inference fails). `inputs` (input name -> shape): infer
    for inputs of these shapes (a dynamic model's sizes for one batch of samples). `symbols`: a symbolic
    dim as its name (two dims of one name are equal: what fuse/attention.py proves a Reshape with)."""
    try:
        sk = skeleton(model)
        for i in sk.graph.input:
            if inputs and i.name in inputs and i.type.HasField("tensor_type"):
                dims = i.type.tensor_type.shape.dim
                del dims[:]
                for d in inputs[i.name]:
                    dims.add().dim_value = int(d)
        inf = onnx.shape_inference.infer_shapes(sk, strict_mode=False, data_prop=True)
    except Exception:
        return {}
    out = {}
    for vi in list(inf.graph.value_info) + list(inf.graph.input) + list(inf.graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0
                            else (d.dim_param or None if symbols else None) for d in t.shape.dim]
    return out
