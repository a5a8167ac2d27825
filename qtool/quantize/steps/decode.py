"""The calibration samples the steps on in this run read, decoded with the calibration's preprocessing
and run through the fp32 graph once (samples.load_samples)."""
from __future__ import annotations

from qtool.quantize.inputs import labels_for
from qtool.quantize.progress import bar
from qtool.quantize.samples import load_samples
from qtool.quantize.step import Step


def announce(run) -> None:
    """What is decoded, or why nothing is; the user's labels file is read before any step, so an error
    in it stays an error."""
    on = run.on
    run.need = run.wanted()
    if run.need:
        run.say(f"decoding {len(run.need)} calibration images and running fp32 on them once")
    elif on.auto or on.rounding or on.tune_ranges or on.sensitivity:
        run.say("note: no calibration images recorded in the working directory; method choice, output-aware "
                "rounding, range tuning and sensitivity skipped")
    if on.exclusion:
        run.labels = labels_for(run.files, run.options.exclusion.labels,
                                run.manifest.get("calibrate", {}).get("data"))


def decode(run) -> None:
    with bar(2 * len(run.need), "step", "decode + fp32", run.progress and bool(run.need)) as pb:
        run.samples = load_samples(run.inputs.fused, run.inputs.table, run.need, progress=pb.update)


def size_tuning(run) -> None:
    run.tuning.samples = len(run.tune_samples)


STEP = Step("calibration samples", decode, fallback="no calibration samples: the steps below skipped",
            before=announce, after=size_tuning)
