"""Output size of a sliding window (convolution, pooling) along one axis, as ONNX Runtime computes it:
the one rule the native kernels (kernels.conv_out_hw) and the runtime's fp32 ops both follow."""
from __future__ import annotations


def out_size(n: int, k: int, s: int, d: int, head: int, tail: int, ceil_mode: bool = False) -> int:
    """Windows of size k (dilation d, stride s) over n values padded by head and tail. With ceil_mode a
    last window that would start past the input and its head padding is dropped (ONNX Runtime,
    PyTorch), though ONNX's shape inference counts it."""
    span = n + head + tail - ((k - 1) * d + 1)
    o = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (o - 1) * s >= n + head:
        o -= 1
    return o
