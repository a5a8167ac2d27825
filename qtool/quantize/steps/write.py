"""The int8 model written (and run once by ONNX Runtime before it is renamed into place), with what it was
made from inside it: eval and bench refuse to compare it with any other fp32 model."""
from __future__ import annotations

import logging
import time
import warnings

from qtool.modelio import save_model, set_provenance
from qtool.ortcheck import check_runs, zero_feed
from qtool.quantize.inputs import pins
from qtool.quantize.samples import SampleSet
from qtool.quantize.step import Step

INT8 = "model.int8.onnx"


def _runs_once(model, samples: SampleSet, table, fp32_path: str):
    """save_model's check: ONNX Runtime runs the model written once before it is renamed into place
    (ortcheck.py), on the first batch of calibration samples, or without one on zeros at sizes the graph
    takes (the preprocessing's pinned ones first); then it warns once that nothing was measured."""
    if len(samples):
        feed, guess = samples.feeds[0], None  # (its first batch as quantize runs them: a fixed batch fits)
    else:
        warnings.warn("no calibration sample ran, so nothing was measured: the int8 model's output was never "
                      "compared with the fp32 model's (it only ran once, on zeros); check it with `qtool eval`")
        feed, guess = zero_feed(model, pins(table)), fp32_path

    def check(written: str) -> None:
        t0 = time.time()
        check_runs(written, feed, guess)
        logging.getLogger(__name__).debug(f"the int8 model ran once in ONNX Runtime ({time.time() - t0:.2f} s)")
    return check


def write(run) -> None:
    table = run.inputs.table
    run.path = run.options.output or run.wd.file(INT8)
    # (of the bytes the model was built from: the file may have been replaced since)
    set_provenance(run.out.model, fp32_sha256=table.model_sha256, table_sha256=table.sha256)
    run.saved = save_model(run.out.model, run.path, check=_runs_once(run.out.model, run.samples, table,
                                                                     run.inputs.model_path))


STEP = Step("write", write)
