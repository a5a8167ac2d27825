"""Ops that move or select uint8 values without changing them: the output keeps the input's
scale and zero point, so they are exact in int8 (ONNX Runtime runs them on uint8 directly)."""

_DATA = lambda n: [0]  # noqa: E731 - the data input; shape/axes inputs stay as they are

RULES = {op: dict(kind="passthrough", act_inputs=_DATA)
         for op in ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "MaxPool", "GlobalMaxPool")}
