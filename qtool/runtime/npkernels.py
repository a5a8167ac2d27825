"""A numpy stand-in with the signatures of qtool.kernels (see qtool/kernels/API.md).

Used only when neither the native extension nor qtool.kernels.reference can be imported,
so the executor works (slowly) on a bare checkout. Integer results are exact: products are
summed in float64, which holds any u8 x s8 dot product of length < 2**37 exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool.kernel_params import BinaryQuant, ConvGeometry, PoolWindow
from qtool.qparams import requantize


def conv_multiplier(x_scale, w_scales, y_scale):
    return (np.float32(x_scale) * np.asarray(w_scales, np.float32)).astype(np.float32) / np.float32(y_scale)


def info():
    return {"isa": "numpy", "best_isa": "numpy", "supported": {}, "num_threads": 1, "kernels": {}}


def get_isa():
    return "numpy"


def set_num_threads(n):
    pass


def get_num_threads():
    return 1


@dataclass
class PackedConv:
    w: np.ndarray  # float64 [group, Cin/g*KH*KW, Cout/g]
    bias: np.ndarray
    x_zp: int
    multiplier: np.ndarray
    y_zp: int
    strides: tuple
    pads: tuple
    dilations: tuple
    group: int
    lo: int
    hi: int
    cin: int
    cout: int
    kh: int
    kw: int
    kind: str = "numpy"
    kernel: str = "numpy"

    def out_shape(self, n, h, w):
        oh = (h + self.pads[0] + self.pads[2] - (self.kh - 1) * self.dilations[0] - 1) // self.strides[0] + 1
        ow = (w + self.pads[1] + self.pads[3] - (self.kw - 1) * self.dilations[1] - 1) // self.strides[1] + 1
        return (n, oh, ow, self.cout)


def pack_conv2d(w, bias, *, x_zp, multiplier, y_zp, lo=0, hi=255, geometry: ConvGeometry = ConvGeometry()):
    group = geometry.group
    cout, cig, kh, kw = w.shape
    og = cout // group
    # [g, og, cig, kh, kw] -> [g, kh, kw, cig, og] to match NHWC patches
    wp = w.reshape(group, og, cig, kh, kw).transpose(0, 3, 4, 2, 1).reshape(group, kh * kw * cig, og)
    b = np.zeros(cout, np.int64) if bias is None else np.asarray(bias, np.int64)
    return PackedConv(wp.astype(np.float64), b, int(x_zp), np.broadcast_to(np.asarray(multiplier, np.float32), (cout,)).copy(),
                      int(y_zp), tuple(geometry.strides), tuple(geometry.pads), tuple(geometry.dilations), group, lo, hi,
                      cig * group, cout, kh, kw)


def conv2d(p, x, out=None):
    n, h, w, c = x.shape
    _, oh, ow, co = p.out_shape(n, h, w)
    t, l, b, r = p.pads
    xp = np.zeros((n, h + t + b, w + l + r, c), np.float64)
    xp[:, t:t + h, l:l + w] = x.astype(np.float64) - p.x_zp
    sh, sw = p.strides
    dh, dw = p.dilations
    s = xp.strides
    cols = np.lib.stride_tricks.as_strided(
        xp, (n, oh, ow, p.kh, p.kw, c), (s[0], s[1] * sh, s[2] * sw, s[1] * dh, s[2] * dw, s[3]), writeable=False)
    cig = c // p.group
    og = co // p.group
    acc = np.empty((n, oh, ow, co), np.float64)
    for g in range(p.group):
        patch = cols[..., g * cig:(g + 1) * cig].reshape(n * oh * ow, p.kh * p.kw * cig)
        acc[..., g * og:(g + 1) * og] = (patch @ p.w[g]).reshape(n, oh, ow, og)
    acc = acc.astype(np.int64) + p.bias
    y = requantize(acc.astype(np.int32), p.multiplier, p.y_zp, p.lo, p.hi)
    if out is not None:
        out[...] = y
        return out
    return y


@dataclass
class PackedGemm:
    w: np.ndarray  # float64 [K, N]
    bias: np.ndarray
    x_zp: int
    multiplier: np.ndarray
    y_zp: int
    lo: int
    hi: int
    out_dtype: str
    kind: str = "gemm"
    kernel: str = "numpy"


def pack_gemm(w, bias, *, x_zp, multiplier, y_zp=0, lo=0, hi=255, out_dtype="uint8"):
    n = w.shape[0]
    b = np.zeros(n, np.int64) if bias is None else np.asarray(bias, np.int64)
    return PackedGemm(w.T.astype(np.float64), b, int(x_zp), np.broadcast_to(np.asarray(multiplier, np.float32), (n,)).copy(),
                      int(y_zp), lo, hi, out_dtype)


def gemm(p, x, out=None):
    acc = ((x.astype(np.float64) - p.x_zp) @ p.w).astype(np.int64) + p.bias
    if p.out_dtype == "float32":
        y = acc.astype(np.int32).astype(np.float32) * p.multiplier
    else:
        y = requantize(acc.astype(np.int32), p.multiplier, p.y_zp, p.lo, p.hi)
    if out is not None:
        out[...] = y
        return out
    return y


def _ret(y, out):
    if out is not None:
        out[...] = y
        return out
    return y


def add(a, b, q: BinaryQuant, out=None):
    """ONNX Runtime's uint8 QLinearAdd (MLAS AVX2 kernel) bit for bit: float32 ratios, the zero
    points folded into one constant, two fused multiply-adds (emulated in float64, then rounded
    to float32), round half to even."""
    f32 = np.float32
    ra = f32(q.a_scale) / f32(q.y_scale)
    rb = f32(q.b_scale) / f32(q.y_scale)
    # ORT's build contracts ra*za + rb*zb into fma(ra, za, rb*zb): one rounding, not two
    fixed = f32(f32(q.y_zp) - f32(np.float64(ra) * np.float64(q.a_zp) + np.float64(f32(rb * f32(q.b_zp)))))
    t = (b.astype(np.float64) * np.float64(rb) + np.float64(fixed)).astype(np.float32)
    t = (a.astype(np.float64) * np.float64(ra) + t.astype(np.float64)).astype(np.float32)
    y = np.clip(np.clip(np.rint(t), 0, 255), q.lo, q.hi)
    return _ret(y.astype(np.uint8), out)


def _windows(x, win: PoolWindow, dilations, fill):
    n, h, w, c = x.shape
    kh, kw = win.kernel
    strides = win.strides
    t, l, b, r = win.pads
    xp = np.full((n, h + t + b, w + l + r, c), fill, x.dtype)
    xp[:, t:t + h, l:l + w] = x
    oh = (h + t + b - (kh - 1) * dilations[0] - 1) // strides[0] + 1
    ow = (w + l + r - (kw - 1) * dilations[1] - 1) // strides[1] + 1
    s = xp.strides
    return np.lib.stride_tricks.as_strided(
        xp, (n, oh, ow, kh, kw, c), (s[0], s[1] * strides[0], s[2] * strides[1], s[1] * dilations[0], s[2] * dilations[1], s[3]),
        writeable=False)


def maxpool2d(x, window: PoolWindow, out=None):
    return _ret(_windows(x, window, window.dilations, 0).max(axis=(3, 4)).astype(np.uint8), out)


def avgpool2d(x, window: PoolWindow, *, x_zp, multiplier, y_zp, lo=0, hi=255, out=None):
    xs = x.astype(np.int32) - int(x_zp)
    acc = _windows(xs, window, (1, 1), 0).sum(axis=(3, 4))
    if window.count_include_pad:
        cnt = np.full(acc.shape[:3] + (1,), window.kernel[0] * window.kernel[1], np.float32)
    else:
        ones = np.ones(x.shape[:3] + (1,), np.int32)
        cnt = _windows(ones, window, (1, 1), 0).sum(axis=(3, 4)).astype(np.float32)
    m = np.float32(multiplier) / cnt
    y = np.rint(acc.astype(np.float32) * m) + np.float32(y_zp)
    return _ret(np.clip(y, lo, hi).astype(np.uint8), out)


def global_avgpool(x, *, x_zp, multiplier, y_zp, lo=0, hi=255, out=None):
    n, h, w, c = x.shape
    acc = x.reshape(n, h * w, c).sum(axis=1, dtype=np.int32) - int(x_zp) * h * w
    m = np.float32(multiplier) / np.float32(h * w)
    y = np.rint(acc.astype(np.float32) * m) + np.float32(y_zp)
    return _ret(np.clip(y, lo, hi).astype(np.uint8).reshape(n, 1, 1, c), out)


def concat(xs, axis, *, scales, zps, y_scale, y_zp, out=None):
    parts = []
    for x, s, z in zip(xs, scales, zps):
        if np.float32(s) == np.float32(y_scale) and int(z) == int(y_zp):
            parts.append(x)
        else:
            m = np.float32(np.float32(s) / np.float32(y_scale))
            y = np.rint((x.astype(np.float32) - np.float32(z)) * m) + np.float32(y_zp)
            parts.append(np.clip(y, 0, 255).astype(np.uint8))
    return _ret(np.concatenate(parts, axis=axis), out)
