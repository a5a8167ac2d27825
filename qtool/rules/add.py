"""Add of two activations (residual connections): both inputs and the output uint8, each its own range.

Stays fp32 when (once calibrated) its inputs span more than MAX_CANCEL_RATIO times its output: they
cancel, and each input's uint8 step, set by its own wide range, is then a large part of the narrow sum.
Keras's LayerNormalization exported below opset 17 ends so: x * (gamma / sigma) + (beta - mean * gamma /
sigma), two terms of +-60 adding to +-4; magika 0.5.1's file-type classifier read 3.6 dB in int8 with that
Add's inputs quantized (18 of 64 files changed type).
"""
import math

from qtool import graph as G
from qtool.qparams import uint8_span

MAX_CANCEL_RATIO = 8.0  # three bits


def _check(node, model):
    if any(G.const_value(model, i) is not None for i in node.input):
        return "one input is a constant (a bias-like Add stays fp32 unless folded)"
    return None


def _range_check(node, ranges):
    ins = [uint8_span(ranges[i]) for i in node.input if i in ranges]
    out = ranges.get(node.output[0])
    if len(ins) < 2 or out is None or uint8_span(out) <= 0:
        return None
    ratio = max(ins) / uint8_span(out)
    if ratio > MAX_CANCEL_RATIO:
        return (f"its inputs span {ratio:.0f}x its output (they cancel): uint8 inputs would leave the sum "
                f"{math.log2(ratio):.1f} bits fewer")
    return None


RULES = {"Add": dict(kind="compute", act_inputs=lambda n: [0, 1], check=_check, range_check=_range_check)}
