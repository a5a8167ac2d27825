"""Conv (regular, grouped, depthwise): x uint8, W int8 per output channel (axis 0), bias int32."""
from qtool import graph as G


def _check(node, model):
    if G.const_value(model, node.input[1]) is None:
        return "weight is not a constant"
    if len(node.input) > 2 and node.input[2] and G.const_value(model, node.input[2]) is None:
        return "bias is not a constant"
    return None


RULES = {"Conv": dict(kind="compute", act_inputs=lambda n: [0], weight=lambda n, m: (1, 0), bias=2, check=_check)}
