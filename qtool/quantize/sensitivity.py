"""Per-layer sensitivity: how much the model output suffers when only one layer is int8.

A layer is a compute op that quantize makes int8 (Conv, Gemm, Add, pooling, ...) with its
input and output quantizers. For each, the model is run with that layer alone in int8
(every other layer fp32) on a sample of calibration images, and compared with fp32:
output SQNR, top-1 agreement and KL divergence of the softmax. The weight SQNR and the
fraction of the layer's values that calibration clipped come from the quantizer and the
histograms. The ranking (lowest output SQNR first) drives --exclude-sensitive.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import onnx

from qtool.calibrate.collect import session
from qtool.metrics import kl_softmax, sqnr_db, top1_agreement
from qtool.quantize.plan import make_plan
from qtool.quantize.qdq import quantize_graph


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


def run_first_output(model: onnx.ModelProto | str, feeds: list, threads: int = 0) -> np.ndarray:
    s = session(model, threads)
    name = s.get_outputs()[0].name
    return np.concatenate([s.run([name], f)[0] for f in feeds])


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


def layer_sensitivity(fused: onnx.ModelProto, table, method: str, feeds: list, reference: np.ndarray | None = None,
                      progress=None, bias_correction: bool = True, threads: int = 0, ranges: dict | None = None,
                      hessians: dict | None = None, weight_cache: dict | None = None) -> list:
    """Sensitivity of every int8 layer; `feeds` is a list of input dicts (batches). `ranges`,
    `hessians`: as quantize_graph takes them (tuned ranges, output-aware rounding)."""
    ref = run_first_output(fused, feeds, threads) if reference is None else reference
    layers = quantizable_layers(fused)
    names = [d.name for d in layers]
    out = []
    cache = {} if weight_cache is None else weight_cache
    for k, d in enumerate(layers):
        others = {n: "sensitivity: only one layer int8" for n in names if n != d.name}
        q = quantize_graph(fused, table, method, others, bias_correction, ranges=ranges, weight_cache=cache,
                           prune_excluded=False, hessians=hessians)
        y = run_first_output(q.model, feeds, threads)
        node_out = next(n.output[0] for n in q.model.graph.node if n.name == d.name)
        qp = q.qparams.get(node_out)
        clip = clip_fraction(table, node_out, qp.lo, qp.hi) if qp else 0.0
        li = q.layers.get(d.name)
        out.append(LayerSensitivity(d.name, d.op_type, k, sqnr_db(ref, y), top1_agreement(ref, y),
                                    kl_softmax(ref, y) if y.ndim == 2 else 0.0,
                                    li.weight_sqnr_db if li else None, clip))
        if progress:
            progress(1)
    for r, s in enumerate(sorted(out, key=lambda s: (s.output_sqnr_db, -s.kl)), 1):
        s.rank = r
    return out
