"""Naive numpy twins of every native kernel, built on qtool.qparams.requantize. They define what
"bit-exact" means for the tests.

Drop-in with qtool.kernels: `pack_conv2d` / `pack_gemm` here return a `RefPacked` holding the raw
weights, and `conv2d(p, x)` / `gemm(p, x)` accept it; `conv2d(w, bias, x, **q)` with raw weights
also works (what the tests use)."""
from __future__ import annotations

import numpy as np

from qtool.kernel_params import BinaryQuant, ConvGeometry, DeconvGeometry, PoolWindow
from qtool.qparams import ActQParams, dequantize, quantize, requantize

from . import conv_out_hw
from .deconv_phases import deconv_out_hw


def _pads(p):
    p = tuple(int(i) for i in p)
    return p + p if len(p) == 2 else p


def _pair(v):
    return tuple(int(i) for i in (v if hasattr(v, "__len__") else (v, v)))


def _patches(xp, out_hw, kernel, strides, dilations):
    """[N, OH, OW, KH, KW, C] windows of a padded NHWC array."""
    (oh, ow), (kh, kw), (sh, sw), (dh, dw) = out_hw, kernel, strides, dilations
    n, _, _, c = xp.shape
    out = np.empty((n, oh, ow, kh, kw, c), xp.dtype)
    for ky in range(kh):
        for kx in range(kw):
            y0, x0 = ky * dh, kx * dw
            out[:, :, :, ky, kx, :] = xp[:, y0:y0 + (oh - 1) * sh + 1:sh, x0:x0 + (ow - 1) * sw + 1:sw, :]
    return out


def conv2d_acc(w, bias, x, x_zp, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), group=1):
    """int32 accumulators [N, OH, OW, Cout] = sum((x - x_zp) * w) + bias, padding = real 0."""
    w = np.asarray(w, np.int64)
    cout, cin_g, kh, kw = w.shape
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = _pair(strides), _pair(dilations), _pads(pads)
    n, h, wd, cin = x.shape
    oh, ow = conv_out_hw(h, wd, (kh, kw), (sh, sw), (pt, pl, pb, pr), (dh, dw))
    xc = x.astype(np.int64) - int(x_zp)
    xp = np.zeros((n, h + pt + pb + kh * dh, wd + pl + pr + kw * dw, cin), np.int64)
    xp[:, pt:pt + h, pl:pl + wd, :] = xc
    pat = _patches(xp, (oh, ow), (kh, kw), (sh, sw), (dh, dw))  # [N, OH, OW, KH, KW, Cin]
    cout_g = cout // group
    acc = np.empty((n, oh, ow, cout), np.int64)
    for g in range(group):
        pg = pat[..., g * cin_g:(g + 1) * cin_g].reshape(n, oh, ow, -1)
        wg = w[g * cout_g:(g + 1) * cout_g].transpose(0, 2, 3, 1).reshape(cout_g, -1)
        acc[..., g * cout_g:(g + 1) * cout_g] = pg @ wg.T
    if bias is not None:
        acc += np.asarray(bias, np.int64)
    assert np.abs(acc).max(initial=0) < 2 ** 31
    return acc.astype(np.int32)


