"""Slice, Split, Resize and Pad on uint8 data: the output keeps the input's scale and zero point.

Slice and Split select values (exact). Resize: nearest is exact; linear/cubic interpolate
between uint8 values on the same grid, the result rounded back onto it (at most half a
step of error, as ONNX Runtime's uint8 Resize does). Pad: the pad value must be 0, which
is exactly representable (every activation range contains 0), or a reflect/edge mode.
"""
import numpy as np

from qtool import graph as G

_DATA = lambda n: [0]  # noqa: E731 - starts/ends/axes/split/scales/pads inputs stay as they are


def _pad_check(node, model):
    mode = G.attr(node, "mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "constant":
        return None
    if G.opset(model) < 11:
        v = float(G.attr(node, "value", 0.0))
    elif len(node.input) > 2 and node.input[2]:
        c = G.const_value(model, node.input[2])
        if c is None:
            return "pad value is not a constant"
        v = float(np.asarray(c).ravel()[0]) if c.size else 0.0
    else:
        v = 0.0
    return None if v == 0.0 else f"constant pad value {v:g} is not 0 (not exact in uint8)"


def _resize_check(node, model):
    mode = G.attr(node, "mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in ("nearest", "linear"):
        return f"mode '{mode}' (only nearest and linear Resize run on uint8)"
    return None


RULES = {
    "Slice": dict(kind="passthrough", act_inputs=_DATA),
    "Split": dict(kind="passthrough", act_inputs=_DATA),
    "Resize": dict(kind="passthrough", act_inputs=_DATA, check=_resize_check),
    "Pad": dict(kind="passthrough", act_inputs=_DATA, check=_pad_check),
}
