"""The samples --exclude-sensitive checks its exclusions on: those held back from the sensitivity analysis,
or, where fewer than MIN_HELD_BACK are, every calibration sample (and the user is told)."""
from __future__ import annotations

from qtool.quantize.split import MIN_HELD_BACK
from qtool.quantize.step import Step


def when(run) -> bool:
    """--exclude-sensitive, and the sensitivity analysis ranked some layer"""
    return run.on.exclusion and bool(run.ranking)


def pick(run) -> None:
    check, held = run.samples.pick(run.split.held_back), True
    if len(check) < MIN_HELD_BACK:
        every = run.samples.pick(run.files)
        if len(check):
            run.say(f"note: only {len(check)} calibration images held back from the sensitivity analysis (fewer "
                    f"than {MIN_HELD_BACK}); checking exclusions on all {len(every)} calibration images")
        else:
            run.say(f"note: the sensitivity analysis used all {len(every)} calibration images, so none is held "
                    f"back: the exclusions are checked on the same images (calibrate on "
                    f"{len(run.sens_samples) + MIN_HELD_BACK} or more for an independent check)")
        check, held = every, False
    run.check, run.check_held_back = check, held
    run.ctx.record_samples("exclusion check", check)


STEP = Step("exclusion check", pick, when)
