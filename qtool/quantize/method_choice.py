"""Choosing a range method by measurement: the int8 output each method gives, against fp32.

Meant for calibration samples, so the choice never looks at evaluation data.
"""
from __future__ import annotations

from qtool.calibrate.methods import METHODS
from qtool.metrics import sqnr_db
from qtool.quantize.qdq import quantize_graph
from qtool.quantize.sensitivity import run_first_output


def method_scores(fused, table, feeds: list, methods=None, threads: int = 2, bias_correction: bool = True) -> dict:
    """Output SQNR (dB, first output, over `feeds`) of the int8 model each range method gives,
    against the fused fp32 graph ("pick what measures best", per model)."""
    ref = run_first_output(fused, feeds, threads)
    return {m: sqnr_db(ref, run_first_output(quantize_graph(fused, table, m, bias_correction=bias_correction).model,
                                             feeds, threads))
            for m in methods or METHODS}
