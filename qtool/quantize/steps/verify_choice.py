"""--verify: method choice and channel balancing kept only where they measure better on held-out samples."""
from __future__ import annotations

from qtool.quantize.context import QuantizeContext
from qtool.quantize.samples import SampleSet
from qtool.quantize.step import Step
from qtool.quantize.verify import verify_step


def verify_choice(ctx: QuantizeContext, plain: QuantizeContext, held_out: SampleSet, verdicts: dict, say=print) -> None:
    """Method choice and channel balancing kept only where ctx's model measures better than `plain`'s (the
    calibrated table's unclipped method, channels as they were) on held-out samples (verify.py); else
    ctx goes back to plain's."""
    if not len(held_out):
        return
    chose, balanced = ctx.method != plain.method, ctx.fused is not plain.fused
    step = " and ".join(([f"method choice ({ctx.method})"] if chose else []) + (["channel balancing"] if balanced else []))
    fallback = f"{plain.method}" + (", channels not balanced" if balanced else "")
    v = verify_step(ctx, held_out, step, fallback, say, without=plain)
    verdicts[step] = v
    if not v.kept:
        ctx.fused, ctx.table, ctx.weight_cache, ctx.method = plain.fused, plain.table, plain.weight_cache, plain.method


def when(run) -> bool:
    """--verify, held-out samples, and method choice or balancing changed the model"""
    ctx, plain = run.ctx, run.plain
    return bool(len(run.held_out)) and (ctx.method != plain.method or ctx.fused is not plain.fused)


def check(run) -> None:
    verify_choice(run.ctx, run.plain, run.held_out, run.verdicts, run.say)


STEP = Step("verification", check, when, fallback="the step kept unverified")
