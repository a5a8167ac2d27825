"""Executable steps of a compiled plan.

A step reads its inputs from `env` (a list indexed by value slot) and writes its outputs
there. `run(env, out)` gets `out`, the list of preallocated output buffers the planner gave it,
or None during the first (tracing) run for a new input shape, when it allocates. Int8 tensors
of rank 4 are NHWC uint8; everything else keeps ONNX's layout.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from qtool.kernel_params import BinaryQuant, PoolWindow
from qtool.runtime.fp32_ops import FP32_OPS, conv_pads


@dataclass(frozen=True)
class OutQuant:
    """Where an int8 step's uint8 output lands: the scale and zero point of the QuantizeLinear it
    absorbs, and the clamp [lo, hi] a fused Relu/Clip sets."""
    scale: np.float32
    zp: int
    lo: int = 0
    hi: int = 255


class Step:
    mode = "int8"        # 'int8' | 'fp32' | 'convert'
    uses_out = True      # writes into planner-given buffers
    is_view = False      # output 0 aliases input 0 (set during tracing)

    def __init__(self, name, op, ins, outs):
        self.name, self.op, self.ins, self.outs = name, op, list(ins), list(outs)
        self.kernel = ""

    def macs(self, env) -> int:
        return 0

    def run(self, env, out):
        raise NotImplementedError

    def bind(self, env, out):
        """A no-argument callable doing this step on the plan's fixed buffers. Int8 steps use
        the kernels' bind_* (a functools.partial of the C function, arguments checked once)."""
        return functools.partial(self.run, env, out)


def guarded(env, slots, bound_to, fast, slow):
    """A call running `fast` (a kernel pre-bound to the arrays `bound_to`) while every slot still holds
    its array (a producer writing a plan buffer), else `slow` (a numpy producer's new array each run)."""
    if fast is None:
        return slow
    pairs = [(i, a) for i, a in zip(slots, bound_to) if i is not None]

    def step():
        for i, a in pairs:
            if env[i] is not a:
                slow()
                return
        fast()
    return step


# ---------------------------------------------------------------- boundaries and layout

class QuantizeStep(Step):
    """float32 -> uint8 (QuantizeLinear), NCHW -> NHWC for rank 4."""
    mode = "convert"

    def __init__(self, name, x, y, scale, zp, nhwc, K=None, shift: float = 0.0):
        super().__init__(name, "QuantizeLinear", [x], [y])
        self.inv = np.float32(scale)
        self.zp = np.float32(zp)
        self.nhwc = nhwc
        self.shift = np.float32(shift)  # added first, in float32 (a model input moved onto the grid)
        self.tmp = {}
        self.native = getattr(K, "quantize_nchw_to_nhwc", None)
        self.kernel = "native" if self.native else "numpy"

    def run(self, env, out):
        x = env[self.ins[0]]
        if self.shift and x.dtype == np.float32:  # (the same float32 sum as ORT's Add before its QuantizeLinear)
            t = self.tmp.get(("shift", x.shape))
            if t is None:
                t = self.tmp[("shift", x.shape)] = np.empty(x.shape, np.float32)
            x = np.add(x, self.shift, out=t)
        if self.native is not None and self.nhwc and x.ndim == 4 and x.dtype == np.float32 and x.flags.c_contiguous:
            env[self.outs[0]] = self.native(x, self.inv, int(self.zp), out=out[0] if out else None)
            return
        if self.native is not None and not (self.nhwc and x.ndim == 4) and x.ndim >= 1 and x.size and x.dtype == np.float32 \
                and x.flags.c_contiguous:  # one channel of rows: the kernel's vectorized row loop, no transpose
            rows = x.reshape(1, 1, -1, x.shape[-1])
            y = out[0] if out else np.empty(x.shape, np.uint8)
            self.native(rows, self.inv, int(self.zp), out=y.reshape(1, rows.shape[2], rows.shape[3], 1))
            env[self.outs[0]] = y
            return
        if self.nhwc and x.ndim == 4:
            x = x.transpose(0, 2, 3, 1)
        t = self.tmp.get(x.shape)
        if t is None:
            t = self.tmp[x.shape] = np.empty(x.shape, np.float32)
        np.divide(x, self.inv, out=t)
        np.rint(t, out=t)
        t += self.zp
        np.clip(t, 0, 255, out=t)
        y = out[0] if out else np.empty(x.shape, np.uint8)
        np.copyto(y, t, casting="unsafe")
        env[self.outs[0]] = y


