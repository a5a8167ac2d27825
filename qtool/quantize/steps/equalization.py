"""Channel balancing (equalize.py): the depthwise convolutions' input channels scaled so each uses the
int8 grid well; where the range method is chosen by measurement, the methods are compared again on
the balanced graph."""
from __future__ import annotations

from dataclasses import replace

from qtool.quantize.context import QuantizeContext
from qtool.quantize.equalize import balance
from qtool.quantize.method_choice import best_option, pick_method
from qtool.quantize.samples import SampleSet
from qtool.quantize.step import Step


def balance_and_choose(ctx: QuantizeContext, tune: SampleSet, auto: SampleSet, first: dict, say=print,
                       show_progress: bool = True) -> tuple:
    """Channel balancing (equalize.py) where the range method is chosen by measurement: the graph is
    balanced under the method chosen on it as it is and under the unclipped one, the methods compared
    again on each balanced graph, and the best of those and of the unbalanced choice (`first`: its
    measures) kept in ctx. Balancing moves the methods apart: on PP-OCRv5's recognizer entropy measured
    best as it is (81.6 % of the evaluation crops' words read), and balanced under entropy only 1 of
    23 tensors gained (percentile then, 78.0 %), where under minmax all 23 did and minmax then measured
    best by far (91.4 %); on a synthetic block, balancing under minmax gained nothing and under
    entropy 2 dB. -> the kept choice's {method: Measure}."""
    options = [(ctx, ctx.method, first)]
    for m in dict.fromkeys([ctx.method, ctx.table.range_method]):
        v = replace(ctx, method=m)  # (the same weight cache: its keys hold the activation scale)
        # (what a trial prints is a trial's: the choice among them is said below; hx8 read a trial's
        # "balanced ... 13.5 -> 20.5 dB" and "method auto: minmax" as what the model got)
        trial = lambda line, *a, _m=m, **k: say(f"  trial, balanced under {_m}: {line}", *a, **k)
        balance(v, tune, trial)
        if v.fused is not ctx.fused:
            options.append((v,) + pick_method(v, auto, trial, show_progress))
    k = best_option([measures[m] for _, m, measures in options])
    v, m, measures = options[k]
    if k:
        say(f"method auto, balanced: {m}")
    elif len(options) > 1:
        say(f"method auto: {m}, channels not balanced (no balanced trial measured better)")
    ctx.fused, ctx.table, ctx.weight_cache, ctx.method = v.fused, v.table, v.weight_cache, m
    return measures


def when(run) -> bool:
    """calibration samples were decoded"""
    return bool(len(run.samples))


def equalize(run) -> None:
    samples, split = run.samples, run.split
    tune = samples.pick(split.tune) if split.tune else samples
    if run.method_measures is not None:  # (ctx.fused and ctx.table become the balanced ones)
        run.method_measures = balance_and_choose(run.ctx, tune, run.choice_samples, run.method_measures, run.say,
                                                 run.progress)
    else:
        balance(run.ctx, tune, run.say)


STEP = Step("equalization", equalize, when, fallback="the depthwise convolutions' input channels as calibrated")
