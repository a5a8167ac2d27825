"""--method auto: the range method whose int8 model measures best on a few calibration samples
(method_choice.py)."""
from __future__ import annotations

from qtool.quantize.method_choice import counts_texts, pick_method
from qtool.quantize.step import Step


def choice_samples(run):
    """The samples --method auto, and the balancing and input-grid choices after it, measure on: method
    choice's few; for a CTC recognizer the tuning samples too. A text is read as fp32 reads it or not, one
    count per sample, and 8 cannot tell models apart that 286 do: PP-OCRv5's recognizer calibrated on
    text-samples crops chose a model that changes 62 of those 286 crops' texts over one that changes 12,
    each reading 7 of the 8 (and 213 against 239 of 255 held-out crops)."""
    auto = run.samples.pick(run.split.auto)
    if not counts_texts(run.ctx.fused, auto):
        return auto
    return run.samples.pick(list(dict.fromkeys(list(run.split.auto) + list(run.split.tune))))


def when(run) -> bool:
    """--method auto, the main graph has int8 layers, the budget affords it"""
    return run.on.auto


def samples(run) -> tuple:
    """method choice's few (a recognizer's: the tuning samples too); held-out ones with --verify"""
    return ("auto", "tune", "verify") if run.on.auto else ()


def choose(run) -> None:
    chosen = choice_samples(run)
    run.ctx.record_samples("method choice", chosen)
    run.ctx.method, run.method_measures = pick_method(run.ctx, chosen, run.say, run.progress)


STEP = Step("method choice", choose, when, samples, fallback="the calibrated range method")
