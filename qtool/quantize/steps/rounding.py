"""Output-aware weight rounding (rounding.py): each layer's weights rounded down or up to lower its output
error on calibration samples, from the covariance of its input."""
from __future__ import annotations

import time

from qtool.quantize.context import QuantizeContext
from qtool.quantize.optional import OptionalSteps
from qtool.quantize.progress import bar, whole
from qtool.quantize.rounding import layer_hessians
from qtool.quantize.rounding_check import RoundingCheck, check_rounding
from qtool.quantize.samples import SampleSet
from qtool.quantize.state import Tuning
from qtool.quantize.step import Step


def round_all(ctx: QuantizeContext, say=print, show_progress: bool = True) -> None:
    """Build the model once so every layer in ctx.hessians is rounded by its output error (cached
    in ctx.weight_cache for every later build), with a bar over those layers."""
    todo = set(ctx.hessians or ())
    if not todo:
        return
    say(f"rounding the weights of {len(todo)} layers by their output error")
    with bar(len(todo), "layer", "round weights", show_progress) as pb:
        ctx.weight_cache.progress = lambda name: pb.update(1) if name in todo else None
        try:
            if ctx.experiments is not None:  # (the layers' fits on a Ray cluster's workers, into ctx.weight_cache)
                ctx.experiments.fit(ctx, sorted(todo))
            ctx.build()
        finally:
            ctx.weight_cache.progress = None


def tune_rounding(ctx: QuantizeContext, samples: SampleSet, res: Tuning, steps: OptionalSteps, say=print,
                  show_progress: bool = True) -> None:
    """Output-aware rounding from calibration `samples`: sets ctx.hessians (and res.hessians, the
    layers left to nearest rounding in res.unrounded) and rounds every such layer once. A layer whose
    covariance or rounding fails is told to `steps` and rounded to nearest."""
    say(f"output-aware rounding: input covariances of every layer on {len(samples)} calibration images")
    fail = steps.on_layer_error("output-aware rounding")

    def nearest(layer, error):
        fail(layer, error)
        if ctx.hessians:
            ctx.hessians.pop(layer, None)
        res.unrounded[layer] = "its output-aware rounding failed"

    ctx.record_samples("output-aware rounding", samples)
    check = cross_check(ctx, samples, say, show_progress)
    res.check = check
    if check.nearest:
        ctx.hessians = res.hessians = None
        return
    covariances = layer_hessians if ctx.experiments is None else ctx.experiments.hessians  # (Ray: sharded.py)
    with bar(len(samples), "image", "covariances", show_progress) as pb:
        ctx.hessians = res.hessians = covariances(ctx.fused, samples, progress=whole(pb), on_error=nearest,
                                                  skipped=res.unrounded)
    ctx.on_error = nearest
    round_all(ctx, say, show_progress)  # at the method's ranges; range tuning scores with these weights


def cross_check(ctx: QuantizeContext, samples: SampleSet, say=print, show_progress: bool = True) -> RoundingCheck:
    """rounding_check.check_rounding, said in one line."""
    with bar(len(samples), "image", "covariances by halves", show_progress) as pb:
        check = check_rounding(ctx, samples, progress=whole(pb))
    say(check.line())
    return check


def when(run) -> bool:
    """--rounding output (the default), the budget affords it, tuning samples were decoded"""
    return run.on.rounding and bool(len(run.tune_samples))


def samples(run) -> tuple:
    """the tuning samples (cross-checked: fitted on each half, judged on the other); held-out ones with --verify"""
    return ("tune", "verify") if run.on.rounding else ()


def rounding(run) -> None:
    t0 = time.time()
    try:
        tune_rounding(run.ctx, run.tune_samples, run.tuning, run.steps, run.say, run.progress)
    finally:
        run.tuning.seconds += time.time() - t0


def nearest(run) -> None:
    run.ctx.hessians = run.tuning.hessians = None
    run.ctx.on_error = None


def verify(run) -> None:
    if run.ctx.hessians and len(run.held_out):
        v = run.verify("output-aware rounding", "nearest rounding", hessians=None)
        if v is not None and not v.kept:
            nearest(run)


STEP = Step("output-aware rounding", rounding, when, samples, fallback="nearest rounding", undo=nearest,
            after=verify, layer_fallback="this layer rounded to nearest")
