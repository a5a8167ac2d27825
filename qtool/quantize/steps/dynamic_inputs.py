"""The layers whose input no static range holds well quantize it at run time (dynamic.py), where the
whole model then measures no worse on the calibration samples."""
from __future__ import annotations

from qtool.metrics import sqnr_db
from qtool.quantize.dynamic import GAIN_DB, measure, weightless_groups
from qtool.quantize.step import Step


def _samples(run):
    return run.samples.pick(run.split.tune)


def when(run) -> bool:
    """the main graph has int8 layers and the tuning samples were decoded"""
    return run.main_int8 and bool(len(_samples(run)))


def samples(run) -> tuple:
    """the tuning samples"""
    return ("tune",) if run.main_int8 else ()


def choose(run) -> None:
    ctx, tune = run.ctx, _samples(run)
    run.used["dynamic inputs"] = len(tune)
    choices = measure(ctx, tune, ctx.threads)
    chosen = frozenset(c.layer for c in choices if c.dynamic)
    run.dynamic = {"gain_db": GAIN_DB, "layers": {c.layer: c.to_dict() for c in choices}}
    if not chosen:
        return
    before = sqnr_db(tune.reference, ctx.score(tune)[0])
    after = sqnr_db(tune.reference, ctx.score(tune, dynamic=chosen)[0])
    run.dynamic.update(output_sqnr_db={"static": round(before, 2), "dynamic": round(after, 2)})
    if after < before:
        run.say(f"note: {len(chosen)} layer(s) measured better with their input quantized at run time, but the "
                f"model is not ({before:.1f} -> {after:.1f} dB on {len(tune)} calibration samples): all static")
        run.dynamic["layers"] = {k: dict(v, dynamic=False) for k, v in run.dynamic["layers"].items()}
        return
    ctx.dynamic = chosen
    run.say(f"{len(chosen)} of {len(choices)} MatMul layer(s) quantize their input at run time (a static range "
            f"holds it at least {GAIN_DB:g} dB worse); output SQNR on {len(tune)} calibration samples "
            f"{before:.1f} -> {after:.1f} dB")
    _weightless_fp32(run, tune, after)


def _weightless_fp32(run, tune, before: float) -> None:
    """The int8 ops left in groups without a weight layer (dynamic.weightless_groups) kept fp32, where the
    model then measures better on the tuning samples."""
    ctx = run.ctx
    ops = [n for n in weightless_groups(ctx.fused, ctx.build().plan) if n not in ctx.exclude]
    if not ops:
        return
    why = "kept fp32: int8 among fp32 ops only, no layer with a weight beside it (its inputs' layers are dynamic)"
    keep = {n: why for n in ops}
    after = sqnr_db(tune.reference, ctx.score(tune, keep)[0])
    run.dynamic["weightless_fp32"] = {"ops": ops, "output_sqnr_db": {"int8": round(before, 2),
                                                                     "fp32": round(after, 2)},
                                      "kept_fp32": bool(after > before)}
    if after > before:
        ctx.exclude.update(keep)
        run.say(f"{len(ops)} op(s) without a weight layer beside them kept fp32: output SQNR {before:.1f} -> "
                f"{after:.1f} dB")


def undo(run) -> None:
    run.ctx.dynamic = frozenset()


def verify(run) -> None:
    if run.ctx.dynamic and len(run.held_out):
        v = run.verify("dynamic inputs", FALLBACK, dynamic=frozenset())
        if v is not None and not v.kept:
            run.ctx.dynamic = frozenset()
            run.dynamic["verified"] = False


FALLBACK = "every layer's input quantized with a static range"
STEP = Step("dynamic inputs", choose, when, samples, fallback=FALLBACK, undo=undo, after=verify)