def deconv2d_acc(w, bias, x, x_zp, geometry: DeconvGeometry = DeconvGeometry()):
    """int32 accumulators [N, OH, OW, Cout] of a ConvTranspose (w [Cin, Cout/group, KH, KW]): every
    input pixel (x - x_zp) scatters its kernel into the output, stride apart; then the pads are cut."""
    w = np.asarray(w, np.int64)
    cin, cout_g, kh, kw = w.shape
    (sh, sw), (pt, pl, pb, pr), g = _pair(geometry.strides), _pads(geometry.pads), int(geometry.group)
    n, h, wd, _ = x.shape
    oh, ow = deconv_out_hw(h, wd, (kh, kw), (sh, sw), (pt, pl, pb, pr), _pair(geometry.output_padding))
    full = np.zeros((n, max(oh + pt, (h - 1) * sh + kh), max(ow + pl, (wd - 1) * sw + kw), cout_g * g), np.int64)
    xc = x.astype(np.int64) - int(x_zp)
    cin_g = cin // g
    for gi in range(g):
        xg = xc[..., gi * cin_g:(gi + 1) * cin_g]
        for ky in range(kh):
            for kx in range(kw):
                full[:, ky:ky + (h - 1) * sh + 1:sh, kx:kx + (wd - 1) * sw + 1:sw, gi * cout_g:(gi + 1) * cout_g] += \
                    xg @ w[gi * cin_g:(gi + 1) * cin_g, :, ky, kx]
    acc = full[:, pt:pt + oh, pl:pl + ow, :]
    if bias is not None:
        acc = acc + np.asarray(bias, np.int64)
    assert np.abs(acc).max(initial=0) < 2 ** 31
    return acc.astype(np.int32)


class RefPackedDeconv:
    """Raw ConvTranspose weights and quantization parameters, standing in for a native PackedDeconv."""

    def __init__(self, w, bias, **q):
        self.w, self.bias, self.q = np.asarray(w), bias, q
        g = q.get("geometry", DeconvGeometry())
        self.cin, self.cout = int(self.w.shape[0]), int(self.w.shape[1]) * int(g.group)
        self.kernel, self.isa, self.kind = "numpy-reference", "numpy", "deconv"

    def out_shape(self, n, h, w):
        g = self.q.get("geometry", DeconvGeometry())
        return (n,) + deconv_out_hw(h, w, self.w.shape[2:], _pair(g.strides), _pads(g.pads), _pair(g.output_padding)) \
            + (self.cout,)


def pack_deconv2d(w, bias, **q):
    return RefPackedDeconv(w, bias, **q)


def deconv2d(w, bias=None, x=None, *, out=None, **q):
    """ConvTranspose, uint8 NHWC: requantize(deconv2d_acc) (also deconv2d(packed, x, out=None))."""
    if isinstance(w, RefPackedDeconv):
        p, x = w, bias
        return _ret(deconv2d(p.w, p.bias, x, **p.q), out)
    acc = deconv2d_acc(w, bias, x, q["x_zp"], q.get("geometry", DeconvGeometry()))
    return _ret(requantize(acc, np.asarray(q["multiplier"], np.float32), q["y_zp"], q.get("lo", 0),
                           q.get("hi", 255)), out)


class RefPacked:
    """Raw weights and quantization parameters, standing in for a native PackedConv."""

    def __init__(self, w, bias, kind, **q):
        self.w, self.bias, self.kind, self.q = np.asarray(w), bias, kind, q
        self.cout = int(self.w.shape[0])
        self.cin = int(self.w.shape[1]) * int(q.get("geometry", ConvGeometry()).group)
        self.kernel, self.isa = "numpy-reference", "numpy"
        self.out_dtype = np.dtype(q.get("out_dtype", "uint8")).type

    def out_shape(self, n, h, w):
        kh, kw = self.w.shape[2:]
        g = self.q.get("geometry", ConvGeometry())
        oh, ow = conv_out_hw(h, w, (kh, kw), _pair(g.strides), _pads(g.pads), _pair(g.dilations))
        return (n, oh, ow, self.cout)


def _ret(y, out):
    if out is None:
        return y
    out[...] = y
    return out


def pack_conv2d(w, bias, **q):
    return RefPacked(w, bias, "conv", **q)


def pack_gemm(w, bias, **q):
    return RefPacked(w, bias, "gemm", **q)


def conv2d(w, bias=None, x=None, *, out=None, **q):
    if isinstance(w, RefPacked):  # conv2d(p, x, out=None)
        p, x = w, bias
        return _ret(conv2d(p.w, p.bias, x, **p.q), out)
    g = q.get("geometry", ConvGeometry())
    acc = conv2d_acc(w, bias, x, q["x_zp"], g.strides, g.pads, g.dilations, g.group)
    return _ret(requantize(acc, np.asarray(q["multiplier"], np.float32), q["y_zp"], q.get("lo", 0),
                           q.get("hi", 255)), out)


