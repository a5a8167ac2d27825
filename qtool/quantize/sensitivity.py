"""Per-layer sensitivity: how much the model output suffers when only one layer is int8.

A layer is a compute op that quantize makes int8 (Conv, Gemm, Add, pooling, ...) with its
input and output quantizers. For each, the model is run with that layer alone in int8
(every other layer fp32) on a sample of calibration images, and compared with fp32:
output SQNR, top-1 agreement and KL divergence of the softmax. The weight SQNR and the
fraction of the layer's values that calibration clipped come from the quantizer and the
histograms. The ranking (lowest output SQNR first) drives --exclude-sensitive.

Where the output is a distribution over its last axis (samples.distribution_output: a CTC
recognizer's [N, T, C], a tagger's), agreement and KL are per position, and the ranking is by KL
(highest first): SQNR of probabilities is set by the few positions whose winner flips, so on
PP-OCRv5's recognizer 11 of 73 layers tied at 16.2 dB and the order among them was arbitrary.
Where the output is an encoder's (encoder_judge.py), each layer is measured on the sentence vectors the
output is read as, as the guard's whole-model check and the steps before it are: all-mpnet-base-v2's raw
token states, whose few massive channels carry most of their energy, ranked four FFN output MatMuls
"alone below 10 dB" and the guard kept them fp32 (a file 0.32 of fp32 instead of 0.25).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import onnx

from qtool.metrics import kl_each, kl_softmax, position_top1_agreement, sqnr_db, top1_agreement
from qtool.quantize.context import QuantizeContext
from qtool.quantize.encoder_judge import encoder_judge
from qtool.plan import make_plan
from qtool.quantize.samples import SampleSet, distribution_output
from qtool.quantize.simulate import Simulator


@dataclass
class LayerSensitivity:
    name: str
    op_type: str
    order: int  # position in graph order
    output_sqnr_db: float
    top1_agreement: float
    kl: float
    weight_sqnr_db: float | None
    clip_fraction: float  # of the layer's output values, outside the quantization range
    rank: int = 0  # 1 = most sensitive

    def to_dict(self):
        return asdict(self)


def clip_fraction(table, tensor: str, lo: float, hi: float) -> float:
    if tensor not in table.histograms:
        return 0.0
    h = table.histogram(tensor)
    if h.n == 0:
        return 0.0
    e = h.edges()
    # whole bins beyond the range: a value exactly at a clamp (ReLU6's 6) is not clipped
    outside = h.counts[(e[1:] <= lo) | (e[:-1] > hi)].sum()
    return float(outside / h.n)


def quantizable_layers(fused: onnx.ModelProto) -> list:
    plan = make_plan(fused)
    return [d for d in plan.decisions if d.status == "int8"]


def layer_exclusions(sim: Simulator, only=None) -> tuple:
    """([(position, decision)] of the layers measured, for each the exclusions that leave it alone in
    int8: what its variant simulates, and what its whole QDQ model, ctx.build(those, prune_excluded=
    False), is)."""
    layers = quantizable_layers(sim.ctx.fused)
    names = [d.name for d in layers]
    wanted = set(names if only is None else only)
    picked = [(k, d) for k, d in enumerate(layers) if d.name in wanted]
    # pass-through ops go too: one reading the graph input (YOLOX's Focus slices) would otherwise stay
    # int8 in every variant, adding its input's quantization to every layer's figure and making every
    # variant start at the input
    # and ops the whole plan leaves fp32 only because their output stays fp32 (a final Sigmoid): they
    # would be int8 again in a variant that keeps each layer's own output quantizer
    others = set(names) | sim.plan.int8_nodes | sim.plan.float_ended
    return picked, [{n: "sensitivity: only one layer int8" for n in others if n != d.name} for _, d in picked]


def layer_variants(sim: Simulator, only=None) -> tuple:
    """([(position, decision)] of the layers measured, the Variant of each: that layer alone int8)."""
    picked, exclusions = layer_exclusions(sim, only)
    return picked, [sim.variant(e, prune_excluded=False) for e in exclusions]


def layer_sensitivity(ctx: QuantizeContext, samples: SampleSet, progress=None, only=None) -> list:
    """Sensitivity of every int8 layer on `samples`, with the context's settings (target, tuned
    ranges, output-aware rounding) for the one layer quantized. Each layer's model is simulated
    from the last cut before it (simulate.py): only the part of the network after it re-runs.
    `only` (layer names): measure just these, each still alone in int8 among all the others."""
    sim = Simulator(ctx, samples.output)
    picked, variants = layer_variants(sim, only)
    ref = samples.reference
    dist = distribution_output(ctx.fused, samples)
    enc = None if dist else encoder_judge(ctx.fused, samples, ctx.task)

    def measured(y):  # (each variant's output reduced as soon as it is there: outputs can be large)
        if dist:  # what each position means is its class
            return (sqnr_db(ref, y), position_top1_agreement(ref, y),
                    float(kl_each(ref, y, log=dist == "LogSoftmax").mean()))
        if enc is not None:  # sentence vectors: no class, no distribution
            v = enc.vectors(y)
            return sqnr_db(enc.reference, v), top1_agreement(enc.reference, v), 0.0
        return sqnr_db(ref, y), top1_agreement(ref, y), kl_softmax(ref, y) if y.ndim == 2 else 0.0

    out = []
    for (k, d), v, m in zip(picked, variants, sim.run(samples, variants, progress, reduce=measured)):
        t = sim.output_tensor(d.name)
        qp = v.tensors.get(t)
        clip = clip_fraction(ctx.table, t, qp.lo, qp.hi) if qp else 0.0
        out.append(LayerSensitivity(d.name, d.op_type, k, *m, sim.weight_sqnr(d.name), clip))
    worst_first = (lambda s: (-s.kl, s.output_sqnr_db)) if dist else (lambda s: (s.output_sqnr_db, -s.kl))
    for r, s in enumerate(sorted(out, key=worst_first), 1):
        s.rank = r
    return out
