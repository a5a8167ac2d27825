"""What the target's weight encoding costs at the output, against plain int8 weights, on the tuning samples;
with If branches quantized, the output SQNR of the model as written."""
from __future__ import annotations

from qtool.metrics import sqnr_db
from qtool.quantize.context import QuantizeContext
from qtool.quantize.encoding import S8, TARGETS
from qtool.quantize.progress import bar
from qtool.quantize.samples import SampleSet
from qtool.quantize.step import Step


def target_cost(ctx: QuantizeContext, samples: SampleSet, excluded: dict, say=print,
                show_progress: bool = False) -> dict | None:
    """What the target's weight encoding costs at the output, against plain int8 weights (the exact
    int8 result of both), on calibration samples."""
    if not len(samples) or TARGETS[ctx.target].encoding == S8:
        return None
    plain = QuantizeContext(ctx.fused, ctx.table, ctx.method, "vnni", ctx.bias_correction, ctx.exclude, ctx.ranges,
                            ctx.hessians, threads=ctx.threads, dynamic=ctx.dynamic)
    say(f"measuring what target {ctx.target} costs against plain int8 weights on {len(samples)} calibration images")
    rounded = set(ctx.hessians or ())
    with bar(2 + len(rounded), "step", "target cost", show_progress) as pb:
        y_t = ctx.score(samples, excluded)[0]
        pb.update(1)
        plain.weight_cache.progress = lambda name: pb.update(1) if name in rounded else None
        y_p = plain.score(samples, excluded)[0]
        pb.update(1)
    return {"samples": len(samples), "output_sqnr_db": sqnr_db(samples.reference, y_t),
            "output_sqnr_plain_int8_db": sqnr_db(samples.reference, y_p)}


def written_cost(model, samples: SampleSet, threads: int = 0) -> dict | None:
    """The output SQNR of the int8 model as written, If branches quantized as models of their own included,
    on calibration samples (where the experiments, which see only the main graph, measured an all-fp32
    model: "inf dB" for Silero VAD, whose whole network sits in a branch)."""
    if not len(samples):
        return None
    y, _ = samples.outputs_of(model, threads)
    return {"samples": len(samples), "output_sqnr_db": sqnr_db(samples.reference, y),
            "output_sqnr_plain_int8_db": None, "measured": "on the model written, its If branches int8"}



def measure(run) -> None:
    tune = run.tune_samples
    if len(tune):
        run.ctx.record_samples("target cost", tune)
    if run.branches:  # (ctx's experiments leave the branches fp32: the model written is measured instead)
        run.cost = written_cost(run.out.model, tune, run.ctx.threads)
    else:
        run.cost = target_cost(run.ctx, tune, run.final_exclude, run.say, run.progress)


STEP = Step("target cost", measure, fallback="the target's cost not measured")
