"""--verify: how many held-out samples verified the steps fitted on the others, or why they stay unverified."""
from __future__ import annotations

from qtool.quantize.split import MIN_VERIFY_SAMPLES, VERIFY_EVERY
from qtool.quantize.step import Step


def when(run) -> bool:
    """--verify"""
    return run.options.verify


def record(run) -> None:
    ctx, plain, held_out = run.ctx, run.plain, run.held_out
    if len(held_out) and run.verdicts:
        run.ctx.record_samples("verification", held_out)
    elif not len(held_out) and (run.on.rounding or ctx.method != plain.method or ctx.fused is not plain.fused) \
            and len(run.samples):
        if len(run.files) < MIN_VERIFY_SAMPLES * VERIFY_EVERY:
            run.say(f"note: {len(run.files)} calibration samples are too few to hold {MIN_VERIFY_SAMPLES} out for "
                    f"verifying the steps fitted on them (at least {MIN_VERIFY_SAMPLES * VERIFY_EVERY}); kept unverified")
        else:
            run.say("note: the steps fitted on calibration samples are kept unverified (verifying them on held-out "
                    "samples would take too long for this model: see the budget note above)")


STEP = Step("verified samples", record, when)