class DequantizeStep(Step):
    """uint8 (NHWC if rank 4 and nhwc) -> float32 in ONNX layout."""
    mode = "convert"

    def __init__(self, name, x, y, scale, zp, nhwc, K=None):
        super().__init__(name, "DequantizeLinear", [x], [y])
        self.scale, self.zp, self.nhwc = np.float32(scale), np.float32(zp), nhwc
        self.native = getattr(K, "dequantize_nhwc_to_nchw", None)
        self.kernel = "native" if self.native else "numpy"

    def run(self, env, out):
        x = env[self.ins[0]]
        if self.native is not None and self.nhwc and x.ndim == 4:
            env[self.outs[0]] = self.native(x, self.scale, int(self.zp), out=out[0] if out else None)
            return
        if self.native is not None and not (self.nhwc and x.ndim == 4) and x.ndim >= 1 and x.size and x.flags.c_contiguous:
            rows = x.reshape(1, -1, x.shape[-1], 1)  # one channel: NHWC [1, rows, cols, 1] = NCHW [1, 1, rows, cols]
            y = out[0] if out else np.empty(x.shape, np.float32)
            self.native(rows, self.scale, int(self.zp), out=y.reshape(1, 1, rows.shape[1], rows.shape[2]))
            env[self.outs[0]] = y
            return
        if self.nhwc and x.ndim == 4:
            x = x.transpose(0, 3, 1, 2)
        y = out[0] if out else np.empty(x.shape, np.float32)
        np.subtract(x, self.zp, out=y, dtype=np.float32)
        y *= self.scale
        env[self.outs[0]] = y


class ToNHWCStep(Step):
    """A rank-4 uint8 tensor in NCHW order (from a reshape/transpose) -> NHWC."""
    mode = "convert"

    def __init__(self, name, x, y):
        super().__init__(name, "ToNHWC", [x], [y])

    def run(self, env, out):
        x = env[self.ins[0]]
        if x.ndim != 4:
            raise ValueError(f"expected a rank-4 tensor, got shape {list(x.shape)}")
        t = x.transpose(0, 2, 3, 1)
        y = out[0] if out else np.empty(t.shape, np.uint8)
        np.copyto(y, t)
        env[self.outs[0]] = y


def logical_nchw(x, nhwc):
    """The ONNX-order view of a stored int8 tensor (a view, possibly non-contiguous)."""
    if nhwc and x.ndim == 4:
        if x.shape[1] == 1 and x.shape[2] == 1:
            return x.reshape(x.shape[0], x.shape[3], 1, 1)
        return x.transpose(0, 3, 1, 2)
    return x


# ---------------------------------------------------------------- int8 compute

class SamePadPacker:
    """auto_pad=SAME_*: the pads depend on the input size, so the weights are packed per input
    size (on the first run with that size) and cached."""

    kind, kernel = "same-pad", ""

    def __init__(self, pack, pads_for):
        self.pack, self.pads_for, self.cache = pack, pads_for, {}

    def for_input(self, x):
        hw = (x.shape[1], x.shape[2])
        p = self.cache.get(hw)
        if p is None:
            p = self.cache[hw] = self.pack(self.pads_for(hw))
            self.kind, self.kernel = getattr(p, "kind", ""), getattr(p, "kernel", "")
        return p


class ConvStep(Step):
    def __init__(self, name, K, packed, x, y, cin_per_group, kh, kw):
        super().__init__(name, "Conv", [x], [y])
        self.K, self.p, self.cig, self.kh, self.kw = K, packed, cin_per_group, kh, kw
        kind = getattr(packed, "kind", "")
        self.kernel = f"{kind}:{getattr(packed, 'kernel', '')}"
        self.op = "DwConv" if kind == "dwconv" or cin_per_group == 1 else f"Conv{kh}x{kw}"

    def packed(self, x):
        return self.p.for_input(x) if isinstance(self.p, SamePadPacker) else self.p

    def run(self, env, out):
        x = env[self.ins[0]]
        env[self.outs[0]] = self.K.conv2d(self.packed(x), x, out=out[0] if out else None)

    def bind(self, env, out):
        f = getattr(self.K, "bind_conv2d", None)
        if f is None or out is None:
            return super().bind(env, out)
        x = env[self.ins[0]]
        return f(self.packed(x), x, out[0])
    def macs(self, env):
        return int(env[self.outs[0]].size) * self.cig * self.kh * self.kw


