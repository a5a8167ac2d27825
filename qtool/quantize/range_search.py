"""Activation ranges chosen at the model output: per tensor, the clip range that hurts the output least.

A range method judges a tensor by its own squared error, where clipping a rare large value
costs little. At the model output the same clipped value can matter more (or less) than the
rounding noise it saves. So, per quantized tensor, a few candidate ranges (every calibration
method's range from the histogram, and the default range shrunk by a few factors) are each
tried with only that tensor quantized, on calibration samples, and the one with the least
output noise power is kept if it beats the default range by a clear margin.

The probes run in simulate.py's Simulator: a probe is the fp32 graph with one tensor quantized,
re-run from the last cut before that tensor, its scale and zero point fed per run. Noise adds up
roughly over tensors, so the per-tensor choices combine; the combined ranges are then checked
with the whole int8 model (the QDQ model itself) against the default ones on the same samples and
kept only if the output is closer to fp32.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qtool import qparams as Q
from qtool.calibrate.methods import METHODS
from qtool.metrics import sqnr_db
from qtool.quantize.simulate import Simulator, Variant
from qtool.plan import make_plan

SHRINK = (0.75, 0.6)  # factors applied to the default range of an unclamped tensor
CLIP_METHODS = ("percentile", "mse")  # histogram methods whose ranges are candidates
PROBE_SAMPLES = 16  # samples a probe runs on: it ranks a tensor's candidate ranges (the result is checked on all)
MIN_GAIN = 0.1  # a candidate must cut that tensor's output noise by 10 % to replace the default
TOP_SHARE = 0.9  # tune the tensors that carry this share of the (tunable) activation noise, noisiest first


@dataclass
class RangeChoice:
    tensor: str
    default: tuple
    chosen: tuple
    label: str  # which candidate ("minmax", "mse", "x0.75", ...)
    noise_default: float  # output noise power / signal power with only this tensor quantized
    noise_chosen: float


@dataclass
class RangeSearch:
    ranges: dict = field(default_factory=dict)  # tensor -> (lo, hi) that differ from the method's
    choices: list = field(default_factory=list)  # RangeChoice per tuned tensor
    sqnr_default_db: float = 0.0  # whole int8 model on the probe samples
    sqnr_tuned_db: float = 0.0
    kept: bool = False  # tuned ranges kept (they beat the default on the whole model)
    probes: int = 0

    def to_dict(self):
        return {"kept": self.kept, "probes": self.probes, "sqnr_default_db": self.sqnr_default_db,
                "sqnr_tuned_db": self.sqnr_tuned_db,
                "changed": [c.__dict__ for c in self.choices if c.label != "default"]}


def _close(a, b, rel=0.01):
    span = max(abs(a[0]), abs(a[1]), abs(b[0]), abs(b[1]), 1e-12)
    return abs(a[0] - b[0]) <= rel * span and abs(a[1] - b[1]) <= rel * span


def candidates(table, method: str, tensor: str, clamp=None) -> list:
    """(label, (lo, hi)) candidates for one tensor, the default (the method's range) first, deduplicated."""
    def clamped(r):
        lo, hi = r
        if clamp is not None:
            lo, hi = max(lo, clamp[0]), min(hi, clamp[1])
        return float(min(lo, 0.0)), float(max(hi, 0.0))

    default = clamped(table.range(tensor, method))
    out = [("default", default)]
    raw = [(m, table.range(tensor, m)) for m in CLIP_METHODS + ("minmax",)
           if m != method and m in METHODS and table.range(tensor, m) is not None]
    if clamp is None:
        raw += [(f"x{f}", (default[0] * f, default[1] * f)) for f in SHRINK]
    for label, r in raw:
        r = clamped(r)
        if r[1] - r[0] > 1e-8 and not any(_close(r, o) for _, o in out):
            out.append((label, r))
    return out


def tunable(ctx) -> tuple:
    """(tensors whose range has more than one candidate, tensor -> candidates)."""
    fused, table, method = ctx.fused, ctx.table, ctx.method
    plan = make_plan(fused, ctx.exclude, table.ranges.get(method, {}))
    out_names = {o.name for o in fused.graph.output}
    tensors = [t for t in plan.tensors if t not in plan.shared and t not in out_names
               and table.range(t, method) is not None]
    cands = {t: candidates(table, method, t, plan.clamp.get(t)) for t in tensors}
    tensors = [t for t in tensors if len(cands[t]) > 1]  # (a ReLU6 output at [0, 6] has nothing to choose)
    return tensors, cands


WHOLE_MODEL_STEPS = 2  # the int8 model at the default and at the tuned ranges, after the probes


def probe_count(ctx) -> int:
    """Steps search_ranges takes at most: each tensor once, then every candidate of each, then
    the two whole-model scorings."""
    tensors, cands = tunable(ctx)
    return sum(len(cands[t]) for t in tensors) + WHOLE_MODEL_STEPS


def search_ranges(ctx, samples, progress=None, total=None) -> RangeSearch:
    """Tuned activation ranges (QuantizeContext `ctx`, its method, exclusions and rounding) from
    calibration `samples` (a SampleSet: inputs and the fp32 reference output). Each probe is the
    fp32 model with one tensor quantized, simulated from the last cut before it (simulate.py).
    `progress(k)`: k more steps done (a probe, or a whole-model scoring); `total(n)`: the exact
    number of steps, told once the first round of probes has fixed which tensors try candidates."""
    tensors, cands = tunable(ctx)
    if not tensors:
        return RangeSearch()
    sim = Simulator(ctx, samples.output)
    probe_set = samples.subset(np.linspace(0, len(samples) - 1, min(PROBE_SAMPLES, len(samples))).astype(int))
    if not len(probe_set):  # (a model whose fixed batch is larger than PROBE_SAMPLES)
        probe_set = samples
    ref = np.asarray(probe_set.reference, np.float64)
    power = max(float((ref ** 2).sum()), 1e-300)
    res = RangeSearch()

    def noise(probes: list) -> list:
        """Output noise power / signal power with only tensor t quantized to range r, per (t, r)."""
        res.probes += len(probes)
        return sim.run(probe_set, [Variant(set(), {t: Q.activation_qparams(*r)}, sim.plan.int8_nodes) for t, r in probes],
                       progress, reduce=lambda y: float(((y.astype(np.float64) - ref) ** 2).sum()) / power)

    # 1. each tensor alone at its default range; 2. the noisiest tensors try their candidates
    default_noise = dict(zip(tensors, noise([(t, cands[t][0][1]) for t in tensors])))
    noise_sum = sum(default_noise.values())
    chosen, acc = [], 0.0
    for t in sorted(tensors, key=lambda t: -default_noise[t]):
        if noise_sum <= 0 or acc >= TOP_SHARE * noise_sum:
            break
        acc += default_noise[t]
        chosen.append(t)
    probes = [(t, label, r) for t in chosen for label, r in cands[t][1:]]
    if total:
        total(len(tensors) + len(probes) + WHOLE_MODEL_STEPS)
    tried = noise([(t, r) for t, _, r in probes])
    for t in chosen:
        best = ("default", cands[t][0][1], default_noise[t])
        for (u, label, r), n in zip(probes, tried):
            if u == t and n < best[2]:
                best = (label, r, n)
        if best[2] > (1 - MIN_GAIN) * default_noise[t]:
            best = ("default", cands[t][0][1], default_noise[t])
        res.choices.append(RangeChoice(t, cands[t][0][1], best[1], best[0], default_noise[t], best[2]))
    tuned = {c.tensor: c.chosen for c in res.choices if c.label != "default"}
    # 3. the whole int8 model, default against tuned ranges, on the same samples
    reference = samples.reference
    res.sqnr_default_db = res.sqnr_tuned_db = sqnr_db(reference, ctx.score(samples, ranges=None)[0])
    if progress:
        progress(1)
    if tuned:
        res.sqnr_tuned_db = sqnr_db(reference, ctx.score(samples, ranges=tuned)[0])
    if progress:
        progress(1)
    res.kept = bool(tuned) and res.sqnr_tuned_db > res.sqnr_default_db
    res.ranges = tuned if res.kept else {}
    return res
