"""The guard (guard.py): a layer that alone ruins the output is kept fp32, where that measures better."""
from __future__ import annotations

from qtool.quantize.guard import guard_layers
from qtool.quantize.step import Step


def _samples(run):
    return run.tune_samples if len(run.tune_samples) else run.sens_samples


def when(run) -> bool:
    """the sensitivity analysis ranked the layers"""
    return run.ranking is not None


def guard(run) -> None:
    run.ctx.record_samples("guard", _samples(run))
    run.guarded = guard_layers(run.ctx, run.ranking, _samples(run), run.say)


def keep(run) -> None:
    """The guard's layers join the user's exclusions (ctx.exclude), once verified where --verify holds samples out."""
    if run.guarded and len(run.held_out):
        v = run.verify("guard", "no layer kept fp32 by the guard", exclude=run.guarded)
        if v is not None and not v.kept:
            run.guarded = {}
    run.ctx.exclude.update(run.guarded)


STEP = Step("guard", guard, when, fallback="no layer kept fp32 for ruining the output alone", after=keep)
