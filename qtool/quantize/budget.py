"""How many calibration samples each optional step of `quantize` can afford.

A step costs about (fp32 passes per sample it takes) x (its samples) x (the time of one fp32 pass:
the model's multiply-accumulates at a nominal rate, or timed where they cannot be counted). Most models run every step on its default
samples in seconds. A heavy one gets fewer, down to the step's least useful number, and a step whose
least number alone would run past MAX_STEP_SECONDS is skipped, and the run says so. Measured on the
zoo (2 cores): a 1280x1280 YOLO (0.45 s a pass, 322 layers) keeps every step on fewer samples; a
960x1280 CRAFT U-Net (11.5 s a pass, 437 GMAC) keeps method choice on one sample and skips
sensitivity and output-aware rounding, which would take minutes each.
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class Budget:
    seconds_per_sample: float  # one fp32 pass of one calibration sample

    @classmethod
    def of(cls, fused, samples) -> "Budget":
        """From the model's multiply-accumulates at the first sample's shapes (NOMINAL_MACS_PER_SECOND);
        where they cannot be counted, from the fp32 pass timed on `samples`."""
        from qtool import graph as G
        one = samples.feed(0, 1) if len(samples) else {}
        shapes = {k: (1,) + tuple(v.shape[1:]) if not samples.stacked else tuple(v.shape) for k, v in one.items()
                  if getattr(v, "ndim", 0)}
        macs = G.count_macs(fused, shapes) if one else None
        return cls(macs / NOMINAL_MACS_PER_SECOND if macs else samples.seconds_per_sample)

    def samples(self, passes: float, wanted: int, least: int = 1) -> int:
        """Samples (at most `wanted`) a step of `passes` fp32 passes per sample can take within
        STEP_SECONDS; at least `least` where those fit MAX_STEP_SECONDS, else 0 (skip the step)."""
        cost = passes * self.seconds_per_sample
        if wanted <= 0 or cost <= 0:
            return max(wanted, 0)
        n = min(wanted, int(STEP_SECONDS // cost))
        if n >= least:
            return n
        return min(least, wanted) if min(least, wanted) * cost <= MAX_STEP_SECONDS else 0

    def seconds(self, passes: float, samples: int) -> float:
        return passes * self.seconds_per_sample * samples
