"""The per-layer sensitivity report: each layer alone in int8, measured at the output (sensitivity.py)."""
from __future__ import annotations

import time

from qtool.quantize.context import QuantizeContext
from qtool.quantize.progress import bar, whole
from qtool.quantize.samples import SampleSet
from qtool.quantize.sensitivity import layer_sensitivity, quantizable_layers
from qtool.quantize.step import Step


def run_sensitivity(ctx: QuantizeContext, samples: SampleSet, say=print, show_progress: bool = True):
    say(f"sensitivity: each of {len(quantizable_layers(ctx.fused))} layers alone in int8 on {len(samples)} "
        f"calibration images")
    t0 = time.time()
    with bar(len(quantizable_layers(ctx.fused)), "layer", "sensitivity", show_progress) as pb:
        layers = layer_sensitivity(ctx, samples, whole(pb))
    return {"layers": [l.to_dict() for l in layers], "seconds": time.time() - t0, "samples": len(samples)}, layers


def when(run) -> bool:
    """the sensitivity report or --exclude-sensitive, int8 layers in the main graph, samples decoded"""
    return run.on.sensitivity and bool(len(run.sens_samples))


def samples(run) -> tuple:
    """the sensitivity samples"""
    return ("sensitivity",) if run.on.sensitivity else ()


def measure(run) -> None:
    run.ctx.record_samples("sensitivity", run.sens_samples)
    run.sensitivity, run.ranking = run_sensitivity(run.ctx, run.sens_samples, run.say, run.progress)


STEP = Step("sensitivity", measure, when, samples, fallback="no sensitivity report, nothing excluded by it")
