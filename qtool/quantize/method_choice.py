"""Choosing a range method by measurement: the int8 output each method gives, against fp32.

Meant for calibration samples, so the choice never looks at evaluation data.
"""
from __future__ import annotations

from qtool.calibrate.methods import METHODS
from qtool.metrics import sqnr_db
from qtool.quantize.context import QuantizeContext
from qtool.quantize.samples import SampleSet


def method_scores(ctx: QuantizeContext, samples: SampleSet, methods=None, progress=None) -> dict:
    """Output SQNR (dB, first output, over `samples`) of the int8 model each range method gives,
    against the fused fp32 graph ("pick what measures best", per model); `progress(1)` after each."""
    scores = {}
    for m in methods or METHODS:
        scores[m] = sqnr_db(samples.reference, ctx.score(samples, method=m, ranges=None)[0])
        if progress:
            progress(1)
    return scores
