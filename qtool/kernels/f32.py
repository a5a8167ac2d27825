"""float32 kernels of transformer graphs, on the native dispatch (AVX-512, AVX2, portable C; the
same bits on every tier): LayerNormalization and Softmax over the last axis, the erf GELU as
exporters write it, erf, ONNX Runtime's DynamicQuantizeLinear, and the dynamic MatMul's epilogue; and
ConvTranspose (NCHW, a GEMM then col2im, the GEMM's FMA sums differing by tier).
Each has a `bind_*` twin (arguments checked once, a zero-argument callable). Numpy references:
qtool.kernels.reference (`layernorm`, `softmax`, `gelu_erf`, ...); see API.md for the tolerances."""
from __future__ import annotations

import numpy as np

from dataclasses import dataclass, field

from qtool.kernel_params import DeconvGeometry

from . import _bind, _call, _native, _out, _pads
from .deconv_phases import deconv_out_hw

__all__ = ["pack_conv_transpose", "conv_transpose", "bind_conv_transpose", "matmul", "bind_matmul", "layernorm", "softmax", "gelu_erf", "erf", "dynamic_quantize", "dynamic_quantize_scaled", "dynamic_epilogue", "bind_layernorm",
           "bind_softmax", "bind_gelu_erf", "bind_erf", "bind_dynamic_quantize", "bind_dynamic_quantize_scaled",
           "bind_dynamic_epilogue"]


def _f32(x, name):
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous float32 array, got {getattr(x, 'dtype', type(x))} "
                         f"{getattr(x, 'shape', '')}")
    return x


def _row(v, n, name):
    if v is None:
        return None
    v = _f32(v, name)
    if v.size != n:
        raise ValueError(f"{name}: expected {n} values (the last axis), got shape {v.shape}")
    return v


@dataclass
class PackedDeconvF32:
    """A float32 ConvTranspose's weights as the kernel reads them: per group, W's transpose
    [Cout/g * KH * KW, Cin/g], packed once."""
    cin: int
    cout: int
    kh: int
    kw: int
    geometry: DeconvGeometry
    wt: np.ndarray = field(repr=False)
    bias: np.ndarray | None = field(repr=False)

    def out_shape(self, n, h, w):
        g = self.geometry
        return (n, self.cout) + deconv_out_hw(h, w, (self.kh, self.kw), tuple(g.strides), _pads(g.pads),
                                              tuple(g.output_padding))


