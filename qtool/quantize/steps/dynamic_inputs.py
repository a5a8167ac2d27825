"""The layers whose input no static range holds well quantize it at run time (dynamic.py), where the
whole model then measures no worse on the calibration samples."""
from __future__ import annotations

import numpy as np

from qtool.metrics import sqnr_db
from qtool.quantize.dynamic import GAIN_DB, measure
from qtool.quantize.encoder_judge import judged_view
from qtool.quantize.step import Step


def _samples(run):
    return run.samples.pick(run.split.tune)


def when(run) -> bool:
    """the main graph has int8 layers and the tuning samples were decoded"""
    return run.main_int8 and bool(len(_samples(run)))


def samples(run) -> tuple:
    """the tuning samples"""
    return ("tune",) if run.main_int8 else ()


def choose(run) -> None:
    ctx, tune = run.ctx, _samples(run)
    run.ctx.record_samples("dynamic inputs", tune)
    choices = measure(ctx, tune, ctx.threads)
    run.dynamic = {"gain_db": GAIN_DB, "layers": {c.layer: c.to_dict() for c in choices}}
    needed = frozenset(c.layer for c in choices if c.dynamic)
    gaining = frozenset(c.layer for c in choices if c.gains)
    every = frozenset(c.layer for c in choices if np.isfinite(c.static_sqnr_db))
    trials = {k: v for k, v in (("needed", needed), ("gaining", gaining), ("every", every)) if v}
    if not trials:
        return
    view = judged_view(ctx, tune)
    score = lambda layers: sqnr_db(view(tune.reference), view(ctx.score(tune, dynamic=layers)[0]))  # noqa: E731
    figures = {"static": score(frozenset())}
    tried = {}
    for name, layers in trials.items():  # (each distinct set once, in this order)
        if layers not in tried.values():
            tried[name], figures[name] = layers, score(layers)
    before = figures["static"]
    best = max(tried, key=lambda k: (figures[k], -len(tried[k])))
    chosen = tried[best]
    run.dynamic["output_sqnr_db"] = {k: round(v, 2) for k, v in figures.items()}
    # the model as a whole must gain as much as a layer must: a dynamic input costs each run a pass over the
    # tensor and ORT's dynamic kernels, and its gain on calibration samples is no promise on others (FSMN-VAD:
    # +2.4 dB on its calibration samples, -0.2 dB on its held-out files); static stays qtool's default
    if figures[best] < before + GAIN_DB:
        if needed:
            run.say(f"note: {len(needed)} layer(s) measured better with their input quantized at run time, but the "
                    f"model is not ({before:.1f} -> {figures[best]:.1f} dB on {len(tune)} calibration samples): "
                    f"all static")
        return
    ctx.dynamic = chosen
    for layer in chosen:
        run.dynamic["layers"][layer]["dynamic"] = True
    run.say(f"{len(chosen)} of {len(choices)} MatMul layer(s) quantize their input at run time ({len(needed)} of them "
            f"held {GAIN_DB:g} dB or more worse by a static range); output SQNR on {len(tune)} calibration samples "
            f"{before:.1f} -> {figures[best]:.1f} dB")


def undo(run) -> None:
    run.ctx.dynamic = frozenset()


def verify(run) -> None:
    if run.ctx.dynamic and len(run.held_out):
        v = run.verify("dynamic inputs", FALLBACK, dynamic=frozenset())
        if v is not None and not v.kept:
            run.ctx.dynamic = frozenset()
            run.dynamic["verified"] = False
            for entry in run.dynamic["layers"].values():
                entry["dynamic"] = False


FALLBACK = "every layer's input quantized with a static range"
STEP = Step("dynamic inputs", choose, when, samples, fallback=FALLBACK, undo=undo, after=verify)
