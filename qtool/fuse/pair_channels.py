"""Reorder channels so that ONNX Runtime's int16 pairs of int8 weights cannot saturate.

On x86 without VNNI, ONNX Runtime adds the products of neighbouring input channels in a
saturating int16 (qtool/arithmetic.py): a same-sign weight pair summing past 128 can saturate,
and the portable target must then give that output channel a coarser scale. Which channels
are neighbours is only the order of the tensor's channels, which the graph is free to choose:

Before: Conv_a(W_a, b_a) -> Relu -> DwConv(W_d, b_d) -> Relu -> Conv_b(W_b)
After:  Conv_a(W_a[p], b_a[p]) -> Relu -> DwConv(W_d[p], b_d[p]) -> Relu -> Conv_b(W_b[:, p])

computes the same function for any permutation p, and p is chosen so that, in every output
channel of every reader (Conv_b here), a large weight sits next to one of the other sign or a
small one. A set of tensors that must share one order (a component) is found by union-find:
element-wise and per-channel ops (activations, depthwise Conv, BatchNorm, pooling, Add/Mul of
same-shaped tensors or per-channel constants, Flatten of [N, C, 1, 1]) join their inputs and
output; Conv (group 1), Gemm and MatMul with constant weights start a component with their
output channels and end one with their input channels. A component touched by anything else
(Concat, Reshape, Transpose, a graph input or output, an unknown shape) is left as it is.

p pairs channels greedily (the channel with the most to lose first, with the partner that
costs it least), cost = sum over readers' output channels and taps of (|w_i + w_j| - 128)^2
for same-sign pairs past the limit, weights in steps of max|w|/127; p is applied only when it
lowers that cost, so the pass is idempotent.
"""
from __future__ import annotations

import os

import numpy as np
import onnx

from qtool import graph as G
from qtool import qparams as Q
from qtool.arithmetic import PAIR_LIMIT

try:  # the cost matrix in C; _accumulate_reference below is the reference and the fallback
    from qtool.fuse import _pair_cost as _native
except ImportError:  # pragma: no cover - exercised when the extension is not built
    _native = None

UNARY = {"Relu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "LeakyRelu", "Tanh", "Elu", "Selu", "Softplus",
         "Softsign", "Neg", "Abs", "Exp", "Log", "Sqrt", "Erf", "Identity", "Dropout", "Mish", "Celu",
         "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool", "GlobalLpPool"}
BINARY = {"Add", "Sub", "Mul", "Div", "Max", "Min"}
FLATTEN = {"Flatten", "Squeeze", "Reshape"}
THREADS = None  # threads of the native cost matrix (None: every core); the result is the same on any number


def _channels(shapes, name):
    s = shapes.get(name)
    return s[1] if s is not None and len(s) >= 2 and s[1] else None


class _Sets:
    """Union-find over tensor names (iterative: graphs can be thousands of nodes deep)."""

    def __init__(self):
        self.parent = {}

    def find(self, a):
        self.parent.setdefault(a, a)
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:
            self.parent[a], a = root, self.parent[a]
        return root

    def union(self, a, b):
        self.parent[self.find(a)] = self.find(b)


def _weight_axes(node, inits, shapes):
    """(axis of the weight's input channels, axis of its output channels) for a node whose constant
    weight reads and writes whole channels: Conv with group 1, Gemm (transA 0) and MatMul on 2-D."""
    if len(node.input) < 2 or node.input[1] not in inits or node.input[0] in inits:
        return None
    w = inits[node.input[1]]
    if node.op_type == "Conv" and G.attr(node, "group", 1) == 1 and len(w.dims) >= 3:
        return 1, 0
    two_d = len(shapes.get(node.input[0]) or []) == 2 and len(w.dims) == 2
    if node.op_type == "Gemm" and two_d and not G.attr(node, "transA", 0):
        return (1, 0) if G.attr(node, "transB", 0) else (0, 1)
    if node.op_type == "MatMul" and two_d:
        return 0, 1
    return None


def _depthwise(node, inits, shapes):
    if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in inits:
        return False
    w = inits[node.input[1]]
    return G.attr(node, "group", 1) == _channels(shapes, node.input[0]) == w.dims[0] and w.dims[1] == 1


def _per_channel_axis(const_shape, out_rank, c):
    """The axis along which a constant operand follows the channels (None: it is the same for every
    channel), or False when it cannot follow a reordering."""
    shape = (1,) * (out_rank - len(const_shape)) + tuple(const_shape)
    if len(shape) != out_rank or out_rank < 2:
        return False
    if shape[1] == 1:
        return None
    return len(const_shape) - (out_rank - 1) if shape[1] == c else False