def gemm(w, bias=None, x=None, *, out=None, **q):
    if isinstance(w, RefPacked):  # gemm(p, x, out=None)
        p, x = w, bias
        return gemm(p.w, p.bias, x, out=out, **p.q)
    acc = _gemm_acc(w, bias, x, q["x_zp"])
    m = np.asarray(q["multiplier"], np.float32)
    if np.dtype(q.get("out_dtype", "uint8")) == np.float32:
        return _ret(acc.astype(np.float32) * m, out)
    return _ret(requantize(acc, m, q.get("y_zp", 0), q.get("lo", 0), q.get("hi", 255)), out)


def _gemm_acc(w, bias, x, x_zp):
    """int32 accumulators [M, N] = sum((x - x_zp) * w) + bias."""
    acc = (x.astype(np.int64) - int(x_zp)) @ np.asarray(w, np.int64).T
    if bias is not None:
        acc = acc + np.asarray(bias, np.int64)
    return acc.astype(np.int32)


def _fma32(x, y, z):
    """float32 fused multiply-add: exact product and sum in extended precision, one rounding
    (u8 x float32 products have <= 32 significant bits; long double carries 64)."""
    return (np.asarray(x).astype(np.longdouble) * np.longdouble(y)
            + np.asarray(z).astype(np.longdouble)).astype(np.float32)


def _add(a, b, q: BinaryQuant):
    """ONNX Runtime's QLinearAdd (MLAS) rounding: zero points folded into one float32 constant,
    two fused multiply-adds on the raw u8 values, round half to even, clamp."""
    f32 = np.float32
    ma = f32(q.a_scale) / f32(q.y_scale)
    mb = f32(q.b_scale) / f32(q.y_scale)
    fixed = f32(f32(q.y_zp) - _fma32(np.asarray(ma), f32(q.a_zp), f32(mb * f32(q.b_zp))))  # ORT contracts it
    t = _fma32(a, ma, _fma32(b, mb, np.full(b.shape, fixed, np.float32)))
    return np.clip(np.rint(t), q.lo, q.hi).astype(np.uint8)


def _pool_windows(x, win: PoolWindow, dilations, fill):
    kh, kw = _pair(win.kernel)
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = _pair(win.strides), _pair(dilations), _pads(win.pads)
    n, h, w, c = x.shape
    oh, ow = conv_out_hw(h, w, (kh, kw), (sh, sw), (pt, pl, pb, pr), (dh, dw), win.ceil_mode)
    big = kh * dh + kw * dw + (oh + ow) * (sh + sw)
    xp = np.full((n, h + pt + big, w + pl + big, c), fill, np.int64)
    xp[:, pt:pt + h, pl:pl + w] = x
    valid = np.zeros((1, h + pt + big, w + pl + big, 1), np.int64)
    valid[:, pt:pt + h, pl:pl + w] = 1
    padded = np.zeros_like(valid)
    padded[:, :pt + h + pb, :pl + w + pr] = 1
    f = lambda a: _patches(a, (oh, ow), (kh, kw), (sh, sw), (dh, dw))
    return f(xp), f(valid), f(padded)


def _maxpool2d(x, window: PoolWindow):
    win, _, _ = _pool_windows(x, window, window.dilations, -1)
    return np.maximum(win.max(axis=(3, 4)), 0).astype(np.uint8)


def _avgpool2d(x, window: PoolWindow, *, x_zp, multiplier, y_zp, lo=0, hi=255):
    win, valid, padded = _pool_windows(x.astype(np.int64) - int(x_zp), window, (1, 1), 0)
    acc = (win * valid).sum(axis=(3, 4)).astype(np.int32)            # [N, OH, OW, C]
    count = (padded if window.count_include_pad else valid).sum(axis=(3, 4))  # [1, OH, OW, 1]
    m = (np.float32(multiplier) / count.astype(np.float32)).astype(np.float32)
    return requantize(acc, m, y_zp, lo, hi)