def pack_conv_transpose(w, bias=None, geometry: DeconvGeometry = DeconvGeometry()) -> PackedDeconvF32:
    """w: float32 [Cin, Cout/group, KH, KW] (ONNX's ConvTranspose weight), bias [Cout] or None."""
    w = np.asarray(w, np.float32)
    g = int(geometry.group)
    if w.ndim != 4 or g < 1 or w.shape[0] % g:
        raise ValueError(f"ConvTranspose weight {w.shape} with group {g}: expected [Cin, Cout/group, KH, KW]")
    cin, og, kh, kw = (int(d) for d in w.shape)
    if len(tuple(geometry.strides)) != 2 or min(geometry.strides) < 1 or min(geometry.output_padding) < 0:
        raise ValueError(f"strides {geometry.strides} / output_padding {geometry.output_padding}")
    wt = np.ascontiguousarray(w.reshape(g, cin // g, og * kh * kw).transpose(0, 2, 1))
    b = None if bias is None else np.ascontiguousarray(np.asarray(bias, np.float32).reshape(-1))
    if b is not None and b.size != g * og:
        raise ValueError(f"bias: expected {g * og} values, got {b.size}")
    return PackedDeconvF32(cin, g * og, kh, kw, geometry, wt, b)


def _plan_conv_transpose(p: PackedDeconvF32, x, out):
    _f32(x, "x")
    if x.ndim != 4 or x.shape[1] != p.cin:
        raise ValueError(f"x: expected NCHW [N, {p.cin}, H, W], got {x.shape}")
    n, _, h, w = x.shape
    shape = p.out_shape(n, h, w)
    y = _out(out, shape, np.float32)
    g = p.geometry
    cols = np.empty(n * p.cout * p.kh * p.kw * h * w, np.float32)
    pads = _pads(g.pads)
    dims = (n, p.cin, h, w, int(g.group), p.cout // int(g.group), p.kh, p.kw, int(g.strides[0]), int(g.strides[1]),
            pads[0], pads[1], shape[2], shape[3])
    return y, _native.f32_deconv, (x, p.wt, p.bias, y, cols, dims)


def conv_transpose(p: PackedDeconvF32, x, out=None):
    """float32 NCHW ConvTranspose (dilations 1): ONNX's, with pads and output_padding from the geometry."""
    return _call(_plan_conv_transpose(p, x, out))


def bind_conv_transpose(p: PackedDeconvF32, x, out):
    return _bind(_plan_conv_transpose(p, x, out))


def _plan_matmul(a, b, out):
    for v, name in ((a, "a"), (b, "b")):
        if not isinstance(v, np.ndarray) or v.dtype != np.float32 or v.ndim < 2:
            raise ValueError(f"{name}: expected a float32 array of rank 2 or more, got {getattr(v, 'dtype', type(v))} "
                             f"{getattr(v, 'shape', '')}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: a {a.shape} and b {b.shape} do not chain")
    shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    y = _out(out, shape, np.float32)
    return y, _native.matmul, (a, b, y)


def matmul(a, b, out=None):
    """numpy's matmul for float32 arrays of rank >= 2 (the leading dims broadcast), any strides (transposed
    views are read in place): sums in k order, with FMA where the ISA has it (not a BLAS's bits)."""
    return _call(_plan_matmul(a, b, out))


def bind_matmul(a, b, out):
    return _bind(_plan_matmul(a, b, out))


def _plan_layernorm(x, gamma, beta, eps, out, residual=None, sum_out=None):
    _f32(x, "x")
    n = x.shape[-1] if x.ndim else 1
    y = _out(out, x.shape, np.float32)
    if residual is not None and _f32(residual, "residual").shape != x.shape:
        raise ValueError(f"residual: shape {residual.shape}, not x's {x.shape}")
    if sum_out is not None:
        _out(sum_out, x.shape, np.float32)
    return y, _native.layernorm, (x, residual, sum_out, _row(gamma, n, "gamma"), _row(beta, n, "beta"), y,
                                  x.size // max(n, 1), n, float(eps))


def layernorm(x, gamma=None, beta=None, eps=1e-5, out=None, residual=None, sum_out=None):
    """Over the last axis: y = (x - mean) / sqrt(var + eps) * gamma + beta (float32, two passes); with
    `residual`, of s = x + residual (one float32 add, as an Add node), s also written to `sum_out` if given."""
    return _call(_plan_layernorm(x, gamma, beta, eps, out, residual, sum_out))


def bind_layernorm(x, gamma, beta, eps, out, residual=None, sum_out=None):
    return _bind(_plan_layernorm(x, gamma, beta, eps, out, residual, sum_out))


def _plan_softmax(x, out, scale=None, mask=None):
    _f32(x, "x")
    y = _out(out, x.shape, np.float32)
    n = x.shape[-1] if x.ndim else 1
    rows = x.size // max(n, 1)
    k, div = (1.0, -1) if scale is None else (float(np.float32(scale[0])), int(bool(scale[1])))
    mrows = 1
    if mask is not None:
        _f32(mask, "mask")
        mrows = mask.size // max(n, 1)
        if mask.size % max(n, 1) or not mrows or rows % mrows:
            raise ValueError(f"mask: {mask.shape} does not give whole rows of {n} for {rows} rows")
        if div < 0:
            k, div = 1.0, 0
    return y, _native.softmax, (x, y, rows, n, k, div, mask, mrows)


def softmax(x, out=None, scale=None, mask=None):
    """Over the last axis: exp(s - max) / sum(...) of s = x, or of s = (x * k or x / k) + mask with
    scale = (k, divide) and mask rows of n (row r takes mask row r // (rows / mask rows)), computed in
    that float32 order (out may be x)."""
    return _call(_plan_softmax(x, out, scale, mask))


def bind_softmax(x, out, scale=None, mask=None):
    return _bind(_plan_softmax(x, out, scale, mask))


def _plan_gelu(x, k_in, div, k_add, k_out, out):
    y = _out(out, _f32(x, "x").shape, np.float32)
    return y, _native.gelu, (x, y, float(np.float32(k_in)), int(bool(div)), float(np.float32(k_add)),
                             float(np.float32(k_out)))


def gelu_erf(x, k_in, div, k_add, k_out, out=None):
    """y = (x * (erf(x / k_in or x * k_in) + k_add)) * k_out, in that float32 order (the nodes of an
    exported GELU: Div by sqrt 2, Erf, Add 1, Mul by x, Mul by 0.5)."""
    return _call(_plan_gelu(x, k_in, div, k_add, k_out, out))


def bind_gelu_erf(x, k_in, div, k_add, k_out, out):
    return _bind(_plan_gelu(x, k_in, div, k_add, k_out, out))


def _plan_erf(x, out):
    y = _out(out, _f32(x, "x").shape, np.float32)
    return y, _native.erf, (x, y)


def erf(x, out=None):
    """erf in float32, bit for bit qtool.runtime.fp32_ops_transformer.erf32."""
    return _call(_plan_erf(x, out))


def bind_erf(x, out):
    return _bind(_plan_erf(x, out))


def _plan_dynamic_quantize(x, out, scale, zp):
    _f32(x, "x")
    y = _out(out, x.shape, np.uint8)
    scale = _out(scale, (), np.float32)
    zp = _out(zp, (), np.uint8)
    return (y, scale, zp), _native.dynamic_quantize, (x, y, scale, zp)


def dynamic_quantize(x, out=None, scale=None, zp=None):
    """ONNX Runtime's DynamicQuantizeLinear: -> (uint8 y, float32 scale, uint8 zero point), the two
    last as 0-d arrays (written in place when given)."""
    return _call(_plan_dynamic_quantize(x, out, scale, zp))


def bind_dynamic_quantize(x, out, scale, zp):
    return _bind(_plan_dynamic_quantize(x, out, scale, zp))


def _plan_dynamic_quantize_scaled(x, m, out, scale, zp):
    _f32(x, "x")
    m = _row(m, x.shape[-1] if x.ndim else 0, "multiplier")
    y = _out(out, x.shape, np.uint8)
    scale = _out(scale, (), np.float32)
    zp = _out(zp, (), np.uint8)
    return (y, scale, zp), _native.dynamic_quantize_scaled, (x, m, y, scale, zp)


def dynamic_quantize_scaled(x, m, out=None, scale=None, zp=None):
    """dynamic_quantize of x * m, m float32 [n] over x's last axis: the float32 products as a Mul by
    that row computes them, quantized without being written."""
    return _call(_plan_dynamic_quantize_scaled(x, m, out, scale, zp))


def bind_dynamic_quantize_scaled(x, m, out, scale, zp):
    return _bind(_plan_dynamic_quantize_scaled(x, m, out, scale, zp))


def _plan_epilogue(y, scale, zp, colsum, w_scale, bias):
    _f32(y, "y")
    n = y.shape[-1]
    _out(scale, (), np.float32)
    _out(zp, (), np.uint8)
    return y, _native.dynamic_epilogue, (y, y.size // n, n, scale, zp, _row(colsum, n, "colsum"),
                                         _row(w_scale, n, "w_scale"), _row(bias, n, "bias"))


def dynamic_epilogue(y, scale, zp, colsum, w_scale, bias=None):
    """In place on y = float32(sum(x_u8 * w)) [..., N]: y = (y - float32(zp) * colsum) * float32(scale *
    w_scale) (+ bias), ONNX Runtime's MatMulIntegerToFloat bit for bit (qtool.runtime.dynamic_quant)."""
    return _call(_plan_epilogue(y, scale, zp, colsum, w_scale, bias))


def bind_dynamic_epilogue(y, scale, zp, colsum, w_scale, bias=None):
    return _bind(_plan_epilogue(y, scale, zp, colsum, w_scale, bias))

