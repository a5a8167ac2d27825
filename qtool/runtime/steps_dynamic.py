"""Steps of dynamic quantization (arithmetic in dynamic_quant.py): an activation quantized to
uint8 per tensor at run time, and the int8 MatMul that reads it with a packed int8 weight and
writes float32, as ONNX Runtime's DynamicQuantizeLinear and MatMulIntegerToFloat compute.

The GEMM runs on the packed kernel with zero point 0 and multiplier 1 in float32 output mode:
float32(sum(y_u8 * w)), exact while 255 * sum(|w|) <= 2^24 per column (K is split into chunks
where it is not, and the chunks added in float64). The run-time zero point and scale are applied
after, in float32: (acc - zp * sum(w)) is an exact integer, then one multiply by
float32(scale * s_w) per column, so the result is ORT's float32(acc) * multiplier bit for bit."""
from __future__ import annotations

import numpy as np

from qtool.runtime.dynamic_quant import dynamic_qparams, quantize_u8
from qtool.runtime.steps import Step, guarded


class DynamicQuantizeStep(Step):
    """float32 x -> (uint8 y, float32 scale, uint8 zero point), any rank. On the native kernels one
    call does the range and the quantize (qtool.kernels.f32.dynamic_quantize, the same arithmetic).
    With `multiplier` (float32 [n], x's last axis) the tensor quantized is x * multiplier, the float32
    products a Mul before the DynamicQuantizeLinear makes (lower/dynamic.py), not written."""
    mode = "int8"
    uses_out = True

    def __init__(self, name, K, x, y, s, z, multiplier=None):
        super().__init__(name, "DynamicQuantizeLinear", [x], [y, s, z])
        self.F = getattr(K, "f32", None)
        self.native = getattr(K, "quantize_nchw_to_nhwc", None)
        self.m = None if multiplier is None else np.ascontiguousarray(multiplier, np.float32).reshape(-1)
        self.kernel = ("dynamic_quantize" if self.F else "quantize" if self.native else "numpy") \
            + (" (x a Mul by a row)" if self.m is not None else "")

    def run(self, env, out):
        x = env[self.ins[0]]
        y, s, z = out if out else (np.empty(x.shape, np.uint8), np.empty((), np.float32), np.empty((), np.uint8))
        if self.F is not None and x.dtype == np.float32 and x.size:
            if self.m is None:
                self.F.dynamic_quantize(np.ascontiguousarray(x), y, s, z)
            else:
                self.F.dynamic_quantize_scaled(np.ascontiguousarray(x), self.m, y, s, z)
        else:
            if self.m is not None:
                x = (x * self.m).astype(np.float32)
            sc, zp = dynamic_qparams(x)
            s[...], z[...] = sc, zp
            if self.native is not None and x.ndim >= 1 and x.size and x.dtype == np.float32:
                rows = np.ascontiguousarray(x).reshape(1, 1, -1, x.shape[-1])  # one channel: the kernel's row loop
                self.native(rows, float(sc), zp, out=y.reshape(rows.shape[0], rows.shape[2], rows.shape[3], 1))
            else:
                y[...] = quantize_u8(x, sc, zp)
        env[self.outs[0]], env[self.outs[1]], env[self.outs[2]] = y, s, z

    def bind(self, env, out):
        x0 = env[self.ins[0]]
        if self.F is None or out is None or x0.dtype != np.float32 or not x0.flags.c_contiguous or not x0.size:
            return super().bind(env, out)
        fast = (self.F.bind_dynamic_quantize(x0, *out) if self.m is None
                else self.F.bind_dynamic_quantize_scaled(x0, self.m, *out))
        return guarded(env, self.ins, [x0], fast, super().bind(env, out))


class DynamicGemmStep(Step):
    """(uint8 y [..., K], scale, zp) @ int8 w [K, N] (per-column scale s_w) -> float32 [..., N]."""
    mode = "int8"
    uses_out = True

    def __init__(self, name, K, chunks, w_colsum, w_scale, ins, y):
        super().__init__(name, "MatMul", ins, [y])
        self.K, self.chunks = K, chunks  # [(k0, k1, packed)]
        self.F = getattr(K, "f32", None) if len(chunks) == 1 else None
        self.cs = w_colsum.astype(np.float64 if len(chunks) > 1 else np.float32)
        self.sw = w_scale.astype(np.float32)
        self.k = chunks[-1][1]
        self.bias = None  # float32 [N] added last (lower/dynamic.py: a following Add of a constant row)
        self.kernel = f"gemm:{getattr(chunks[0][2], 'kernel', '')} dynamic"

    def run(self, env, out):
        x, s, z = (env[i] for i in self.ins)
        lead = x.shape[:-1]
        x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        n = self.cs.shape[0]
        y = out[0] if out else np.empty(lead + (n,), np.float32)
        y2 = y.reshape(-1, n)
        if self.F is not None:
            self.K.gemm(self.chunks[0][2], x2, out=y2)
            self.F.dynamic_epilogue(y2, np.asarray(s, np.float32), np.asarray(z, np.uint8), self.cs, self.sw, self.bias)
        else:
            y2[...] = dynamic_matmul_reference(self.K, self.chunks, x2, (s, z), (self.cs, self.sw, self.bias))
        env[self.outs[0]] = y

    def bind(self, env, out):
        x, s, z = (env[i] for i in self.ins)
        g = getattr(self.K, "bind_gemm", None)
        if self.F is None or g is None or out is None or not x.flags.c_contiguous or s.dtype != np.float32 \
                or z.dtype != np.uint8:
            return super().bind(env, out)
        n = self.cs.shape[0]
        y2 = out[0].reshape(-1, n)
        gemm = g(self.chunks[0][2], x.reshape(-1, x.shape[-1]), y2)
        epi = self.F.bind_dynamic_epilogue(y2, s, z, self.cs, self.sw, self.bias)

        def step():
            gemm()
            epi()
        return step

    def macs(self, env):
        return int(np.prod(env[self.outs[0]].shape)) * self.k


def dynamic_matmul_reference(K, chunks, x2, qp, w):
    """The numpy form of the step (any backend, K split in chunks): float32 sums of x_u8 * w per chunk,
    exact; the chunks added in float64; minus zp * colsum; times float32(scale * s_w); plus the bias."""
    (s, z), (cs, sw, bias) = qp, w
    zp = int(np.asarray(z).reshape(()))
    if len(chunks) == 1:
        acc = K.gemm(chunks[0][2], x2)
        acc -= np.float32(zp) * cs.astype(np.float32)  # exact: both are integers below 2^24
    else:
        acc = sum(K.gemm(p, np.ascontiguousarray(x2[:, k0:k1])).astype(np.float64) for k0, k1, p in chunks)
        acc = (acc - zp * cs).astype(np.float32)
    acc *= np.float32(np.asarray(s).reshape(())) * sw
    if bias is not None:  # a following Add of a constant row, fused
        acc += bias
    return acc
