"""How many calibration samples each optional step of `quantize` can afford.

A step costs about (fp32 passes per sample it takes) x (its samples) x (the cost of one fp32 pass:
the work of the model counted at the samples' shapes, at a nominal rate). Most models run every step
on its default samples. A heavy one gets fewer, down to the step's least useful number, and a step
whose least number alone would run past MAX_STEP_SECONDS is skipped, and the run says so. Measured on
the zoo (2 cores): a 1280x1280 YOLO (0.45 s a pass, 322 layers) keeps every step on fewer samples; a
960x1280 CRAFT U-Net (11.5 s a pass, 437 GMAC) keeps method choice on one sample and skips
sensitivity and output-aware rounding, which would take minutes each.

The work is counted, never timed: the same model and samples give every step the same samples, and
so the same int8 model, whatever else the machine is doing. (A timed fp32 pass, the fallback where the
MACs could not be counted, gave PP-OCRv4's recognizer 22 samples in one run and 32 in the next: three
runs, three models.) Where the graph's work cannot be counted (a Loop or an If, whose trip count or
branch follows the data; a shape neither inference nor one fp32 run of one sample gives), every step
takes a fixed number of samples: its default.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool import graph as G

STEP_SECONDS = 45.0  # what one optional step aims to take
MAX_STEP_SECONDS = 120.0  # a step whose least useful number of samples takes longer is skipped

# fp32 passes per sample, per step (measured ratios, rounded up)
METHOD_CHOICE_PASSES = 1.0  # per range method: one int8 pass of the whole model
SENSITIVITY_PASSES = 0.4  # per layer: a layer re-runs the model from the last cut before it (0.3-0.6 measured)
ROUNDING_PASSES = 1.5  # per group of layer inputs fetched: the pass and the covariance products
TARGET_COST_PASSES = 2.0  # the model and its plain int8 twin


# what one fp32 pass is taken to cost, for a model whose multiply-accumulates can be counted: 30 GMAC/s,
# as ONNX Runtime runs convolutions on 2 cores of an AVX2 machine (CRAFT: 437 GMAC in 11.5 s, YOLO26n at
# 1280x1280 ...). Counted, not timed, so that the same model and data give the same int8 model whatever
# else the machine is doing (timed, the samples a step got moved with the load: a detector balanced one
# tensor in one run and two in the next)
NOMINAL_MACS_PER_SECOND = 30e9


# the work of an op that is not a product of weights and activations, in multiply-accumulates per element
# it writes (memory-bound ops move an element about as fast as a convolution does a few MACs; a
# transcendental takes several): small beside a network's products, and the whole pass where there are none
ELEMENT_COST = {"Exp": 4, "Log": 4, "Tanh": 4, "Sigmoid": 4, "Erf": 4, "Softmax": 6, "LogSoftmax": 6,
                "LayerNormalization": 6, "HardSwish": 2, "HardSigmoid": 2, "Resize": 2, "Pow": 4, "Sqrt": 2,
                "InstanceNormalization": 6, "GroupNormalization": 6, "ReduceMean": 1, "ReduceSum": 1}
FREE = {"Shape", "Constant", "ConstantOfShape", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Size"}
SUBGRAPH_OPS = ("If", "Loop", "Scan")  # their work follows the data (a trip count, a branch): not counted
PRODUCTS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "LSTM", "GRU", "RNN")  # where the work of a pass is


def _numel(dims) -> int | None:
    if dims is None or any(not isinstance(d, int) or d <= 0 for d in dims):
        return None
    return int(np.prod(dims, dtype=np.int64))


def node_work(n, known: dict) -> int | None:
    """Multiply-accumulates of node n from the tensor shapes in `known` (name -> dims); None where a
    shape it needs is unknown. Products of weights: Conv, ConvTranspose, Gemm, MatMul, LSTM, GRU, RNN;
    any other op: ELEMENT_COST per element written (1 where not listed; 0 for shape-only ops)."""
    op = n.op_type
    out = known.get(n.output[0]) if n.output and n.output[0] else None
    w = known.get(n.input[1]) if len(n.input) > 1 else None
    if op == "Conv":  # every output value: Cin/group * kh * kw products
        o, k = _numel(out), _numel(w[1:]) if w else None
        return None if o is None or k is None else o * k
    if op == "ConvTranspose":  # every input value: Cout/group * kh * kw products
        i, k = _numel(known.get(n.input[0])), _numel(w[1:]) if w else None
        return None if i is None or k is None else i * k
    if op == "Gemm":
        o = _numel(out)
        if o is None or not w or _numel(w) is None:
            return None
        return o * (w[1] if G.attr(n, "transB", 0) else w[0])
    if op == "MatMul":
        o, a = _numel(out), known.get(n.input[0])
        k = a[-1] if a and isinstance(a[-1], int) and a[-1] > 0 else (w[-2] if w and len(w) >= 2 else None)
        return None if o is None or not isinstance(k, int) or k <= 0 else o * k
    if op in ("LSTM", "GRU", "RNN"):  # per step and direction: gates x hidden x (input + hidden)
        x, r = known.get(n.input[0]), known.get(n.input[2]) if len(n.input) > 2 else None
        if _numel(x) is None or not w or _numel(w) is None or not r or _numel(r) is None:
            return None
        steps = x[0] * x[1]  # (sequence x batch, whichever the layout)
        return steps * w[0] * w[1] * (w[2] + r[2])
    if op in FREE:
        return 0
    o = _numel(out)
    return None if o is None else ELEMENT_COST.get(op, 1) * o


def counted_work(fused, shapes: dict, feed: dict | None = None) -> int | None:
    """The multiply-accumulates of one fp32 pass of `fused` for inputs of `shapes` (input name -> dims),
    every node counted (node_work), from shape inference at those shapes; where inference leaves a
    product's shape unknown (a batch dim lost through a Reshape built from Shape ops: MiniLM's
    attention), from one fp32 run of `feed` (one sample) in ONNX Runtime, which has every shape.
    None where the work cannot be counted: a Loop, If or Scan, or a shape neither gives."""
    if any(n.op_type in SUBGRAPH_OPS and _holds_products(n) for n in fused.graph.node):
        return None  # (an If without products, a LayerNorm's epsilon chosen by a flag, counts nothing)
    known = {t.name: list(t.dims) for t in fused.graph.initializer}
    known.update({k: list(v) for k, v in shapes.items()})
    for t, dims in G.inferred_shapes(fused, shapes).items():
        if t not in known or _numel(known[t]) is None:
            known[t] = dims
    def unknown():
        return [n for n in fused.graph.node if n.op_type in PRODUCTS and node_work(n, known) is None]
    if unknown() and feed:
        missing = {t for n in unknown() for t in list(n.input[:1]) + list(n.output[:1])
                   if t and _numel(known.get(t)) is None}
        known.update(_run_shapes(fused, sorted(missing), feed))
    if unknown():
        return None
    # (an op beside the products whose shape is still unknown, a few int64 shape sums, counts nothing)
    each = [node_work(n, known) for n in fused.graph.node]
    return int(sum(w for w in each if w))


def _holds_products(node) -> bool:
    """Whether a product (PRODUCTS) sits in node's subgraphs, at any depth."""
    return G.holds_op(G._subgraphs(node), PRODUCTS)