def _components(model, shapes, inits):
    """Union-find of the tensors that must share one channel order -> (root -> [(node, input index,
    axis, kind)] of the constants to reorder, the roots that cannot be reordered)."""
    sets, bad, edits = _Sets(), set(), []
    for node in model.graph.node:
        ins = [i for i in node.input if i and i not in inits]
        outs = [o for o in node.output if o]
        op = node.op_type
        wa = _weight_axes(node, inits, shapes)
        if wa is not None and len(outs) == 1:
            w = inits[node.input[1]]
            taps = int(np.prod(w.dims[2:])) if node.op_type == "Conv" else 1
            if taps > 1 and w.dims[1] % 2:
                # an odd channel count over several taps: ORT's pairs cross taps (arithmetic.conv_rows),
                # which the per-tap cost below does not model; leave this input's order alone
                bad.add(node.input[0])
            else:
                edits.append((node.input[0], node, 1, wa[0], "reader"))
            edits.append((outs[0], node, 1, wa[1], "source"))
            if len(node.input) > 2 and node.input[2]:
                b = inits.get(node.input[2])
                if b is not None and len(b.dims) >= 1 and int(np.prod(b.dims)) == b.dims[-1] == w.dims[wa[1]]:
                    edits.append((outs[0], node, 2, len(b.dims) - 1, "param"))
                elif b is None or int(np.prod(b.dims)) != 1:  # (a bias of one value broadcasts: nothing to reorder)
                    bad.add(outs[0])
            continue
        if _depthwise(node, inits, shapes) and len(outs) == 1:
            edits.append((outs[0], node, 1, 0, "param"))
            if len(node.input) > 2 and node.input[2]:
                edits.append((outs[0], node, 2, 0, "param"))
            sets.union(node.input[0], outs[0])
            continue
        if op in UNARY and len(outs) == 1 and node.input[0] not in inits \
                and all(i in inits and int(np.prod(inits[i].dims)) == 1 for i in node.input[1:] if i):
            sets.union(node.input[0], outs[0])
            continue
        if op == "BatchNormalization" and len(outs) == 1 and all(i in inits for i in node.input[1:5]):
            edits.extend((outs[0], node, k, 0, "param") for k in range(1, 5))
            sets.union(node.input[0], outs[0])
            continue
        if op in FLATTEN and len(outs) == 1:
            s_in, s_out = shapes.get(node.input[0]), shapes.get(outs[0])
            if s_in and s_out and len(s_in) == 4 and s_in[2:] == [1, 1] and len(s_out) == 2 \
                    and s_in[1] and s_out[1] == s_in[1]:
                sets.union(node.input[0], outs[0])
                continue
        if op in BINARY and len(node.input) == 2 and len(outs) == 1:
            c, rank = _channels(shapes, outs[0]), len(shapes.get(outs[0]) or [])
            ok = c is not None
            for k, i in enumerate(node.input):
                if not ok:
                    break
                if i in inits:
                    ax = _per_channel_axis(list(inits[i].dims), rank, c)
                    if ax is False:
                        ok = False
                    elif ax is not None:
                        edits.append((outs[0], node, k, ax, "param"))
                elif _channels(shapes, i) == c and len(shapes.get(i) or []) == rank:
                    sets.union(i, outs[0])
                elif _channels(shapes, i) != 1:
                    ok = False
            if ok:
                continue
        bad.update(ins)  # any other reader or writer fixes the channel order of what it touches
        bad.update(outs)
        bad.update(G.node_reads(node))  # (an If/Loop body reads outer tensors without listing them)
    bad.update(i.name for i in model.graph.input)
    bad.update(G.graph_output_names(model))
    bad.update(o for n in model.graph.node for o in n.output if o and _channels(shapes, o) is None)
    groups = {}
    for t, node, k, axis, kind in edits:
        groups.setdefault(sets.find(t), []).append((node, k, axis, kind))
    return groups, {sets.find(t) for t in bad}


def _steps(w, axis) -> np.ndarray:
    """A reader weight as rows [output channel x taps, C] of float32 steps of its output channel's
    max|w| / 127, C its input channels (the order pairing permutes)."""
    moved = np.moveaxis(np.asarray(w), axis, -1)
    # each output channel's max|w| taken on the weights as they are (a max is exact in any precision), the
    # division in float64 in place: two passes over the weight where six temporaries took 1.5 s on ResNet-50
    s = np.abs(moved).reshape(moved.shape[0], -1).max(axis=1).astype(np.float64)
    rows = np.ascontiguousarray(moved, dtype=np.float64)
    s /= Q.W_MAX
    rows /= np.where(s > 0, s, 1.0).reshape((-1,) + (1,) * (rows.ndim - 1))
    return rows.reshape(-1, rows.shape[-1]).astype(np.float32)


