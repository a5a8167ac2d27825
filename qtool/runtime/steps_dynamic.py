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
from qtool.runtime.steps import Step


class DynamicQuantizeStep(Step):
    """float32 x -> (uint8 y, float32 scale, uint8 zero point), any rank."""
    mode = "int8"
    uses_out = False

    def __init__(self, name, K, x, y, s, z):
        super().__init__(name, "DynamicQuantizeLinear", [x], [y, s, z])
        self.native = getattr(K, "quantize_nchw_to_nhwc", None)
        self.kernel = "quantize" if self.native else "numpy"

    def run(self, env, out):
        x = env[self.ins[0]]
        s, z = dynamic_qparams(x)
        if self.native is not None and x.ndim >= 1 and x.size and x.dtype == np.float32:
            rows = np.ascontiguousarray(x).reshape(1, 1, -1, x.shape[-1])  # one channel: the kernel's row loop
            y = self.native(rows, float(s), z).reshape(x.shape)
        else:
            y = quantize_u8(x, s, z)
        env[self.outs[0]], env[self.outs[1]], env[self.outs[2]] = y, np.asarray(s, np.float32), np.asarray(z, np.uint8)


class DynamicGemmStep(Step):
    """(uint8 y [..., K], scale, zp) @ int8 w [K, N] (per-column scale s_w) -> float32 [..., N]."""
    mode = "int8"
    uses_out = False

    def __init__(self, name, K, chunks, w_colsum, w_scale, ins, y):
        super().__init__(name, "MatMul", ins, [y])
        self.K, self.chunks = K, chunks  # [(k0, k1, packed)]
        self.cs = w_colsum.astype(np.float64 if len(chunks) > 1 else np.float32)
        self.sw = w_scale.astype(np.float32)
        self.k = chunks[-1][1]
        self.bias = None  # float32 [N] added last (lower/dynamic.py: a following Add of a constant row)
        self.kernel = f"gemm:{getattr(chunks[0][2], 'kernel', '')} dynamic"

    def run(self, env, out):
        x, s, z = (env[i] for i in self.ins)
        lead = x.shape[:-1]
        x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        zp = int(np.asarray(z).reshape(()))
        if len(self.chunks) == 1:
            acc = self.K.gemm(self.chunks[0][2], x2)
            acc -= np.float32(zp) * self.cs  # exact: both are integers below 2^24
        else:
            acc = sum(self.K.gemm(p, np.ascontiguousarray(x2[:, k0:k1])).astype(np.float64)
                      for k0, k1, p in self.chunks)
            acc = (acc - zp * self.cs).astype(np.float32)
        acc *= np.float32(np.asarray(s).reshape(())) * self.sw
        if self.bias is not None:  # a following Add of a constant row, fused
            acc += self.bias
        env[self.outs[0]] = acc.reshape(lead + (acc.shape[-1],))

    def macs(self, env):
        return int(np.prod(env[self.outs[0]].shape)) * self.k