class DeconvStep(ConvStep):
    """ConvTranspose on the kernels' pack_deconv2d (one convolution per output phase)."""

    def __init__(self, name, K, packed, x, y, cin_per_group, kh, kw):
        super().__init__(name, K, packed, x, y, cin_per_group, kh, kw)
        self.op, self.kernel = "ConvTranspose", f"deconv:{getattr(packed, 'kernel', '')}"
        self.taps_per_output = kh * kw / float(np.prod(getattr(packed, "strides", (1, 1))))

    def run(self, env, out):
        env[self.outs[0]] = self.K.deconv2d(self.p, env[self.ins[0]], out=out[0] if out else None)

    def bind(self, env, out):
        f = getattr(self.K, "bind_deconv2d", None)
        if f is None or out is None:
            return Step.bind(self, env, out)
        return f(self.p, env[self.ins[0]], out[0])

    def macs(self, env):
        return int(env[self.outs[0]].size * self.cig * self.taps_per_output)


class GemmStep(Step):
    def __init__(self, name, op, K, packed, x, y):
        super().__init__(name, op, [x], [y])
        self.K, self.p = K, packed
        self.kernel = f"gemm:{getattr(packed, 'kernel', '')}"
        self.k = 0

    def run(self, env, out):
        x = env[self.ins[0]]
        if x.ndim != 2:
            lead = x.shape[:-1]
            x2 = x.reshape(-1, x.shape[-1])
            o = out[0].reshape(-1, out[0].shape[-1]) if out else None
            y = self.K.gemm(self.p, x2, out=o)
            env[self.outs[0]] = out[0] if out else y.reshape(lead + (y.shape[-1],))
            return
        env[self.outs[0]] = self.K.gemm(self.p, x, out=out[0] if out else None)

    def bind(self, env, out):
        f = getattr(self.K, "bind_gemm", None)
        x = env[self.ins[0]]
        if f is None or out is None or x.ndim != 2:
            return super().bind(env, out)
        return f(self.p, x, out[0])
    def macs(self, env):
        y = env[self.outs[0]]
        return int(np.prod(y.shape)) * self.k


class AddStep(Step):
    def __init__(self, name, K, a, b, y, qa, qb, qy: OutQuant):
        super().__init__(name, "Add", [a, b], [y])
        self.K = K
        self.q = BinaryQuant(qa[0], qa[1], qb[0], qb[1], qy.scale, qy.zp, qy.lo, qy.hi)
        self.kernel = "add"

    def run(self, env, out):
        a, b = env[self.ins[0]], env[self.ins[1]]
        if a.shape != b.shape:  # broadcasting: the kernel wants equal shapes
            shape = np.broadcast_shapes(a.shape, b.shape)
            a, b = np.ascontiguousarray(np.broadcast_to(a, shape)), np.ascontiguousarray(np.broadcast_to(b, shape))
        env[self.outs[0]] = self.K.add(a, b, self.q, out=out[0] if out else None)

    def bind(self, env, out):
        f = getattr(self.K, "bind_add", None)
        a, b = env[self.ins[0]], env[self.ins[1]]
        if f is None or out is None or a.shape != b.shape:
            return super().bind(env, out)
        return f(a, b, out[0], self.q)
    def macs(self, env):
        return int(env[self.outs[0]].size)


def _pool_pads(at, hw, k, strides, dil=(1, 1)):
    p = list(conv_pads(at, hw, k))
    if at.get("ceil_mode", 0):  # extend the end pads so that floor division gives ceil's size
        for i in range(2):
            span = hw[i] + p[i] + p[i + 2] - (k[i] - 1) * dil[i] - 1
            if span % strides[i]:
                p[i + 2] += strides[i] - span % strides[i]
    return tuple(p)


