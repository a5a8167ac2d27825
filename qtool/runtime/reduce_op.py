"""The reduce ops' one wrapper: ONNX's axes as an input (opset 18) or an attribute, noop_with_empty_axes,
keepdims; f(x, axis, keepdims) computes. Shared by fp32_ops and fp32_ops_transformer."""
from __future__ import annotations

import numpy as np


def reducer(f):
    def fn(ins, at):
        x = ins[0]
        axes = ins[1] if len(ins) > 1 and ins[1] is not None else at.get("axes")
        if axes is None or len(axes) == 0:
            if at.get("noop_with_empty_axes", 0):
                return [x]
            axes = None
        else:
            axes = tuple(int(a) for a in axes)
        return [np.asarray(f(x, axis=axes, keepdims=bool(at.get("keepdims", 1)))).astype(x.dtype, copy=False)]
    return fn
