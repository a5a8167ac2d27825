"""The int8 MatMul of two activations (attention's Q K^T and probabilities x V): both inputs uint8
per tensor, any batch dimensions (broadcast as MatMul does), as ONNX Runtime's QLinearMatMul
(uint8 output) or MatMulIntegerToFloat (float output) compute it:
    acc = sum_k (a - a_zp) * (b - b_zp)                      exact int32
    uint8 out: clip(rint(float32(acc) * float32(float32(a_s * b_s) / y_s)) + y_zp)   (qparams.requantize)
    float out: float32(acc) * float32(a_s * b_s)
The sums run as a float BLAS batched matmul on the zero-point-shifted values: every partial sum is an
integer of magnitude <= 255 * 255 * K, exact in float32 up to K = 258 and in float64 beyond."""
from __future__ import annotations

import numpy as np

from qtool.qparams import requantize
from qtool.runtime.steps import Step

F32_MAX_K = (2 ** 24) // (255 * 255)


def qmatmul_acc(a: np.ndarray, a_zp: int, b: np.ndarray, b_zp: int) -> np.ndarray:
    """int32 accumulators of (a - a_zp) @ (b - b_zp), uint8 inputs in ONNX layout."""
    ft = np.float32 if a.shape[-1] <= F32_MAX_K else np.float64
    fa = a.astype(ft)
    fa -= ft(a_zp)
    fb = b.astype(ft)
    fb -= ft(b_zp)
    return np.matmul(fa, fb).astype(np.int32)


def qmatmul_reference(a, a_zp, b, b_zp, multiplier, y_zp=None, lo=0, hi=255):
    """The exact integer form (int64 sums), for the tests: uint8 out when y_zp is given, else float32."""
    acc = np.matmul(a.astype(np.int64) - a_zp, b.astype(np.int64) - b_zp).astype(np.int32)
    if y_zp is None:
        return acc.astype(np.float32) * np.float32(multiplier)
    return requantize(acc, multiplier, y_zp, lo, hi)


class QMatMulStep(Step):
    """uint8 a @ uint8 b -> uint8 (requantized, clamp lo..hi) or float32. NHWC-stored rank-4 inputs
    are read in ONNX order (a transposed view)."""
    mode = "int8"
    uses_out = False

    def __init__(self, name, a, b, y, qa, qb, out):
        """qa/qb: (zp, stored NHWC); out: (multiplier, y_zp or None, lo, hi)."""
        super().__init__(name, "MatMul", [a, b], [y])
        self.qa, self.qb = qa, qb
        self.mult = np.float32(out[0])
        self.y_zp, self.lo, self.hi = out[1], out[2], out[3]
        self.kernel = "blas-int"

    @staticmethod
    def _onnx(x, nhwc):
        return x.transpose(0, 3, 1, 2) if nhwc and x.ndim == 4 else x

    def run(self, env, out):
        a = self._onnx(env[self.ins[0]], self.qa[1])
        b = self._onnx(env[self.ins[1]], self.qb[1])
        acc = qmatmul_acc(a, self.qa[0], b, self.qb[0])
        if self.y_zp is None:
            y = acc.astype(np.float32)
            y *= self.mult
        else:
            y = requantize(acc, self.mult, self.y_zp, self.lo, self.hi)
        env[self.outs[0]] = y

    def macs(self, env):
        a = env[self.ins[0]]
        return int(np.prod(env[self.outs[0]].shape)) * int(a.shape[-1] if not (self.qa[1] and a.ndim == 4) else a.shape[1])
