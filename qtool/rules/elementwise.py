"""Elementwise activations and products: Sigmoid, HardSigmoid, and Mul of two activations.

Sigmoid and HardSigmoid: x uint8 in, output uint8 with its own range (ONNX Runtime runs
QLinearSigmoid as a 256-entry table). Mul of two activations (SiLU = x * Sigmoid(x), the
gate of a squeeze-and-excitation block, hard-swish's x * Clip(x + 3, 0, 6)): both inputs
and the output uint8, each its own range (QLinearMul). A Mul by a constant is a scale the
graph passes fold into the producer where they can; one that is left stays fp32.
"""
from qtool import graph as G


def _mul_check(node, model):
    if any(G.const_value(model, i) is not None for i in node.input):
        return "one input is a constant (a scale left unfolded stays fp32)"
    return None


RULES = {
    "Sigmoid": dict(kind="compute", act_inputs=lambda n: [0]),
    "HardSigmoid": dict(kind="compute", act_inputs=lambda n: [0]),
    "Mul": dict(kind="compute", act_inputs=lambda n: [0, 1], check=_mul_check),
}