def _run_shapes(fused, names: list, feed: dict) -> dict:
    """name -> dims of `names`, from one run of `feed` in ONNX Runtime ({} where it fails)."""
    from qtool.ortsession import session, with_outputs
    inputs = {i.name for i in fused.graph.input}
    fetch = [t for t in names if t not in inputs]
    if not fetch:
        return {}
    try:
        ys = session(with_outputs(fused, fetch), 1, where="counting the work of one pass").run(fetch, feed)
    except Exception:  # (counting is best effort: uncounted work takes the fixed samples)
        return {}
    return {t: list(np.shape(y)) for t, y in zip(fetch, ys)}


def _work_at(fused, samples, i: int) -> int | None:
    """counted_work of one fp32 pass at sample i's input sizes."""
    one = samples.feed(i, i + 1)
    shapes = {k: (1,) + tuple(v.shape[1:]) if not samples.stacked else tuple(v.shape) for k, v in one.items()
              if hasattr(v, "shape")}
    return counted_work(fused, shapes, one) if one else None


@dataclass
class Budget:
    seconds_per_sample: float  # one fp32 pass of one calibration sample, at NOMINAL_MACS_PER_SECOND (0: not counted)
    macs_per_sample: int | None = None  # the work counted (None: it could not be: every step takes its fixed samples)

    @property
    def basis(self) -> str:
        return "counted" if self.macs_per_sample is not None else "fixed"

    @classmethod
    def of(cls, fused, samples) -> "Budget":
        """From the model's work counted at the samples' shapes (counted_work, NOMINAL_MACS_PER_SECOND);
        where it cannot be counted, no cost: every step takes its default (fixed) number of samples.
        Never from a clock: samples.seconds_per_sample is reported, not used."""
        if not len(samples):
            return cls(0.0, None)
        # samples of several sizes: the mean over them, each size counted once
        each = samples.sizes or [None]
        firsts = {key: i for i, key in reversed(list(enumerate(each)))}
        work = {key: _work_at(fused, samples, i) for key, i in firsts.items()}
        if any(w is None for w in work.values()):
            return cls(0.0, None)
        macs = int(round(sum(work[key] for key in each) / len(each)))
        return cls(macs / NOMINAL_MACS_PER_SECOND if macs else 0.0, macs)

    def to_dict(self) -> dict:
        return {"basis": self.basis, "gmac_per_sample": None if self.macs_per_sample is None
                else round(self.macs_per_sample / 1e9, 6), "nominal_seconds_per_sample": self.seconds_per_sample}

    def samples(self, passes: float, wanted: int, least: int = 1) -> int:
        """Samples (at most `wanted`) a step of `passes` fp32 passes per sample can take within
        STEP_SECONDS; at least `least` where those fit MAX_STEP_SECONDS, else 0 (skip the step).
        Uncounted work: `wanted`, the step's fixed default."""
        cost = passes * self.seconds_per_sample
        if wanted <= 0 or cost <= 0:
            return max(wanted, 0)
        n = min(wanted, int(STEP_SECONDS // cost))
        if n >= least:
            return n
        return min(least, wanted) if min(least, wanted) * cost <= MAX_STEP_SECONDS else 0

    def seconds(self, passes: float, samples: int) -> float:
        return passes * self.seconds_per_sample * samples
