"""Fold BatchNormalization into the Conv, ConvTranspose or Gemm before it.

Before: Conv(x, W, b) -> BatchNormalization(gamma, beta, mean, var, eps)
After:  Conv(x, W', b')   with  k = gamma / sqrt(var + eps),
        W' = W * k  (per output channel),  b' = (b - mean) * k + beta

Preconditions: the Conv/Gemm output feeds only the BatchNormalization, all weights and
BN statistics are constants, BN is in inference mode. For Gemm, the BN channel is the
output feature (axis 1), so W's output axis is 0 with transB=1 and 1 otherwise; ConvTranspose's W is
[Cin, Cout / group, k...] (a decoder's upsampling, BatchNormalization after it: U-Nets, DB text heads).
"""
from __future__ import annotations

import numpy as np
import onnx

from qtool import graph as G

FOLDS_INTO = ("Conv", "ConvTranspose", "Gemm")  # ops whose weights take a per-output-channel scale and shift


def fold_scale_shift(model, node, inits, k: np.ndarray, shift: np.ndarray, taken: set | None = None) -> bool:
    """W' = W * k along the output-channel axis, b' = b * k + shift. Shared with fold_mul_add. `inits`
    (graph.initializers) gets the new weights; `taken` (graph.taken_names), if given, their names."""
    w = G.const_value(model, node.input[1], inits)
    if w is None:
        return False
    cout_axis, group = 0, 1
    if node.op_type == "Gemm":
        if G.attr(node, "transA", 0) or G.attr(node, "alpha", 1.0) != 1.0 or G.attr(node, "beta", 1.0) != 1.0:
            return False
        cout_axis = 0 if G.attr(node, "transB", 0) else 1
    elif node.op_type == "ConvTranspose":
        # W is [Cin, Cout / group, k...]: output channel g * Cout / group + j comes from W[rows of group g, j]
        group, cout_axis = G.attr(node, "group", 1), 1
        if w.ndim < 3 or w.shape[0] % group:
            return False
    cout = w.shape[cout_axis] * group
    k = np.broadcast_to(np.asarray(k, np.float64).ravel(), (cout,)) if np.size(k) in (1, cout) else None
    shift = np.broadcast_to(np.asarray(shift, np.float64).ravel(), (cout,)) if np.size(shift) in (1, cout) else None
    if k is None or shift is None:
        return False
    b = G.const_value(model, node.input[2], inits) if len(node.input) > 2 and node.input[2] else np.zeros(cout)
    if b is None or b.size != cout:
        return False
    if node.op_type == "ConvTranspose":
        per_group = w.astype(np.float64).reshape((group, w.shape[0] // group) + w.shape[1:])
        k_groups = k.reshape((group, 1, w.shape[1]) + (1,) * (w.ndim - 2))
        w_new = (per_group * k_groups).reshape(w.shape).astype(w.dtype)
    else:
        shape = [1] * w.ndim
        shape[cout_axis] = cout
        w_new = (w.astype(np.float64) * k.reshape(shape)).astype(w.dtype)
    b_new = (b.astype(np.float64).ravel() * k + shift).astype(w.dtype)
    wname = G.unique_name(model, node.input[1] + "_folded", taken)
    bname = G.unique_name(model, (node.input[2] if len(node.input) > 2 and node.input[2] else node.input[1])
                          + "_bias_folded", taken)
    G.set_initializer(model, wname, w_new, inits)
    G.set_initializer(model, bname, b_new, inits)
    node.input[1] = wname
    if len(node.input) > 2:
        node.input[2] = bname
    else:
        node.input.append(bname)
    return True


def run(model: onnx.ModelProto, ctx) -> bool:
    """One walk: the indexes are made once (what each fold adds goes into them) and the folded nodes are
    dropped together at the end; made again per fold, a chain of 1,000 Conv + BatchNormalization took
    seconds, 10,000 over a minute. (`prod` is the walk's start: a BatchNormalization after one folded here
    folds on the next round, as before.)"""
    inits = G.initializers(model)
    prod, cons = G.producers(model), G.consumers(model)
    outputs = G.graph_output_names(model)
    taken = G.taken_names(model)
    gone = set()
    changed = False
    nodes = list(model.graph.node)
    for at, bn in enumerate(nodes):
        if bn.op_type != "BatchNormalization" or G.attr(bn, "training_mode", 0):
            continue
        if len([o for o in bn.output if o]) != 1:
            continue
        src = prod.get(bn.input[0])
        if src is None or src.op_type not in FOLDS_INTO or len(cons.get(bn.input[0], [])) != 1:
            continue
        if bn.input[0] in outputs:
            continue
        stats = [G.const_value(model, n, inits) for n in bn.input[1:5]]
        if any(s is None for s in stats):
            continue
        gamma, beta, mean, var = (s.astype(np.float64) for s in stats)
        k = gamma / np.sqrt(var + G.attr(bn, "epsilon", 1e-5))
        if not fold_scale_shift(model, src, inits, k, beta - mean * k, taken):
            continue
        src.output[0] = bn.output[0]
        gone.add(at)
        changed = True
        ctx.log("fold_batchnorm", f"BatchNormalization {bn.name or bn.output[0]} folded into {src.op_type} {src.name}")
    if changed:
        G.drop_nodes(model, nodes, gone)
        G.remove_unused_initializers(model)
    return changed
