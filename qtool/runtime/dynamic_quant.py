"""Dynamic (run-time) uint8 quantization of an activation, as ONNX's DynamicQuantizeLinear and
ONNX Runtime compute it, and the integer MatMul behind ORT's MatMulIntegerToFloat.

DynamicQuantizeLinear (ONNX Runtime's GetQuantizationParameter, all float32):
    lo = min(min(x), 0), hi = max(max(x), 0)
    scale = (hi - lo) / 255          (1 when hi == lo: an all-zero tensor)
    zp    = round_half_even(clamp(0 - lo / scale, 0, 255))
    y     = clamp(round_half_even(x / scale) + zp, 0, 255)
The MatMul with int8 weights w [K, N] (zero point 0) and per-column (or one) scale s_w:
    acc[m, n] = sum_k (y[m, k] - zp) * w[k, n]        exact int32
    out[m, n] = float32(acc) * float32(scale * s_w[n])  one float32 product, one rounding
"""
from __future__ import annotations

import numpy as np

F32_EXACT = 2 ** 24  # integers up to this magnitude are exact in float32


def dynamic_qparams(x: np.ndarray) -> tuple[np.float32, int]:
    if x.size == 0:
        return np.float32(1.0), 0
    lo = np.minimum(np.float32(x.min()), np.float32(0))
    hi = np.maximum(np.float32(x.max()), np.float32(0))
    if hi == lo:
        return np.float32(1.0), 0
    scale = np.float32((hi - lo) / np.float32(255))
    zp = np.float32(0) - np.float32(lo / scale)
    return scale, int(np.rint(np.clip(zp, np.float32(0), np.float32(255))))


def quantize_u8(x: np.ndarray, scale, zp: int) -> np.ndarray:
    y = np.rint(x.astype(np.float32) / np.float32(scale)) + np.float32(zp)
    return np.clip(y, 0, 255).astype(np.uint8)


def matmul_integer_to_float(y_u8: np.ndarray, zp: int, w_kn: np.ndarray, multiplier: np.ndarray) -> np.ndarray:
    """The reference of the dynamic MatMul: exact int64 sums, one float32 multiply."""
    acc = (y_u8.astype(np.int64) - int(zp)) @ w_kn.astype(np.int64)
    return (acc.astype(np.float32) * multiplier.astype(np.float32)).astype(np.float32)


def k_chunks(w_nk: np.ndarray) -> list[tuple[int, int]]:
    """Split K so that every column's partial sum(x_u8 * w) of a chunk, and the zero-point
    correction, stay within float32's exact integers: 255 * sum(|w|) <= 2^24 per column and chunk.
    Almost always one chunk (384 x int8 weights of mean |w| 32 reach 3.1e6)."""
    a = np.abs(w_nk.astype(np.int64)) * 255
    if np.all(a.sum(axis=1) <= F32_EXACT):
        return [(0, w_nk.shape[1])]
    bounds, start, run = [], 0, np.zeros(w_nk.shape[0], np.int64)
    for k in range(w_nk.shape[1]):
        if np.any(run + a[:, k] > F32_EXACT) and k > start:
            bounds.append((start, k))
            start, run = k, np.zeros_like(run)
        run += a[:, k]
    bounds.append((start, w_nk.shape[1]))
    return bounds
