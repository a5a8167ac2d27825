"""The steps of `quantize`, in the order they run.

Each step (step.Step, one file in steps/) says when it runs, which calibration samples it reads and
what the model gets if it fails; the runner walks this list on one QuantizeRun (state.py), decodes
exactly the samples the steps on in this run declared (steps/decode.py), and times and contains each
optional step (optional.py). Adding a step is one file in steps/ and one line here.

`python -m qtool.quantize.pipeline --markdown` prints the table docs/design.md holds.
"""
from __future__ import annotations

import sys

from qtool.quantize.step import first_line
from qtool.quantize.steps import (budget, build, decode, dynamic_inputs, encoding_choice, equalization, exclusion,
                                  exclusion_check, guard, input_grid, method_choice, migration, ort_graph,
                                  quantizer_noise, range_tuning, rounding, sensitivity, subgraphs, target_cost,
                                  verified, verify_choice, write)

PIPELINE = (
    budget.STEP,
    decode.STEP,
    method_choice.STEP,
    equalization.STEP,
    verify_choice.STEP,
    dynamic_inputs.STEP,
    migration.STEP,
    input_grid.STEP,
    encoding_choice.STEP,
    rounding.STEP,
    range_tuning.STEP,
    verified.STEP,
    sensitivity.STEP,
    guard.STEP,
    exclusion_check.STEP,
    quantizer_noise.STEP,
    exclusion.STEP,
    build.STEP,
    subgraphs.STEP,
    write.STEP,
    ort_graph.STEP,
    target_cost.STEP,
)
# step -> what the model gets when it fails (a step's verification, run.verify, is the verification step's)
FALLBACKS = {s.name: s.fallback for s in PIPELINE if s.fallback}
LAYER_FALLBACKS = {s.name: s.layer_fallback for s in PIPELINE if s.layer_fallback}


def run_pipeline(run) -> None:
    """Each step of PIPELINE whose `when` holds, in order, on `run`."""
    run.pipeline = PIPELINE
    for step in PIPELINE:
        if step.when(run):
            step.execute(run)


def markdown() -> str:
    """The pipeline as a markdown table: step, when it runs, the samples it reads, its fallback."""
    rows = ["| # | step | file | runs when | reads (calibration samples) | if it fails |", "|---|---|---|---|---|---|"]
    for k, s in enumerate(PIPELINE, 1):
        rows.append(f"| {k} | {s.name} | `steps/{s.run.__module__.rsplit('.', 1)[1]}.py` | {first_line(s.when)} | "
                    f"{first_line(s.samples)} | "
                    f"{s.fallback or 'required: the command fails'} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m qtool.quantize.pipeline --markdown")
    sys.stdout.write(markdown())