class MulStep(Step):
    """uint8 x uint8 -> uint8 elementwise product with numpy broadcasting, as ONNX Runtime's
    QLinearMul (MLAS, x86) computes it: p = (a - za) * (b - zb) in int32,
    y = sat(rint(float32(p) * float32(sa * sb / sy) + float32(zy)))."""

    def __init__(self, name, K, a, b, y, qa, qb, qy: OutQuant):
        super().__init__(name, "Mul", [a, b], [y])
        self.K = K
        self.za, self.zb = int(qa[1]), int(qb[1])
        self.ratio = np.float32(np.float32(np.float32(qa[0]) * np.float32(qb[0])) / np.float32(qy.scale))
        self.zy, self.lo, self.hi = np.float32(qy.zp), qy.lo, qy.hi
        self.native = getattr(K, "mul", None)
        self.q = BinaryQuant(qa[0], qa[1], qb[0], qb[1], qy.scale, qy.zp, qy.lo, qy.hi)
        self.kernel = "native" if self.native else "numpy"
        self.tmp = {}

    def _args(self, env):
        """(a, b, q) with the full-size operand first (the product is symmetric)."""
        a, b = env[self.ins[0]], env[self.ins[1]]
        if a.size < b.size:
            return b, a, self.q.swapped()
        return a, b, self.q

    def bind(self, env, out):
        f = getattr(self.K, "bind_mul", None)
        if f is not None and out is not None:
            a, b, q = self._args(env)
            try:
                return f(a, b, out[0], q)
            except ValueError:  # a broadcast the kernel does not take: numpy
                pass
        return super().bind(env, out)

    def run(self, env, out):
        a, b = env[self.ins[0]], env[self.ins[1]]
        if self.native is not None:
            try:
                a2, b2, q = self._args(env)
                env[self.outs[0]] = self.native(a2, b2, q, out=out[0] if out else None)
                return
            except ValueError:  # a broadcast the kernel does not take
                pass
        shape = np.broadcast_shapes(a.shape, b.shape)
        t = self.tmp.get(shape)
        if t is None:
            t = self.tmp[shape] = (np.empty(shape, np.int32), np.empty(shape, np.float32))
        p, f = t
        np.multiply(np.subtract(a, self.za, dtype=np.int32), np.subtract(b, self.zb, dtype=np.int32), out=p)
        np.multiply(p, self.ratio, out=f, dtype=np.float32)
        f += self.zy
        np.rint(f, out=f)
        np.clip(f, self.lo, self.hi, out=f)
        y = out[0] if out else np.empty(shape, np.uint8)
        np.copyto(y, f, casting="unsafe")
        env[self.outs[0]] = y

    def macs(self, env):
        return int(env[self.outs[0]].size)


class MaxPoolStep(Step):
    def __init__(self, name, K, x, y, attrs):
        super().__init__(name, "MaxPool", [x], [y])
        self.K, self.at = K, attrs
        self.k = tuple(attrs["kernel_shape"])
        self.s = tuple(attrs.get("strides", [1, 1]))
        self.d = tuple(attrs.get("dilations", [1, 1]))
        self.geo = {}
        self.kernel = "maxpool"

    def run(self, env, out):
        x = env[self.ins[0]]
        win = self.geo.get(x.shape)
        if win is None:
            win = self.geo[x.shape] = PoolWindow(self.k, self.s, _pool_pads(self.at, x.shape[1:3], self.k, self.s, self.d),
                                                 self.d)
        env[self.outs[0]] = self.K.maxpool2d(x, win, out=out[0] if out else None)

    def bind(self, env, out):
        f = getattr(self.K, "bind_maxpool2d", None)
        if f is None or out is None:
            return super().bind(env, out)
        x = env[self.ins[0]]
        return f(x, out[0], self.geo[x.shape])

