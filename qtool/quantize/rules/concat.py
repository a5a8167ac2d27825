"""Concat: every input uint8 with its own range, the output with the range of all of them."""
from qtool import graph as G


def _check(node, model):
    if any(G.const_value(model, i) is not None for i in node.input):
        return "a constant input"
    return None


RULES = {"Concat": dict(kind="compute", act_inputs=lambda n: list(range(len(n.input))), check=_check)}
