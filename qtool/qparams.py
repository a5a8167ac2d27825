"""The one place that owns scale, zero point, rounding and clipping.

Fixed scheme (DEVELOPERS.md): activations uint8 asymmetric per tensor, weights int8
symmetric per output channel (zero point 0, range [-127, 127] so that two u8 x s8
products never overflow int16 on the AVX2 path), bias int32 with scale s_in * s_w.
Rounding is half to even everywhere, as ONNX Runtime's QuantizeLinear does, and all
arithmetic is float32 so that numpy, the C kernels and ONNX Runtime agree bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

U8_MIN, U8_MAX = 0, 255
W_MAX = 127  # symmetric int8 weights use [-127, 127]
I32_MIN, I32_MAX = -(2 ** 31), 2 ** 31 - 1


@dataclass(frozen=True)
class ActQParams:
    """uint8 asymmetric parameters of one activation tensor."""

    scale: float
    zero_point: int

    @property
    def lo(self) -> float:
        return float(np.float32(self.scale) * np.float32(U8_MIN - self.zero_point))

    @property
    def hi(self) -> float:
        return float(np.float32(self.scale) * np.float32(U8_MAX - self.zero_point))


def uint8_span(r) -> float:
    """The width a uint8 grid spends on range r = (lo, hi): widened to contain 0, as activation_qparams does."""
    return max(float(r[1]), 0.0) - min(float(r[0]), 0.0)


def activation_qparams(lo: float, hi: float) -> ActQParams:
    """Scale and zero point for a float range; the range is widened to contain 0 so
    that zero (padding, Relu) is exactly representable."""
    lo = min(float(lo), 0.0)
    hi = max(float(hi), 0.0)
    if not np.isfinite(lo) or not np.isfinite(hi):
        raise ValueError(f"activation range is not finite: [{lo}, {hi}]")
    if hi - lo < 1e-8:
        return ActQParams(1.0, 0)
    scale = np.float32((hi - lo) / (U8_MAX - U8_MIN))
    zp = int(np.clip(np.rint(U8_MIN - lo / float(scale)), U8_MIN, U8_MAX))
    return ActQParams(float(scale), zp)


def clip_to_flat(lo: float, hi: float, flat_lo: float | None, flat_hi: float | None) -> tuple[float, float]:
    """[lo, hi] narrowed to where the tensor's readers are not constant (hard-swish is 0 below -3,
    hard-sigmoid is flat outside [-3, 3]): nothing beyond those ends changes an output, so the range
    spends no steps there. Each clipped end keeps one step beyond it, so that the grid point values
    past it land on is itself past it (hard-swish(-2.99) is -0.005, not 0: a range ending at -3 that
    rounded to -2.99 would move the mean of every later layer). Ends that are not flat stay."""
    lo, hi = float(lo), float(hi)
    cut_lo = flat_lo is not None and flat_lo <= 0.0 and lo < flat_lo
    cut_hi = flat_hi is not None and flat_hi >= 0.0 and hi > flat_hi
    span = U8_MAX - U8_MIN
    if cut_lo and cut_hi:  # s = (b - a + 2 s) / 255
        s = (flat_hi - flat_lo) / (span - 2)
        lo2, hi2 = flat_lo - s, flat_hi + s
    elif cut_lo:  # L = a - (H - L) / 255
        lo2, hi2 = (span * flat_lo - hi) / (span - 1), hi
    elif cut_hi:
        lo2, hi2 = lo, (span * flat_hi - lo) / (span - 1)
    else:
        return lo, hi
    return lo2, hi2  # (a range ending less than a step past its flat end widens by up to that step)


def weight_scales(w: np.ndarray, axis: int = 0, w_max: int = W_MAX) -> np.ndarray:
    """Per-output-channel symmetric scales (float32, one per index of `axis`); `w_max` < 127 for
    narrower weights (ONNX Runtime's reduce_range uses 7 bits)."""
    w = np.moveaxis(np.asarray(w, np.float32), axis, 0).reshape(w.shape[axis], -1)
    absmax = np.abs(w).max(axis=1) if w.shape[1] else np.zeros(w.shape[0], np.float32)
    scale = (absmax / np.float32(w_max)).astype(np.float32)
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)


def _bcast(v: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = -1
    return np.asarray(v).reshape(shape)


def quantize_weight(w: np.ndarray, scale: np.ndarray, axis: int = 0, w_max: int = W_MAX) -> np.ndarray:
    """int8 weights, rounded half to even and clipped to [-w_max, w_max] ([-127, 127])."""
    s = _bcast(np.asarray(scale, np.float32), w.ndim, axis)
    return np.clip(np.rint(np.asarray(w, np.float32) / s), -w_max, w_max).astype(np.int8)


def dequantize_weight(q: np.ndarray, scale: np.ndarray, axis: int = 0) -> np.ndarray:
    return q.astype(np.float32) * _bcast(np.asarray(scale, np.float32), q.ndim, axis)


def quantize_bias(b: np.ndarray, s_in: float, s_w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int32 bias and its scale s_in * s_w (float32), as ONNX Runtime's QDQ quantizer writes it."""
    scale = (np.float32(s_in) * np.asarray(s_w, np.float32)).astype(np.float32)
    q = np.clip(np.rint(np.asarray(b, np.float64) / scale.astype(np.float64)), I32_MIN, I32_MAX)
    return q.astype(np.int32), scale


def quantize(x: np.ndarray, qp: ActQParams) -> np.ndarray:
    """ONNX QuantizeLinear to uint8: saturate(round_half_even(x / scale) + zero_point)."""
    y = np.rint(np.asarray(x, np.float32) / np.float32(qp.scale)) + np.float32(qp.zero_point)
    return np.clip(y, U8_MIN, U8_MAX).astype(np.uint8)


def dequantize(q: np.ndarray, qp: ActQParams) -> np.ndarray:
    return ((q.astype(np.int32) - qp.zero_point).astype(np.float32) * np.float32(qp.scale)).astype(np.float32)


def fake_quantize(x: np.ndarray, qp: ActQParams) -> np.ndarray:
    return dequantize(quantize(x, qp), qp)


def requantize(acc: np.ndarray, multiplier: np.ndarray, zero_point: int,
               lo: int = U8_MIN, hi: int = U8_MAX) -> np.ndarray:
    """int32 accumulator -> uint8 through a float32 multiplier (s_in * s_w / s_out),
    rounded half to even: the epilogue every native kernel and its reference share.
    `lo`/`hi` narrow the clamp for a fused Relu/Clip."""
    y = np.rint(acc.astype(np.float32) * np.asarray(multiplier, np.float32)) + np.float32(zero_point)
    return np.clip(y, lo, hi).astype(np.uint8)
