"""Conv and Gemm the way ONNX Runtime computes them on x86 without VNNI (qtool/arithmetic.py).

Only layers with a pair of weights that can saturate int16 come here (the compiler checks at
load); every other layer is exact under that arithmetic too and keeps its native kernel. Same
signatures as qtool.kernels (pack_conv2d / conv2d, pack_gemm / gemm), numpy inside: exact int32
sums in float64 (exact below 2**53) plus the saturation correction of the offending pairs,
then the one requantization of qtool.qparams.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool.arithmetic import conv_rows, saturating_pairs, saturation_correction
from qtool.kernel_params import ConvGeometry
from qtool.qparams import requantize

ROWS_PER_BLOCK = 4096  # output pixels per block: bounds the im2col copy


@dataclass
class SatPacked:
    rows: np.ndarray  # [Cout, K] int64, K in (kh, kw, cin) order per group
    pairs: list  # per group: (channel within the group, first K index) of saturating pairs
    bias: np.ndarray  # int64 [Cout]
    x_zp: int
    multiplier: np.ndarray  # float32 [Cout]
    y_zp: int
    lo: int
    hi: int
    group: int = 1
    kh: int = 1
    kw: int = 1
    strides: tuple = (1, 1)
    pads: tuple = (0, 0, 0, 0)
    dilations: tuple = (1, 1)
    out_dtype: str = "uint8"
    kind: str = "saturating"
    kernel: str = "numpy:ort-x86-novnni"

    @property
    def cout(self):
        return self.rows.shape[0]

    def out_shape(self, n, h, w):
        (sh, sw), (dh, dw), (pt, pl, pb, pr) = self.strides, self.dilations, self.pads
        oh = (h + pt + pb - (self.kh - 1) * dh - 1) // sh + 1
        ow = (w + pl + pr - (self.kw - 1) * dw - 1) // sw + 1
        return (n, oh, ow, self.cout)


def _pack(rows, bias, group, x_zp, multiplier, **kw):
    rows = np.asarray(rows, np.int64)
    og = rows.shape[0] // group
    pairs = [saturating_pairs(rows[g * og:(g + 1) * og]) for g in range(group)]
    b = np.zeros(rows.shape[0], np.int64) if bias is None else np.asarray(bias, np.int64).reshape(-1)
    mult = np.broadcast_to(np.asarray(multiplier, np.float32), (rows.shape[0],)).copy()
    return SatPacked(rows, pairs, b, int(x_zp), mult, group=group, **kw)


def has_saturating_pairs(rows: np.ndarray, group: int = 1) -> bool:
    og = rows.shape[0] // group
    return any(len(saturating_pairs(rows[g * og:(g + 1) * og])[0]) for g in range(group))


def pack_conv2d(w, bias, *, x_zp, multiplier, y_zp, lo=0, hi=255, geometry: ConvGeometry = ConvGeometry()):
    w = np.asarray(w)
    g = geometry
    return _pack(conv_rows(w), bias, g.group, x_zp, multiplier, y_zp=int(y_zp), lo=lo, hi=hi,
                 kh=w.shape[2], kw=w.shape[3], strides=tuple(g.strides), pads=tuple(g.pads), dilations=tuple(g.dilations))


def pack_gemm(w, bias, *, x_zp, multiplier, y_zp=0, lo=0, hi=255, out_dtype="uint8"):
    """`w` [N, K], as qtool.kernels.pack_gemm takes it."""
    return _pack(w, bias, 1, x_zp, multiplier, y_zp=int(y_zp), lo=lo, hi=hi, out_dtype=str(np.dtype(out_dtype)))


def _acc(p: SatPacked, a: np.ndarray, g: int) -> np.ndarray:
    """int64 accumulators of group `g` for raw uint8 rows `a` [M, K]."""
    og = p.rows.shape[0] // p.group
    rows = p.rows[g * og:(g + 1) * og]
    exact = np.rint((a.astype(np.float64) - p.x_zp) @ rows.T.astype(np.float64)).astype(np.int64)
    return exact + saturation_correction(a, rows, p.pairs[g])


def _finish(p: SatPacked, acc: np.ndarray, shape, out):
    acc = (acc + p.bias).astype(np.int32)
    if p.out_dtype == "float32":
        y = acc.astype(np.float32) * p.multiplier
    else:
        y = requantize(acc, p.multiplier, p.y_zp, p.lo, p.hi)
    if out is None:
        return y.reshape(shape)
    out[...] = y.reshape(shape)
    return out


def conv2d(p: SatPacked, x: np.ndarray, out=None):
    """x uint8 NHWC [N, H, W, Cin] -> uint8 [N, OH, OW, Cout]; padding reads x_zp, as ORT's does."""
    n, h, w, c = x.shape
    _, oh, ow, cout = p.out_shape(n, h, w)
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = p.strides, p.dilations, p.pads
    xp = np.full((n, h + pt + pb, w + pl + pr, c), p.x_zp, np.uint8)
    xp[:, pt:pt + h, pl:pl + w] = x
    s = xp.strides
    cols = np.lib.stride_tricks.as_strided(xp, (n, oh, ow, p.kh, p.kw, c),
                                           (s[0], s[1] * sh, s[2] * sw, s[1] * dh, s[2] * dw, s[3]), writeable=False)
    cig, og = c // p.group, cout // p.group
    acc = np.empty((n * oh * ow, cout), np.int64)
    rows = [(b, y) for b in range(n) for y in range(oh)]  # one output row of one image: ow pixels
    per = max(1, ROWS_PER_BLOCK // ow)
    for r in range(0, len(rows), per):
        # im2col of a block of output rows only: the whole copy would be kh*kw times the input
        blk = np.concatenate([cols[b, y] for b, y in rows[r:r + per]]).reshape(-1, p.kh, p.kw, c)
        r0 = r * ow
        for g in range(p.group):
            a = blk[..., g * cig:(g + 1) * cig].reshape(len(blk), -1)
            acc[r0:r0 + len(blk), g * og:(g + 1) * og] = _acc(p, a, g)
    return _finish(p, acc, (n, oh, ow, cout), out)


def gemm(p: SatPacked, x: np.ndarray, out=None):
    """x uint8 [M, K] -> uint8 (or float32) [M, N]."""
    return _finish(p, _acc(p, np.asarray(x), 0), (len(x), p.cout), out)
