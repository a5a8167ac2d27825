"""Add of two activations (residual connections): both inputs and the output uint8, each its own range."""
from qtool import graph as G


def _check(node, model):
    if any(G.const_value(model, i) is not None for i in node.input):
        return "one input is a constant (a bias-like Add stays fp32 unless folded)"
    return None


RULES = {"Add": dict(kind="compute", act_inputs=lambda n: [0, 1], check=_check)}
