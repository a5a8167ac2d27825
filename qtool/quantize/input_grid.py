"""Whether a model input on an 8-bit lattice is shifted onto its quantizer's grid: measured per model.

A lattice whose points sit half a step off every uint8 grid ((p/255 - 0.5)/0.5) can be made exact
by a constant shift (lattice.py, qdq.lattice_inputs), but a value off the lattice then moves by half
a step in one direction: the 0.0 that right-pads a text crop becomes 1/255 everywhere it stands, a
constant over most of the image, where without the shift each pixel's half-step error alternates in
sign and averages out. Which costs more depends on the model. PP-OCRv5's recognizer gains from the
shift (output 15.2 -> 16.1 dB, crops read 91.4 -> 93.3 %); PP-OCRv2's loses (19.0 -> 17.6 dB on its
calibration samples, crops read 71.4 -> 58.0 %: extra letters in the padding). So both int8 models
are scored on the method-choice samples, as the range methods are, and the better one kept.
"""
from __future__ import annotations

from dataclasses import replace

from qtool.lattice import Lattice
from qtool.quantize.context import QuantizeContext
from qtool.quantize.method_choice import best_option, measurer
from qtool.quantize.samples import SampleSet


def shifted_inputs(ctx: QuantizeContext) -> list:
    """The model inputs whose lattice needs a shift to sit on a grid (the choice is theirs to make)."""
    out = []
    for t, d in (getattr(ctx.table, "lattices", None) or {}).items():
        lat = Lattice.from_dict(d)
        if lat is not None and lat.shift:
            out.append(t)
    return out


def choose_input_grid(ctx: QuantizeContext, samples: SampleSet, say=print) -> dict | None:
    """Sets ctx.input_grid to what measures better on `samples`; -> {"shifted": (dB, agreement),
    "as calibrated": (dB, agreement), "chosen": ...}, None where there is nothing to choose."""
    inputs = shifted_inputs(ctx)
    if not inputs or not len(samples):
        return None
    measure, options = measurer(ctx.fused, samples), []
    for on in (False, True):
        v = replace(ctx, input_grid=on)
        y, q = v.score(samples)
        if on and not q.input_shifts:
            return None  # the shift did not apply (an input read by a layer without a bias)
        options.append(measure(y))
    k = best_option(options)
    ctx.input_grid = bool(k)
    names = ("as calibrated", "shifted onto its grid")
    say(f"input grid: {', '.join(inputs)} {names[k]} (output SQNR on {len(samples)} calibration samples: "
        + ", ".join(f"{n} {o.label()}" for n, o in zip(names, options)) + ")")
    return {"inputs": inputs, "chosen": names[k], "scores_db": {n: o.db for n, o in zip(names, options)},
            "agreement": {n: o.agreement for n, o in zip(names, options)},
            "texts": {n: o.texts for n, o in zip(names, options)}}
