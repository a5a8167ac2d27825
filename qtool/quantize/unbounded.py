"""Tensors that hold an infinity stay out of int8: the ops that write or read them run fp32.

An attention mask added to the scores before a Softmax holds -inf (PyTorch's masked_fill) or a float's
lowest value standing in for it (Hugging Face's `finfo.min`, -3.4e38). A quantizer clamps -inf to its
range's end, a few units below the scores, so the Softmax weighs the masked positions again; a range
stretched to -3.4e38 rounds every score to zero. Either way no range can hold the tensor: chython's
reaction mapper (one attention layer applied 7 times, each mask Add alone in int8 leaving the output at
6.2 dB) read 5.3 dB with them int8 and 19.6 dB with them fp32. Calibration leaves NaN/inf out of every
range and counts them per tensor (calibrate/run.py check_nonfinite); a finite stand-in shows in the range.
Only an infinity the graph itself puts there counts (a constant holding one, and what it reaches): one inf in
one corrupt calibration sample spreads through every layer after it, and must cost that sample, not the
int8 model.
"""
from __future__ import annotations

import math

import numpy as np

from qtool import graph as G

MAX_SCANNED = 1 << 16  # constants larger than this are weights, not masks: not scanned
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


def infinite_constants(model) -> set:
    """Tensors the graph sets to an infinity or its stand-in: small initializers, Constant and
    ConstantOfShape outputs holding a value at or beyond UNBOUNDED."""
    prods, inits = G.producers(model), G.initializers(model)
    names = list(inits) + [n.output[0] for n in model.graph.node if n.op_type in ("Constant", "ConstantOfShape")]
    out = set()
    for name in names:
        v = G.small_constant(model, name, prods, MAX_SCANNED, inits)
        if v is not None and v.dtype.kind == "f" and v.size and not np.all(np.abs(v) < UNBOUNDED):
            out.add(name)
    return out


def _reached(model, sources: set) -> set:
    """Every tensor computed from `sources` (graph order: a node's inputs are written before it)."""
    out = set(sources)
    for n in model.graph.node:
        if any(i in out for i in G.node_reads(n)):
            out.update(o for o in n.output if o)
    return out


def unbounded_exclusions(model, table) -> tuple:
    """(node -> reason, tensor -> what it holds): every top-level node that writes or reads a tensor
    holding an infinity the graph puts there. (The reason names no tensor, so that the summary counts
    such ops under one line.)"""
    held = unbounded_tensors(table)
    sources = infinite_constants(model) if held else set()
    reached = _reached(model, sources) if sources else set()
    held = {t: why for t, why in held.items() if t in reached}
    out = {}
    for node in model.graph.node:
        for t in list(node.output) + list(node.input):
            if t and t in held:
                out[node.name] = (f"reads or writes a tensor that {held[t].split(' in calibration')[0]} in "
                                  f"calibration (an attention mask's infinity?): a quantizer would clamp it")
                break
    return out, held
