"""Tensors that hold an infinity stay out of int8: the ops that write or read them run fp32.

An attention mask added to the scores before a Softmax holds -inf (PyTorch's masked_fill) or a float's
lowest value standing in for it (Hugging Face's `finfo.min`, -3.4e38). A quantizer clamps -inf to its
range's end, a few units below the scores, so the Softmax weighs the masked positions again; a range
stretched to -3.4e38 rounds every score to zero. Either way no range can hold the tensor: chython's
reaction mapper (one attention layer applied 7 times, each mask Add alone in int8 leaving the output at
6.2 dB) read 5.3 dB with them int8 and 19.6 dB with them fp32. Calibration leaves NaN/inf out of every
range and counts them per tensor (calibrate/run.py check_nonfinite); a finite stand-in shows in the range.
"""
from __future__ import annotations

import math

UNBOUNDED = 1e30  # a range end beyond this stands for an infinity: no activation of a trained network gets near


def unbounded_tensors(table) -> dict:
    """tensor -> what it holds, for the tensors calibration saw NaN/inf in or whose range reaches UNBOUNDED."""
    out = {t: "held NaN/inf in calibration" for t in (table.nonfinite or {})}
    for ranges in table.ranges.values():
        for t, r in ranges.items():
            if t in out or not r:
                continue
            edge = max(abs(float(r[0])), abs(float(r[1])))
            if not math.isfinite(edge) or edge >= UNBOUNDED:
                out[t] = f"reaches {edge:.1e} in calibration, a stand-in for infinity"
    return out


def unbounded_exclusions(model, table) -> tuple:
    """(node -> reason, tensor -> what it holds): every top-level node that writes or reads an unbounded
    tensor. (The reason names no tensor, so that the summary counts such ops under one line.)"""
    held = unbounded_tensors(table)
    out = {}
    for node in model.graph.node:
        for t in list(node.output) + list(node.input):
            if t and t in held:
                out[node.name] = (f"reads or writes a tensor that {held[t].split(' in calibration')[0]} in "
                                  f"calibration (an attention mask's infinity?): a quantizer would clamp it")
                break
    return out, held
