"""Outlier channels of the run-time quantized inputs moved into the weights (migrate.py), where the
whole model then measures better on the calibration samples."""
from __future__ import annotations

from dataclasses import replace

from qtool.metrics import sqnr_db
from qtool.quantize.context import ReportingCache
from qtool.quantize.encoder_judge import judged_view
from qtool.quantize.migrate import MIN_GAIN_DB, apply, measure
from qtool.quantize.step import Step


def _samples(run):
    return run.samples.pick(run.split.tune)


def when(run) -> bool:
    """some layer quantizes its input at run time"""
    return bool(run.ctx.dynamic) and bool(len(_samples(run)))


def samples(run) -> tuple:
    """the tuning samples"""
    return ("tune",) if run.main_int8 else ()


def choose(run) -> None:
    ctx, tune = run.ctx, _samples(run)
    ctx.record_samples("migration", tune)
    found = measure(ctx, tune, ctx.threads)
    moves = [m for m in found if m.scale is not None]
    report = {"min_gain_db": MIN_GAIN_DB, "tensors": {m.tensor: m.to_dict() for m in found}, "kept": False}
    run.dynamic["migration"] = report
    if not moves:
        return
    view = judged_view(ctx, tune)
    before = sqnr_db(view(tune.reference), view(ctx.score(tune)[0]))
    fused, table, how = apply(ctx.fused, ctx.table, moves)
    moved = {layer for m in moves for layer in m.layers}
    # (the moved layers quantized afresh: their names stay, their weights do not)
    cache = ReportingCache(getattr(ctx.weight_cache, "progress", None))
    cache.update((k, v) for k, v in ctx.weight_cache.items() if k[0] not in moved)
    trial = replace(ctx, fused=fused, table=table, weight_cache=cache)
    after = sqnr_db(view(tune.reference), view(trial.score(tune)[0]))
    report["output_sqnr_db"] = {"before": round(before, 2), "after": round(after, 2)}
    # the model must gain as its layers did: a Mul per tensor costs each run a pass over it
    if after < before + MIN_GAIN_DB:
        run.say(f"note: {len(moves)} run-time quantized input(s) measured better with their outlier channels moved "
                f"into the weights, but the model is not ({before:.1f} -> {after:.1f} dB on {len(tune)} calibration "
                f"samples): left as they are")
        return
    ctx.fused, ctx.table, ctx.weight_cache = fused, table, cache
    report["kept"] = True
    for m in moves:
        report["tensors"][m.tensor]["how"] = how[m.tensor]
    folded = sum(1 for m in moves if how[m.tensor].startswith("into"))
    run.say(f"{len(moves)} of {len(found)} run-time quantized input(s) move their outlier channels into the weights "
            f"({folded} folded into a constant, {len(moves) - folded} through a Mul); output SQNR on {len(tune)} "
            f"calibration samples {before:.1f} -> {after:.1f} dB")


FALLBACK = "the run-time quantized inputs as they are"
STEP = Step("migration", choose, when, samples, fallback=FALLBACK)
