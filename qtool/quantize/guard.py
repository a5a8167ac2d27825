"""Layers that alone ruin the output stay fp32, by default.

The sensitivity pass measures each layer alone in int8. Most layers cost the output little (30-45 dB
of SQNR each); a few cannot be quantized linearly at all: a recognizer's layer with an outlier channel,
a LayerNorm's Square. (An audio front end's spectrum on its way to a Log, whose loud bins set a uint8
range in which every quiet bin rounds to zero, is not left to this measurement: rules/log_domain.py
keeps the whole chain fp32 in every plan; one layer of it fp32 was not enough.)
A layer alone below GUARD_DB leaves no usable model whatever the rest does, so the default keeps
such layers fp32 (the worst first, at most MAX_SHARE of the layers) where the whole model then
measures better on the calibration samples. --exclude-sensitive still searches for more, against
the user's target.
"""
from __future__ import annotations

import math

from qtool.metrics import sqnr_db
from qtool.quantize.encoder_judge import judged_view

GUARD_DB = 10.0  # a layer alone in int8 leaving the output below this is kept fp32
MAX_SHARE = 0.05  # of the measured layers, at most (and at least MIN_KEPT: a layer and the one reading
MIN_KEPT = 2  # the same tensor often go together, as the power spectrum's Add and the mel MatMul do)
MIN_GAIN_DB = 0.5  # the whole model must gain this much on the calibration samples


def guard_layers(ctx, ranking: list, samples, say=print) -> dict:
    """{layer: reason} of the layers kept fp32 beside ctx.exclude: those of `ranking` (sensitivity)
    alone below GUARD_DB, where the model with them fp32 beats the model without by MIN_GAIN_DB on
    `samples`; {} otherwise."""
    worst = sorted((l for l in ranking if l.output_sqnr_db < GUARD_DB and l.name not in ctx.exclude),
                   key=lambda l: l.output_sqnr_db)
    worst = worst[:max(MIN_KEPT, math.floor(MAX_SHARE * len(ranking)))]
    if not worst or not len(samples):
        return {}
    keep = {l.name: f"kept fp32: alone in int8 it leaves the output at {l.output_sqnr_db:.1f} dB SQNR "
                    f"(below {GUARD_DB:g} dB; sensitivity rank {l.rank})" for l in worst}
    # (judged as the output is read: an encoder's sentence vectors, whose padded positions are masked away;
    # all-mpnet-base-v2 padded to 128 tokens had every layer "alone below 10 dB" on its raw states)
    view = judged_view(ctx, samples)
    before = sqnr_db(view(samples.reference), view(ctx.score(samples)[0]))
    after = sqnr_db(view(samples.reference), view(ctx.score(samples, keep)[0]))
    names = ", ".join(keep)
    if after < before + MIN_GAIN_DB:
        say(f"note: {names} alone in int8 leave{'s' if len(keep) == 1 else ''} the output below {GUARD_DB:g} dB, "
            f"but the model is no better with {'it' if len(keep) == 1 else 'them'} fp32 ({before:.1f} -> "
            f"{after:.1f} dB on {len(samples)} calibration samples): kept int8")
        return {}
    say(f"kept fp32 (alone in int8 each leaves the output below {GUARD_DB:g} dB): {names}; output SQNR on "
        f"{len(samples)} calibration samples {before:.1f} -> {after:.1f} dB")
    return keep
