"""Layers whose input is quantized at run time, chosen per layer by measurement.

Static ranges are qtool's default: one scale per tensor, fixed at calibration, the fastest at run time.
A transformer's weight MatMuls read tensors no static range holds well: LayerNorm outputs with a few
outlier channels and a scale that changes from sentence to sentence. For those, the input is better
quantized per run (DynamicQuantizeLinear: uint8, the tensor's own min and max widened to 0, as ONNX
Runtime's quantize_dynamic does).

The choice is a measurement on calibration samples, per layer: the layer's fp32 input x is rounded
with the static range the build uses and with the range of each run, and the error each leaves in the
layer's output, (round(x) - x) @ W, is compared (as SQNR against x @ W). A layer *needs* a dynamic
input where that gains at least GAIN_DB: one bit of the eight (never where the static range is exact:
a one-hot input). The step (steps/dynamic_inputs.py) then measures the model's output with the layers
that need it, with every layer that gains at all, and with every candidate dynamic, and keeps the best
where the model's output gains GAIN_DB over all static, as a layer must (a ViT's inputs are each held as
well by a static range, yet with its layers dynamic the static pairs that only round between fp32 ops go
too: plan._drop_dynamic_only; 17 -> 27 dB; an FSMN voice detector's gain of 2.4 dB stays static). A
convolution network's head, whose range is merely a little loose, needs none and gains nothing like
that: its model does not change. Only MatMuls with
a 2-D weight and no bias are candidates (a Gemm's bias is int32 at the static input scale); an input
clamped by a fused Relu/Clip or on an input's lattice (lattice.py) keeps its static pair, exact where
dynamic would not be.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool import graph as G
from qtool import qparams as Q

GAIN_DB = 6.0


@dataclass(frozen=True)
class DynamicChoice:
    layer: str
    input: str
    static_sqnr_db: float  # the layer's output, its input rounded at the static range
    dynamic_sqnr_db: float  # ... at each run's own range
    dynamic: bool  # needs it: gains at least GAIN_DB over a static range that is not exact

    @property
    def gains(self) -> bool:
        """Whether each run's range measures better at all (a static range that is exact never loses)."""
        return bool(np.isfinite(self.static_sqnr_db) and self.dynamic_sqnr_db > self.static_sqnr_db)

    def to_dict(self) -> dict:
        def db(v):  # (None: exact, no error at all)
            return round(v, 2) if np.isfinite(v) else None
        return {"input": self.input, "static_sqnr_db": db(self.static_sqnr_db),
                "dynamic_sqnr_db": db(self.dynamic_sqnr_db), "needs_dynamic": self.dynamic,
                "dynamic": False}  # (the step sets what it chose)


def candidates(ctx) -> dict:
    """layer -> (input tensor, its static ActQParams, fp32 weight [K, N]) of the int8 MatMuls whose
    input could be quantized at run time, as ctx builds the model now (every input static)."""
    out = ctx.build(dynamic=frozenset())
    plan, qp = out.plan, out.qparams
    lattices = set(getattr(ctx.table, "lattices", None) or ())
    nodes = {n.name: n for n in ctx.fused.graph.node}
    inits = G.initializers(ctx.fused)
    found = {}
    for name, x in sorted(plan.weight_inputs.items()):
        node = nodes.get(name)
        if node is None or node.op_type != "MatMul" or x not in qp or x in plan.clamp or x in lattices:
            continue
        w = G.const_value(ctx.fused, node.input[1], inits)
        if w is None or w.ndim != 2:
            continue
        found[name] = (x, qp[x], w.astype(np.float32))
    return found


def _sqnr_db(signal: float, noise: float) -> float:
    if noise <= 0.0:
        return float("inf")
    return 10.0 * np.log10(max(signal, 1e-30) / noise)


def measure(ctx, samples, threads: int = 0) -> list:
    """DynamicChoice per candidate layer (candidates), measured on `samples` (a SampleSet) one sample a run:
    a run-time range is each sample's own (a user's single request), never a batch's; in layer-name order."""
    from qtool.ortsession import session, with_outputs

    cands = candidates(ctx)
    if not cands or not len(samples):
        return []
    names = sorted({x for x, _, _ in cands.values()})
    sess = session(with_outputs(ctx.fused, names), threads)
    sums = {layer: np.zeros(3) for layer in cands}  # signal, static noise, dynamic noise
    for feed in samples.single_feeds():
        got = dict(zip(names, sess.run(names, feed)))
        for layer, (x_name, qp, w) in cands.items():
            x = np.asarray(got[x_name], np.float32).reshape(-1, w.shape[0])
            if not x.size:
                continue
            run_qp = Q.activation_qparams(float(x.min()), float(x.max()))
            y = x.astype(np.float64) @ w
            es = (Q.fake_quantize(x, qp) - x).astype(np.float64) @ w
            ed = (Q.fake_quantize(x, run_qp) - x).astype(np.float64) @ w
            sums[layer] += ((y ** 2).sum(), (es ** 2).sum(), (ed ** 2).sum())
    choices = []
    for layer, (x_name, _, _) in sorted(cands.items()):
        sig, ns, nd = sums[layer]
        s_db, d_db = _sqnr_db(sig, ns), _sqnr_db(sig, nd)
        choices.append(DynamicChoice(layer, x_name, s_db, d_db, bool(np.isfinite(s_db) and d_db >= s_db + GAIN_DB)))
    return choices

