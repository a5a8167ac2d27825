"""Conv (regular, grouped, depthwise): x uint8, W int8 per output channel (axis 0), bias int32.

ConvTranspose (1-D, 2-D): the same, its W [Cin, Cout, k...] per output channel along axis 1.
ONNX Runtime's CPU provider has no int8 kernel for it: it runs DequantizeLinear -> float
ConvTranspose -> QuantizeLinear, so the int8 weights buy a quarter of the bytes at the cost of
the rounding, and no int16 pair sums are involved (encoding.pair_partners). A grouped one stays
fp32: its output channels are spread over W's two first axes, no one axis to scale along.
"""
from qtool import graph as G


def _check(node, model):
    if G.const_value(model, node.input[1]) is None:
        return "weight is not a constant"
    if len(node.input) > 2 and node.input[2] and G.const_value(model, node.input[2]) is None:
        return "bias is not a constant"
    return None


def _transpose_check(node, model):
    if G.attr(node, "group", 1) != 1:
        return "grouped ConvTranspose: its output channels lie along two weight axes, no one per-channel axis"
    w = G.const_value(model, node.input[1])
    if w is not None and w.ndim not in (3, 4):
        return f"{w.ndim - 2}-D ConvTranspose: only 1-D and 2-D ones are int8"
    return _check(node, model)


RULES = {
    "Conv": dict(kind="compute", act_inputs=lambda n: [0], weight=lambda n, m: (1, 0), bias=2, check=_check),
    "ConvTranspose": dict(kind="compute", act_inputs=lambda n: [0], weight=lambda n, m: (1, 1), bias=2,
                          check=_transpose_check),
}
