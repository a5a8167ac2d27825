"""A model input on an 8-bit lattice half a step off every grid is shifted onto one, where that measures
better (input_grid.py)."""
from __future__ import annotations

from qtool.quantize.input_grid import choose_input_grid
from qtool.quantize.step import Step


def _samples(run):
    if run.on.auto and run.split.auto:
        return run.choice_samples
    return run.samples.pick(run.split.tune)


def when(run) -> bool:
    """method choice's samples (else the tuning ones) were decoded"""
    return bool(len(_samples(run)))


def choose(run) -> None:
    run.input_grid = choose_input_grid(run.ctx, _samples(run), run.say)


def verify(run) -> None:
    if run.input_grid is not None:
        run.ctx.record_samples("input grid", _samples(run))
    if run.ctx.input_grid and len(run.held_out):
        v = run.verify("input grid", "the inputs on their calibrated grid", input_grid=False)
        if v is not None and not v.kept:
            run.ctx.input_grid = False
            run.input_grid = dict(run.input_grid or {}, chosen="as calibrated", verified=False)


STEP = Step("input grid", choose, when, fallback="model inputs quantized on their calibrated grid", after=verify)
