"""Each activation quantizer's own noise: the tensor against its uint8 rounding, on calibration samples.

Layer sensitivity quantizes one layer alone in an fp32 model; --exclude-sensitive then keeps layers
fp32 in the fully quantized one, where the noises add up. A tensor whose quantizer is far noisier than
the rest (a few channels 100x the others, the one range leaving the others a handful of steps) can
cost little alone and much among the others: in PP-OCRv5's recognizer the reader of its noisiest
quantizer (5.9 dB at the tensor, the median is 34) ranked 33rd of 73 alone, and leaving its five
noisiest quantizers unquantized halved the crops whose text int8 changes. This ranks the quantizers
by that noise, measured where it arises, in one fp32 pass: no simulation, and blind to what the
network downstream makes of the noise, so it proposes candidates and exclusion measures them.

The noise is measured per channel, each against its own signal, and averaged: over the whole
tensor, the wide channels that swamp the range would also swamp the figure, and the channels that
lose their steps are the point. The channel axis is the last one for MatMul and Gemm readers (a
token's features), else axis 1.

Where every reader of a tensor is flat below its range (Relu, Clip, hard-swish, HardSigmoid: the
range stops where they go flat), values below it lose nothing and are not counted as noise.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool import graph as G
from qtool import qparams as Q
from qtool.ortsession import session, with_outputs

FLAT_BELOW = {"Relu", "Clip", "HardSwish", "HardSigmoid"}
SAMPLES = 8  # the noise of a quantizer is a property of the tensor: a few samples measure it
# memory: each fp32 run hands back FIRST_PASS tensors, then as many as fit in BYTES_PER_PASS at the
# largest size seen so far (one sample per run); time: fewer samples, down to one, where the runs
# this takes would exceed SECONDS at the work counted for the fp32 model (budget.py; CRAFT: 437 GMAC per image)
FIRST_PASS = 4
BYTES_PER_PASS = 256 << 20
SECONDS = 30.0


@dataclass
class QuantizerNoise:
    tensor: str
    sqnr_db: float  # its channels' signal over their rounding and clipping noise (the mean ratio, in dB)
    readers: list  # the int8 layers reading it: all of them fp32, and it is not quantized


def quantizer_noise(ctx, samples, threads: int = 0) -> list:
    """[QuantizerNoise] of every activation quantizer of ctx's model with int8 readers, noisiest first,
    on up to SAMPLES of `samples` (a SampleSet)."""
    if not len(samples):
        return []
    built = ctx.build(weights=False)  # (the plan and the activation qparams; no weight is quantized for them)
    plan, qp = built.plan, built.qparams
    fused = ctx.fused
    cons = G.consumers(fused)
    inputs = {i.name for i in fused.graph.input}
    tensors = []  # (tensor, its int8 readers, flat below its range for every reader)
    axis = {}  # tensor -> its channel axis
    for t in plan.tensors:
        readers = sorted({c.name for c in cons.get(t, []) if c.name in plan.int8_nodes})
        if t in qp and readers:
            tensors.append((t, readers, all(c.op_type in FLAT_BELOW for c in cons.get(t, []))))
            last = all(c.op_type in ("MatMul", "Gemm") for c in cons.get(t, []) if c.name in plan.int8_nodes)
            axis[t] = -1 if last else 1
    flat = {t: f for t, _, f in tensors}
    fetched = [t for t, _, _ in tensors if t not in inputs]
    runs = -(-len(fetched) // FIRST_PASS)  # (at most: later runs fetch more at once)
    n = noise_samples(fused, samples, runs)
    take = samples.subset(np.linspace(0, len(samples) - 1, min(n, len(samples))).astype(int))
    ctx.record_samples("quantizer noise", take)
    # one sample per run, where the model takes any batch (whole batches where its batch is fixed)
    feeds = take.single_feeds()
    signal, noise = {}, {}
    a, per_run, biggest = 0, FIRST_PASS, 1
    while a < len(fetched):
        names = fetched[a:a + per_run]
        sess = session(with_outputs(fused, names), threads, where="quantizer noise (fp32)")
        for feed in feeds:
            for t, y in zip(names, sess.run(names, feed)):
                biggest = max(biggest, y.nbytes)
                _measure(t, np.asarray(y, np.float32), qp[t], flat[t], signal, noise, axis[t])
        a += len(names)
        per_run = max(1, BYTES_PER_PASS // biggest)
    for t in (t for t, _, _ in tensors if t in inputs):
        for feed in feeds:
            _measure(t, np.asarray(feed[t], np.float32), qp[t], flat[t], signal, noise, axis[t])
    out = []
    for t, readers, _ in tensors:
        if t in signal:
            sig, err = signal[t], noise[t]
            live = sig > 1e-9 * sig.max()  # (a dead channel has no signal to lose)
            ratio = float(np.mean(err[live] / sig[live])) if live.any() else 0.0
            out.append(QuantizerNoise(t, 10 * float(np.log10(1 / ratio)) if ratio > 0 else float("inf"), readers))
    return sorted(out, key=lambda q: q.sqnr_db)


def noise_samples(fused, samples, runs: int) -> int:
    """SAMPLES, or fewer (down to one) where `runs` fp32 runs of them would exceed SECONDS at the work
    counted for one pass (budget.py: counted, never timed; SAMPLES where it cannot be counted)."""
    from qtool.quantize.budget import Budget
    per = Budget.of(fused, samples).seconds_per_sample
    return SAMPLES if per <= 0 else max(1, min(SAMPLES, int(SECONDS / (per * max(runs, 1)))))


def _measure(t, y, p, flat, signal, noise, axis: int = 1) -> None:
    """Adds tensor t's per-channel signal and noise energies (float64 [C]) of the batch y."""
    ref = np.maximum(y, np.float32(p.lo)) if flat else y
    err = Q.fake_quantize(y, p) - ref
    if y.ndim < 2:
        ref, err = ref.reshape(1, -1), err.reshape(1, -1)
        axis = 0
    ax = tuple(k for k in range(ref.ndim) if k != axis % ref.ndim)
    _add(signal, t, np.sum(np.square(ref, dtype=np.float64), axis=ax))
    _add(noise, t, np.sum(np.square(err, dtype=np.float64), axis=ax))


def _add(acc: dict, t: str, v: np.ndarray) -> None:
    """acc[t] += v per channel; where the channel axis changes size with the samples (a sequence of
    several lengths), the sums over all of it instead."""
    old = acc.get(t)
    if old is not None and np.shape(old) != v.shape:
        old, v = np.atleast_1d(np.sum(old)), np.atleast_1d(np.sum(v))
    acc[t] = v if old is None else old + v