def _global_avgpool(x, *, x_zp, multiplier, y_zp, lo=0, hi=255):
    n, h, w, c = x.shape
    acc = (x.astype(np.int64) - int(x_zp)).sum(axis=(1, 2), keepdims=True).astype(np.int32)
    m = np.float32(multiplier) / np.float32(h * w)
    return requantize(acc, m, y_zp, lo, hi)


def _concat(xs, axis, *, scales, zps, y_scale, y_zp):
    parts = []
    for x, s, z in zip(xs, scales, zps):
        if np.float32(s) == np.float32(y_scale) and int(z) == int(y_zp):
            parts.append(x)
        else:
            m = np.float32(s) / np.float32(y_scale)
            parts.append(requantize(x.astype(np.int32) - int(z), m, y_zp))
    return np.concatenate(parts, axis=axis)


def _quantize_nchw_to_nhwc(x, scale, zp):
    q = quantize(x, ActQParams(float(scale), int(zp)))
    return np.ascontiguousarray(q.transpose(0, 2, 3, 1)) if q.ndim == 4 else q


def _dequantize_nhwc_to_nchw(x, scale, zp):
    y = dequantize(x, ActQParams(float(scale), int(zp)))
    return np.ascontiguousarray(y.transpose(0, 3, 1, 2)) if y.ndim == 4 else y


def _mul(a, b, q: BinaryQuant):
    """ONNX Runtime's QLinearMul (MLAS x86): int32 product of the centred values, times a float32
    ratio, plus the output zero point (two roundings), round half to even, clamp."""
    f32 = np.float32
    ratio = (f32(q.a_scale) * f32(q.b_scale)) / f32(q.y_scale)
    p = (a.astype(np.int32) - int(q.a_zp)) * (b.astype(np.int32) - int(q.b_zp))
    t = (p.astype(np.float32) * ratio).astype(np.float32) + f32(q.y_zp)
    return np.clip(np.rint(t), q.lo, q.hi).astype(np.uint8)


def _lut(x, table):
    t = np.asarray(table, np.uint8)
    if t.ndim == 1:
        return t[x]
    return t[np.arange(t.shape[0]), x]


# out= versions, matching qtool.kernels
def add(*args, out=None, **kw):
    return _ret(_add(*args, **kw), out)


add.__doc__ = _add.__doc__
def maxpool2d(*args, out=None, **kw):
    return _ret(_maxpool2d(*args, **kw), out)


maxpool2d.__doc__ = _maxpool2d.__doc__
def avgpool2d(*args, out=None, **kw):
    return _ret(_avgpool2d(*args, **kw), out)


avgpool2d.__doc__ = _avgpool2d.__doc__
def global_avgpool(*args, out=None, **kw):
    return _ret(_global_avgpool(*args, **kw), out)


global_avgpool.__doc__ = _global_avgpool.__doc__
def concat(*args, out=None, **kw):
    return _ret(_concat(*args, **kw), out)


concat.__doc__ = _concat.__doc__
def quantize_nchw_to_nhwc(*args, out=None, **kw):
    return _ret(_quantize_nchw_to_nhwc(*args, **kw), out)


quantize_nchw_to_nhwc.__doc__ = _quantize_nchw_to_nhwc.__doc__
def dequantize_nhwc_to_nchw(*args, out=None, **kw):
    return _ret(_dequantize_nhwc_to_nchw(*args, **kw), out)


dequantize_nhwc_to_nchw.__doc__ = _dequantize_nhwc_to_nchw.__doc__
def mul(*args, out=None, **kw):
    return _ret(_mul(*args, **kw), out)


def lut(*args, out=None, **kw):
    return _ret(_lut(*args, **kw), out)
