"""Concat: every input requantized to the output's one scale (the range of all of them).

Stays fp32 when
- no input is int8 already: concatenating fp32 tensors is exact and costs nothing, and an
  int8 consumer quantizes the result anyway;
- (once calibrated) the input ranges differ by more than MAX_SPAN_RATIO: one uint8 scale
  would leave the narrowest input log2(ratio) bits fewer. A detector head concatenating box
  offsets with objectness scores in [0, 0.05] is the case: 8 levels left for the score.
"""
import math

from qtool import graph as G
from qtool.qparams import uint8_span

MAX_SPAN_RATIO = 4.0  # two bits


def _check(node, model):
    if any(G.const_value(model, i) is not None for i in node.input):
        return "a constant input"
    return None


def _range_check(node, ranges):
    spans = [uint8_span(ranges[i]) for i in node.input if i in ranges]
    spans = [s for s in spans if s > 0]
    if len(spans) < 2:
        return None
    ratio = max(spans) / min(spans)
    if ratio > MAX_SPAN_RATIO:
        return (f"input ranges differ {ratio:.0f}x: one uint8 scale would leave the narrowest input "
                f"{math.log2(ratio):.1f} bits fewer")
    return None


RULES = {"Concat": dict(kind="compute", act_inputs=lambda n: list(range(len(n.input))), check=_check,
                        range_check=_range_check, int8_input=True)}