def pair_cost_matrix(readers: list, block: int = 4096, native: bool | None = None) -> np.ndarray:
    """[C, C] cost of making channels i and j neighbours, over every reader weight (w, input axis):
    per output channel and tap, (|w_i + w_j| - 128)^2 for a same-sign pair past the limit, weights
    in steps of that output channel's max|w| / 127. A pair past 128 has a weight past 64: each such
    weight is charged with its partners no larger than itself, so every pair is counted once.
    `native`: the C loop (None: when built; ResNet-50's 37 components in 0.45 s of one core's time with
    AVX-512 or AVX2, 0.8 s portable, 29 s in numpy), else the numpy reference; both give the same bits."""
    use = _native is not None if native is None else native
    c = readers[0][0].shape[readers[0][1]]
    half = np.zeros((c, c))
    for w, axis in readers:
        v = _steps(w, axis)
        if use:
            _native.accumulate(np.ascontiguousarray(v), half, block, float(PAIR_LIMIT), THREADS or os.cpu_count() or 1)
        else:
            _accumulate_reference(v, half, block)
    return half + half.T


def _accumulate_reference(v: np.ndarray, half: np.ndarray, block: int) -> None:
    """numpy: each weight past the limit's half against its whole row, blocks of `block` of them."""
    for sign in (1.0, -1.0):
        a = np.maximum(sign * v, 0.0)
        r, i = np.nonzero(a > PAIR_LIMIT / 2)
        order = np.argsort(i, kind="stable")
        r, i = r[order], i[order]
        for b0 in range(0, len(i), block):
            rb, ib = r[b0:b0 + block], i[b0:b0 + block]
            own = a[rb, ib][:, None]
            part = a[rb]
            pen = np.maximum(part + (own - PAIR_LIMIT), 0.0)
            pen *= part <= own
            pen[np.arange(len(ib)), ib] = 0.0
            pen *= pen
            heads, starts = np.unique(ib, return_index=True)
            half[heads] += np.add.reduceat(pen, starts, axis=0)


def pairs_cost(cost: np.ndarray, order: np.ndarray) -> float:
    k = len(order) // 2 * 2
    return float(cost[order[0:k:2], order[1:k:2]].sum())


def greedy_pairing(cost: np.ndarray) -> np.ndarray:
    """A channel order whose neighbouring pairs (0,1), (2,3), ... cost little: the channel with the
    most at stake picks first, the partner that costs it least; with an odd count the channel with
    the most at stake goes last, where it pairs with padding."""
    c = len(cost)
    free = np.ones(c, bool)
    stake = cost.sum(axis=1)
    last = int(np.argmax(stake)) if c % 2 else None
    if last is not None:
        free[last] = False
    order = []
    for i in np.argsort(-stake, kind="stable"):
        if not free[i]:
            continue
        free[i] = False
        cand = np.nonzero(free)[0]
        j = int(cand[np.argmin(cost[i, cand])])
        free[j] = False
        order += [int(i), j]
    if last is not None:
        order.append(last)
    return np.array(order, np.int64)


def run(model: onnx.ModelProto, ctx) -> bool:
    inits = G.initializers(model)
    shapes = G.inferred_shapes(model)
    if not shapes:
        return False
    groups, poisoned = _components(model, shapes, inits)
    changed = False
    arrays = {}
    taken = None  # (graph.taken_names, made at the first new name)
    uses = {}  # tensor -> how many node inputs read it, kept up to date as readers are renamed
    for node in model.graph.node:
        for i in node.input:
            uses[i] = uses.get(i, 0) + 1

    def value(name):
        if name not in arrays:
            arrays[name] = G.const_value(model, name, inits)
        return arrays[name]

    for root, items in groups.items():
        readers = [(value(node.input[k]), axis) for node, k, axis, kind in items if kind == "reader"]
        if root in poisoned or not readers or not any(kind == "source" for *_, kind in items):
            continue
        cost = pair_cost_matrix(readers)
        order = greedy_pairing(cost)
        before, after = pairs_cost(cost, np.arange(len(cost))), pairs_cost(cost, order)
        if not after < before:
            continue
        done = {}
        for node, k, axis, _ in items:
            key = (node.input[k], axis)
            if key not in done:  # (a weight shared by two nodes of the component is reordered once)
                mine = sum(1 for n, j, a, _ in items if n.input[j] == key[0] and a == axis)
                # reordered in place, unless something outside this component reads it too
                if mine != uses[key[0]] and taken is None:
                    taken = G.taken_names(model)
                done[key] = key[0] if mine == uses[key[0]] else G.unique_name(model, key[0] + "_paired", taken)
                arrays[done[key]] = np.take(value(key[0]), order, axis=axis)
                G.set_initializer(model, done[key], arrays[done[key]], inits)
            uses[node.input[k]] -= 1
            uses[done[key]] = uses.get(done[key], 0) + 1
            node.input[k] = done[key]
        changed = True
        ctx.log("pair_channels", f"{len(cost)} channels reordered for {len(readers)} reader(s): "
                                 f"cost of same-sign pairs past {PAIR_LIMIT} {before:.0f} -> {after:.0f}")
    if changed:
        G.remove_unused_initializers(model)
    return changed
