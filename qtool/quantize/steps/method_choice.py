"""--method auto: the range method whose int8 model measures best on a few calibration samples
(method_choice.py)."""
from __future__ import annotations

from qtool.quantize.method_choice import pick_method
from qtool.quantize.step import Step


def when(run) -> bool:
    """--method auto, the main graph has int8 layers, the budget affords it"""
    return run.on.auto


def samples(run) -> tuple:
    """method choice's few (a recognizer's: the tuning samples too); held-out ones with --verify"""
    return ("auto", "tune", "verify") if run.on.auto else ()


def choose(run) -> None:
    chosen = run.choice_samples
    run.ctx.record_samples("method choice", chosen)
    run.ctx.method, run.method_measures = pick_method(run.ctx, chosen, run.say, run.progress)


STEP = Step("method choice", choose, when, samples, fallback="the calibrated range method")
