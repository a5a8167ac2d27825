"""Outlier channels moved from a dynamically quantized input into the layer's weights (SmoothQuant).

A transformer's LayerNorm and GELU outputs carry a few channels 10-100x wider than the median
(all-mpnet-base-v2: max/median 46-138 on the FFN inputs). Quantized per tensor at run time
(DynamicQuantizeLinear, dynamic.py), those channels set the scale and the rest get a few steps
of the 256: the FFN's first MatMul measured 22-27 dB where its int8 weights hold 39. The layer
computes the same with its input divided by s per channel and its weight's rows multiplied by s,

    x @ W = (x / s) @ (diag(s) W),    s_j = max|x_j|^a / max_k |W_jk|^(1 - a)

and with a in (0, 1) the input's channels come closer together while the weights' rows (each
output channel has its own int8 scale) take on some of the spread. `a` is chosen per input tensor by
measurement, as the dynamic input is: the error each candidate leaves in the layers' outputs, the
input quantized with each run's own range and the weights per output channel, against a = 0
(unchanged); a tensor moves where that gains at least MIN_GAIN_DB. All the dynamic layers that read
one tensor (an attention block's q, k and v) share its s, each with its own weight rows scaled.

Where the tensor's producer is a Mul by a per-channel constant that only these layers read after, 1/s
goes into that constant; otherwise a Mul by 1/s is added before the layers (the tensor's other readers,
a residual Add, still read it unscaled). Never into a one-element constant: a scalar is part of a pattern
runtimes fuse, the erf GELU's closing 0.5 (ONNX Runtime makes Div, Erf, Add, Mul, Mul and the bias Add
before them one BiasGelu, and qtool's runtime one GeluStep, only with scalars); made a vector, it left
the zoo MiniLM's first FFN as six nodes where the others ran one and a Mul. The calibration table gets the
scaled tensor's range, so that a static input, should the layer fall back to one, is still right.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from qtool import graph as G
from qtool import qparams as Q
from qtool.quantize.encoding import PAIR_SAFE, TARGETS, W_MAX_OF, pair_partners
from qtool.quantize.weights import WeightLayer, WeightRounding, quantize_weight

ALPHAS = (0.5, 0.75)  # the migration strengths tried (0: the input as it is)
MIN_GAIN_DB = 1.0  # a tensor moves where its layers' outputs gain this much
SPREAD_MIN = 4.0  # widest channel within this ratio of the median: nothing to move
S_FLOOR = 1e-5  # a dead channel's (or a zero weight row's) max, relative to the widest: s stays finite


@dataclass(frozen=True)
class Migration:
    tensor: str  # the fp32 input the layers quantize at run time
    layers: tuple  # the dynamic MatMuls reading it
    alpha: float  # 0: not moved
    sqnr_db: dict  # alpha -> the layers' output SQNR (dB) with the input and weights so quantized
    spread: float  # widest channel's max over the median channel's
    scale: np.ndarray | None = None  # s per channel (None: not moved)

    def to_dict(self) -> dict:
        return {"layers": list(self.layers), "alpha": self.alpha, "channel_spread": round(self.spread, 1),
                "layer_sqnr_db": {str(a): round(v, 2) for a, v in self.sqnr_db.items()}}


def _factors(cmax: np.ndarray, wmax: np.ndarray, alpha: float) -> np.ndarray:
    c = np.maximum(cmax, S_FLOOR * max(float(cmax.max()), 1e-30))
    w = np.maximum(wmax, S_FLOOR * max(float(wmax.max()), 1e-30))
    s = c ** alpha / w ** (1.0 - alpha)
    return s / np.exp(np.log(s).mean())  # (the overall size is free: each run's range takes it)


def _weights_q(w: np.ndarray, encoding: str) -> np.ndarray:
    """w [K, N] as the target encodes it (per output channel: pair-safe, 7-bit or plain int8), dequantized."""
    partners = pair_partners(w.shape, "MatMul", 1) if encoding == PAIR_SAFE else None
    how = WeightRounding(correct_bias=False, partners=partners, w_max=W_MAX_OF.get(encoding, Q.W_MAX))
    qw = quantize_weight(WeightLayer(w, 1, None, None, "MatMul"), how)
    return Q.dequantize_weight(qw.q, qw.scale, axis=1)


def _dynamic_q(x: np.ndarray) -> np.ndarray:
    return Q.fake_quantize(x, Q.activation_qparams(float(x.min()), float(x.max())))


def groups(ctx) -> dict:
    """input tensor -> (its dynamic MatMul layers, each one's fp32 weight [K, N]), as ctx builds the model."""
    plan = ctx.build().plan
    nodes = {n.name: n for n in ctx.fused.graph.node}
    inits = G.initializers(ctx.fused)
    out = {}
    for layer, x in sorted(plan.dynamic.items()):
        w = G.const_value(ctx.fused, nodes[layer].input[1], inits)
        if w is not None and w.ndim == 2:
            out.setdefault(x, []).append((layer, w.astype(np.float32)))
    return out


def measure(ctx, samples, threads: int = 0) -> list:
    """Migration per input tensor of the dynamic layers, measured on `samples` one sample a run: each
    channel's max over them, then each a's output error summed over the tensor's layers."""
    from qtool.ortsession import session, with_outputs

    found = groups(ctx)
    if not found or not len(samples):
        return []
    names = sorted(found)
    sess = session(with_outputs(ctx.fused, names), threads)
    cmax, acts = {}, {x: [] for x in names}  # (float16: MPNet's 48 tensors of 8 samples take 130 MB)
    for feed in samples.single_feeds():
        for x, v in zip(names, sess.run(names, feed)):
            v = np.asarray(v, np.float32).reshape(-1, v.shape[-1])
            cmax[x] = np.maximum(cmax.get(x, 0.0), np.abs(v).max(0))
            acts[x].append(v.astype(np.float16))
    scales, sums = {}, {}
    for x, layers in found.items():
        wmax = np.max([np.abs(w).max(1) for _, w in layers], 0)
        c = np.asarray(cmax[x], np.float64)
        scales[x] = {0.0: None, **{a: _factors(c, wmax, a).astype(np.float32) for a in ALPHAS}}
        sums[x] = {a: np.zeros(2) for a in scales[x]}
        for layer, w in layers:
            enc = ctx.encodings.get(layer, TARGETS[ctx.target].encoding)
            wqs = {a: _weights_q(w if s is None else w * s[:, None], enc) for a, s in scales[x].items()}
            for v in acts[x]:
                v = v.astype(np.float32)
                y = v @ w  # (the fp32 output, once per sample: every a is judged against it)
                signal = float((y.astype(np.float64) ** 2).sum())
                for a, s in scales[x].items():
                    xq = _dynamic_q(v if s is None else v / s)
                    sums[x][a] += (signal, float(((xq @ wqs[a] - y).astype(np.float64) ** 2).sum()))
        del acts[x]
    out = []
    for x in names:
        db = {a: 10.0 * np.log10(max(sig, 1e-30) / max(noise, 1e-30)) for a, (sig, noise) in sums[x].items()}
        best = max(db, key=lambda a: (db[a], -a))
        c = np.asarray(cmax[x], np.float64)
        spread = float(c.max() / max(float(np.median(c)), 1e-30))
        moves = best > 0 and db[best] >= db[0.0] + MIN_GAIN_DB and spread >= SPREAD_MIN
        out.append(Migration(x, tuple(layer for layer, _ in found[x]), best if moves else 0.0, db, spread,
                             scales[x][best] if moves else None))
    return out


def _foldable(m: onnx.ModelProto, x: str, layers: set, prods: dict, cons: dict, inits: dict, width: int):
    """The constant input of x's producer, where x's producer is a Mul by a constant of more than one
    element, broadcastable over x's last axis, and only `layers` read x; else None."""
    p = prods.get(x)
    if p is None or p.op_type != "Mul" or {c.name for c in cons.get(x, [])} != layers or x in G.graph_output_names(m):
        return None
    for name in p.input:
        c = inits.get(name)
        if c is not None and len(cons.get(name, [])) == 1:
            shape = tuple(c.dims)
            if int(np.prod(shape)) > 1 and shape[-1] == width:
                return name
    return None


def apply(fused: onnx.ModelProto, table, moves: list) -> tuple:
    """(the graph with each moved tensor's layers reading it divided by s and their weights' rows times s,
    the table with the scaled tensors' ranges); the arguments are not changed. -> (model, table, {tensor: how})."""
    m = onnx.ModelProto()
    m.CopyFrom(fused)
    table = copy.copy(table)
    table.ranges = {k: dict(v) for k, v in table.ranges.items()}
    how = {}
    for mv in moves:
        prods, cons, inits = G.producers(m), G.consumers(m), G.initializers(m)
        nodes = {n.name: n for n in m.graph.node}
        s = mv.scale.astype(np.float64)
        const = _foldable(m, mv.tensor, set(mv.layers), prods, cons, inits, len(s))
        if const is not None:
            G.set_initializer(m, const, (G.const_value(m, const, inits).astype(np.float64) / s).astype(np.float32))
            into, how[mv.tensor] = mv.tensor, f"into {prods[mv.tensor].name}'s constant"
        else:
            into = G.unique_name(m, mv.tensor + "_smoothed")
            k = G.unique_name(m, mv.tensor + "_smoothing")
            G.set_initializer(m, k, (1.0 / s).astype(np.float32))
            m.graph.node.append(helper.make_node("Mul", [mv.tensor, k], [into], name=into))
            for layer in mv.layers:
                G.rename_reads(nodes[layer], mv.tensor, into)
            how[mv.tensor] = f"a Mul by 1/s ({into})"
        for layer in mv.layers:
            node = nodes[layer]
            w = G.const_value(m, node.input[1], inits).astype(np.float64) * s[:, None]
            # (a name of its own: another node may read the weight too, and what is cached of a weight,
            # its pair-safe scales, is cached by its name)
            node.input[1] = G.unique_name(m, node.input[1] + "_smoothed")
            G.set_initializer(m, node.input[1], w.astype(np.float32))
        _scaled_ranges(table, mv.tensor, into, s)
    G.toposort(m)
    return m, table, how


def _scaled_ranges(table, src: str, into: str, s: np.ndarray) -> None:
    """`into` holds src / s per channel: each method's range widened to what the scaling can reach
    (the table has no per-channel range of a token tensor: each end divided by the smallest s)."""
    lo_s, hi_s = float(s.min()), float(s.max())
    for ranges in table.ranges.values():
        r = ranges.get(src)
        if r is not None:
            ranges[into] = [min(r[0] / lo_s, r[0] / hi_s, 0.0), max(r[1] / lo_s, r[1] / hi_s, 0.0)]