class AvgPoolStep(Step):
    """AveragePool on uint8 NHWC as ONNX Runtime's QLinearAveragePool computes it (numpy): the
    window's dequantized float32 values summed tap by tap in row-major order, divided by the
    count, y = sat(rint(avg / s_y + z_y)). AveragePool is rare and small; exactness wins here
    over the integer kernel, which differs by one step now and then."""

    def __init__(self, name, K, x, y, attrs, qx, qy: OutQuant):
        super().__init__(name, "AveragePool", [x], [y])
        self.K, self.at = K, attrs
        self.k = tuple(attrs["kernel_shape"])
        self.s = tuple(attrs.get("strides", [1, 1]))
        self.cip = bool(attrs.get("count_include_pad", 0))
        self.qx, self.qy, self.lo, self.hi = qx, (qy.scale, qy.zp), qy.lo, qy.hi
        self.geo = {}
        self.kernel = "numpy"

    def run(self, env, out):
        x = env[self.ins[0]]
        g = self.geo.get(x.shape)
        if g is None:
            g = self.geo[x.shape] = self._geometry(x.shape)
        pads, oh, ow, cnt = g
        n, h, w, c = x.shape
        t, l, b, r = pads
        xf = np.zeros((n, h + t + b, w + l + r, c), np.float32)
        np.multiply(np.float32(self.qx[0]), np.subtract(x, self.qx[1], dtype=np.int32), out=xf[:, t:t + h, l:l + w], dtype=np.float32)
        acc = np.zeros((n, oh, ow, c), np.float32)
        sh, sw = self.s
        for i in range(self.k[0]):
            for j in range(self.k[1]):
                acc += xf[:, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]
        acc /= cnt
        acc /= np.float32(self.qy[0])
        acc += np.float32(self.qy[1])
        np.rint(acc, out=acc)
        np.clip(acc, self.lo, self.hi, out=acc)
        y = out[0] if out else np.empty(acc.shape, np.uint8)
        np.copyto(y, acc, casting="unsafe")
        env[self.outs[0]] = y

    def _geometry(self, shape):
        n, h, w, c = shape
        pads = _pool_pads(self.at, (h, w), self.k, self.s)
        t, l, b, r = pads
        oh = (h + t + b - self.k[0]) // self.s[0] + 1
        ow = (w + l + r - self.k[1]) // self.s[1] + 1
        if self.cip:
            cnt = np.full((1, oh, ow, 1), self.k[0] * self.k[1], np.float32)
        else:  # valid taps only (ONNX Runtime clips the window to the input)
            hs = np.arange(oh) * self.s[0] - t
            ws = np.arange(ow) * self.s[1] - l
            ch = np.minimum(hs + self.k[0], h) - np.maximum(hs, 0)
            cw = np.minimum(ws + self.k[1], w) - np.maximum(ws, 0)
            cnt = (ch[:, None] * cw[None, :]).astype(np.float32).reshape(1, oh, ow, 1)
        return pads, oh, ow, cnt


class GlobalAvgPoolStep(Step):
    def __init__(self, name, K, x, y, qx, qy: OutQuant):
        super().__init__(name, "GlobalAveragePool", [x], [y])
        self.K = K
        self.kw = dict(x_zp=qx[1], multiplier=np.float32(np.float32(qx[0]) / np.float32(qy.scale)), y_zp=qy.zp,
                       lo=qy.lo, hi=qy.hi)
        self.kernel = "global_avgpool"

    def run(self, env, out):
        env[self.outs[0]] = self.K.global_avgpool(env[self.ins[0]], out=out[0] if out else None, **self.kw)

    def bind(self, env, out):
        f = getattr(self.K, "bind_global_avgpool", None)
        if f is None or out is None:
            return super().bind(env, out)
        return f(env[self.ins[0]], out[0], **self.kw)

class ConcatStep(Step):
    def __init__(self, name, K, xs, y, axis, qs, qy):
        super().__init__(name, "Concat", xs, [y])
        self.K, self.axis = K, axis
        self.kw = dict(scales=[q[0] for q in qs], zps=[q[1] for q in qs], y_scale=qy[0], y_zp=qy[1])
        self.kernel = "concat"

    def run(self, env, out):
        xs = [env[i] for i in self.ins]
        env[self.outs[0]] = self.K.concat(xs, self.axis, out=out[0] if out else None, **self.kw)

    def bind(self, env, out):
        f = getattr(self.K, "bind_concat", None)
        if f is None or out is None:
            return super().bind(env, out)
        return f([env[i] for i in self.ins], self.axis, out[0], **self.kw)

def requantize_dq_q(x, qx, qy, out=None):
    """uint8 (s1, z1) -> uint8 (s2, z2) exactly as DequantizeLinear then QuantizeLinear compute it
    in float32 (what ONNX Runtime runs for a DQ -> Q pair it does not fuse):
    y = sat(rint(float32((x - z1) * s1) / s2) + z2)."""
    t = np.subtract(x, np.float32(qx[1]), dtype=np.float32)
    t *= np.float32(qx[0])
    t /= np.float32(qy[0])
    np.rint(t, out=t)
    t += np.float32(qy[1])
    np.clip(t, 0, 255, out=t)
    if out is None:
        return t.astype(np.uint8)
    np.copyto(out, t, casting="unsafe")
    return out


class RequantStep(Step):
    """uint8 (s1, z1) -> uint8 (s2, z2), same layout: a DQ -> Q pair with different parameters."""

    def __init__(self, name, K, x, y, qx, qy):
        super().__init__(name, "Requantize", [x], [y])
        self.K, self.qx, self.qy = K, qx, qy
        self.kernel = "numpy"

    def run(self, env, out):
        env[self.outs[0]] = requantize_dq_q(env[self.ins[0]], self.qx, self.qy, out[0] if out else None)


