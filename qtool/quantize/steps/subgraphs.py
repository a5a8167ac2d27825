"""If branches every calibration sample takes, quantized as models of their own (subgraphs.py), with
this run's options, by the quantize function the run carries."""
from __future__ import annotations

from dataclasses import replace

from qtool.quantize.step import Step
from qtool.quantize.subgraphs import quantize_branches


def when(run) -> bool:
    """the graph holds an If, calibration samples were decoded"""
    return any(n.op_type == "If" for n in run.ctx.fused.graph.node) and bool(len(run.samples))


def samples(run) -> tuple:
    """where the main graph has no int8 layer: what the branches' own steps read"""
    if run.main_int8:
        return ()
    return ("auto", "tune", "sensitivity") + (("held_back",) if run.on.branch_exclusion else ()) + ("verify",)


def branch_options(run):
    """The run's options as the branches take them: the method asked for, the switches as the budget left
    them, --exclude-sensitive where the main graph had nothing to keep fp32; no paths, no bars."""
    o, on = run.options, run.on
    return replace(o, model=None, table=None, output=None, exclude=(), method=run.method, rounding=on.rounding,
                   tune_ranges=on.tune_ranges, strict=run.steps.strict, progress=False,
                   sensitivity=replace(o.sensitivity, enabled=o.sensitivity_on),
                   exclusion=replace(o.exclusion, enabled=on.branch_exclusion, labels=None))


def quantize(run) -> None:
    options = branch_options(run)
    run.branches = quantize_branches(run.out.model, run.ctx.fused, run.samples, run.wd.path,
                                     lambda workdir: run.quantize(workdir, options, say=lambda text: None), run.say)


STEP = Step("subgraphs", quantize, when, samples, fallback="the If branches stay fp32", budgeted=False)
