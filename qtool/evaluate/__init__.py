"""`eval`: int8 against fp32 on the same inputs: accuracy, agreement, output error, size, speed.

Labels are optional: every output gets SQNR (dB) and max abs error, and the figures of what it is
(kinds/, one module per kind: a classifier's top-1 agreement, a sequence's per position and after greedy
CTC decoding, a detector's top-scoring rows, an embedding's cosine; maps and features none more: an argmax
over their flattened values means nothing). Only a classifier's outputs are kept for the whole run (labels,
top-5); everything else streams. Images (with the calibration preprocessing, images.py) or tensors (.npy /
.npz folders, iterables: tensors.py) both work; from_workdir.py takes what it is not given from the working
directory. timing.py times both models on ONNX Runtime; exact.py checks ORT's int8 output against the exact
int8 arithmetic.

    evaluate_workdir -> evaluate (images) | evaluate_tensors -> OutputStats per output -> kinds.KINDS
"""
from __future__ import annotations

from qtool.evaluate.batching import batch_for_memory, eval_batch
from qtool.evaluate.exact import CHECK_MIN_DB, CHECK_MIN_DB_WITH_FLOAT_OPS, CHECK_SAMPLES, ExactCheck, check_warning
from qtool.evaluate.from_workdir import evaluate_workdir
from qtool.evaluate.images import evaluate
from qtool.evaluate.kinds.detector import row_scores
from qtool.evaluate.kinds.sequence import ctc_agreement
from qtool.evaluate.options import EvalOptions
from qtool.evaluate.states import recurrent_states
from qtool.evaluate.stats import OutputStats
from qtool.evaluate.tensors import evaluate_tensors

__all__ = ["CHECK_MIN_DB", "CHECK_MIN_DB_WITH_FLOAT_OPS", "CHECK_SAMPLES", "EvalOptions", "ExactCheck",
           "OutputStats", "batch_for_memory", "check_warning", "ctc_agreement", "eval_batch", "evaluate",
           "evaluate_tensors", "evaluate_workdir", "recurrent_states", "row_scores"]