class ShapeOpStep(Step):
    """Reshape/Flatten/Squeeze/Unsqueeze/Transpose on uint8 data, with an optional requantize.
    The result is in ONNX layout ('plain'); it is a view of the input when the layout allows."""

    def __init__(self, name, op, x, y, extra, attrs, x_nhwc, requant):
        super().__init__(name, op, [x], [y])
        self.extra, self.at, self.x_nhwc, self.requant = extra, attrs, x_nhwc, requant
        self.fn = FP32_OPS[op]
        self.kernel = "view"

    def run(self, env, out):
        x = logical_nchw(env[self.ins[0]], self.x_nhwc)
        r = self.fn([x] + self.extra, self.at)[0]
        if self.requant is not None:
            qx, qy = self.requant
            r = requantize_dq_q(r, qx, qy, out[0] if out else None)
        elif out:
            np.copyto(out[0], r)
            r = out[0]
        elif not r.flags.c_contiguous:
            r = np.ascontiguousarray(r)
        env[self.outs[0]] = r


class PadStep(Step):
    """Constant spatial padding of an NHWC uint8 tensor with a quantized fill value."""

    def __init__(self, name, x, y, pads, fill):
        super().__init__(name, "Pad", [x], [y])
        self.p, self.fill = pads, np.uint8(fill)  # (top, left, bottom, right)
        self.kernel = "numpy"

    def run(self, env, out):
        x = env[self.ins[0]]
        n, h, w, c = x.shape
        t, l, b, r = self.p
        y = out[0] if out else np.empty((n, h + t + b, w + l + r, c), np.uint8)
        y.fill(self.fill)
        y[:, t:t + h, l:l + w] = x
        env[self.outs[0]] = y


class LutStep(Step):
    """uint8 -> uint8 through a 256-entry table (one per channel for per-channel ops): any
    elementwise fp32 op between a DequantizeLinear and a QuantizeLinear, evaluated once at load."""

    def __init__(self, name, op, x, y, lut, K=None):
        super().__init__(name, op, [x], [y])
        self.lut = lut  # [256] or [C, 256] (NHWC: channel last)
        self.flat = np.ascontiguousarray(lut.reshape(-1))
        self.offs = (np.arange(lut.shape[0], dtype=np.int32) * 256) if lut.ndim == 2 else None
        self.idx = {}
        self.K = K
        self.native = getattr(K, "lut", None) if K is not None else None
        self.table = np.ascontiguousarray(lut)
        self.kernel = "native lut" if self.native else "numpy lut"

    def bind(self, env, out):
        f = getattr(self.K, "bind_lut", None)
        if f is None or out is None:
            return super().bind(env, out)
        return f(env[self.ins[0]], self.table, out[0])

    def run(self, env, out):
        x = env[self.ins[0]]
        y = out[0] if out else np.empty(x.shape, np.uint8)
        if self.native is not None:
            env[self.outs[0]] = self.native(x, self.table, out=y)
            return
        if self.offs is None:
            np.take(self.flat, x, out=y)
        else:
            i = self.idx.get(x.shape)
            if i is None:
                i = self.idx[x.shape] = np.empty(x.shape, np.int32)
            np.add(x, self.offs, out=i, dtype=np.int32)
            np.take(self.flat, i, out=y)
        env[self.outs[0]] = y


# ---------------------------------------------------------------- fp32 fallback

class FP32Step(Step):
    mode = "fp32"
    uses_out = False

    def __init__(self, name, op, ins, outs, attrs, reason):
        super().__init__(name, op, ins, outs)
        self.fn = FP32_OPS[op]
        self.at = attrs
        self.reason = reason
        self.kernel = "numpy"

    def run(self, env, out):
        ys = self.fn([None if i is None else env[i] for i in self.ins], self.at)
        for o, y in zip(self.outs, ys):
            if o is not None:
                env[o] = y if isinstance(y, np.ndarray) else np.asarray(y)

    def bind(self, env, out):
        """One input and one output (most fp32 ops): a closure with the slots and the op looked up once."""
        if len(self.ins) != 1 or len(self.outs) != 1 or self.ins[0] is None or self.outs[0] is None:
            return super().bind(env, out)
        fn, at, i, o = self.fn, self.at, self.ins[0], self.outs[0]

        def step():
            y = fn([env[i]], at)[0]
            env[o] = y if isinstance(y, np.ndarray) else np.asarray(y)
        return step
