"""Ops that move or select uint8 values without changing them: the output keeps the input's
scale and zero point, so they are exact in int8 (ONNX Runtime runs them on uint8 directly)."""

_DATA = lambda n: [0]  # noqa: E731 - the data input; shape/axes inputs stay as they are

# Gather/GatherElements/Expand/Tile/DepthToSpace/SpaceToDepth copy values; ReduceMax/ReduceMin select one
# (the uint8 map is increasing, so the max of the codes is the code of the max). ONNX Runtime 1.32 drops the
# Q/DQ around all of them but SpaceToDepth and GlobalMaxPool, which it runs in float on the same grid: exact too.
RULES = {op: dict(kind="passthrough", act_inputs=_DATA)
         for op in ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "MaxPool", "GlobalMaxPool",
                    "Gather", "GatherElements", "Expand", "Tile", "DepthToSpace", "SpaceToDepth",
                    "ReduceMax", "ReduceMin")}
