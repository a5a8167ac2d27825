"""fp32 numpy implementations of the ops transformer exports carry (normalizations, softmax by
opset, erf-based activations, masks, comparisons, cubic resampling), merged into fp32_ops.FP32_OPS.

Same contract as fp32_ops: `fn(inputs, attrs) -> list of outputs`. attrs may carry `_opset` (the
model's default-domain opset, set by the compiler) where an op's meaning changed between opsets:
Softmax, LogSoftmax and Hardmax before 13 flatten the input to 2-D at `axis` (default 1); from 13
they act along one axis (default -1). Without `_opset` the newest meaning is taken.
"""
from __future__ import annotations

import math

import numpy as np

from qtool.runtime.dynamic_quant import dynamic_qparams, quantize_u8
from qtool.runtime.reduce_op import reducer

OPS = {}


def op(*names):
    def deco(fn):
        for n in names:
            OPS[n] = fn
        return fn
    return deco


def _str(v, default):
    v = default if v is None else v
    return v.decode() if isinstance(v, bytes) else v


# ---- erf: x * P(x^2) / Q(x^2) on [-4, 4] (beyond, float32 erf is +-1), the rational form of Eigen's
# and XLA's float erf; within 7 float32 ulps (4.2e-7) of math.erf. In float32, in place: Erf is the
# inner op of every BERT/ViT GELU, on [tokens, 4 * hidden] tensors.
_ERF_P = [-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02]
_ERF_Q = [-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02]


def _horner(x2, coefs):
    p = np.full_like(x2, np.float32(coefs[0]))
    for c in coefs[1:]:
        p *= x2
        p += np.float32(c)
    return p


def erf32(x):
    x = np.clip(np.asarray(x, np.float32), np.float32(-4), np.float32(4))
    x2 = x * x
    p = _horner(x2, _ERF_P)
    p *= x
    p /= _horner(x2, _ERF_Q)
    return p


@op("Erf")
def erf(ins, at):
    x = ins[0]
    return [erf32(x).astype(x.dtype, copy=False)]


@op("Gelu")
def gelu(ins, at):
    """opset 20: approximate='none' x/2 (1 + erf(x / sqrt 2)), 'tanh' the tanh form."""
    x = ins[0]
    xd = x.astype(np.float64)
    if _str(at.get("approximate"), "none") == "tanh":
        y = 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    else:
        y = 0.5 * xd * (1 + erf32(x * np.float32(1 / math.sqrt(2))))
    return [y.astype(x.dtype)]


# ---- normalization -------------------------------------------------------------------------
@op("LayerNormalization")
def layer_norm(ins, at):
    """opset 17: normalize over axes [axis, rank); outputs Y and, if asked, Mean and InvStdDev
    (shape of X with the normalized axes kept as 1). In float32 (stash_type 1) with numpy's pairwise
    sums, in place: it runs twice per transformer layer."""
    x, scale = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    axis = int(at.get("axis", -1)) % x.ndim
    eps = float(at.get("epsilon", 1e-5))
    axes = tuple(range(axis, x.ndim))
    ct = np.float32 if x.dtype == np.float32 and int(at.get("stash_type", 1)) == 1 else np.float64
    xc = x.astype(ct)
    mean = xc.mean(axis=axes, keepdims=True)
    d = xc - mean
    var = np.square(d).mean(axis=axes, keepdims=True)
    inv = ct(1) / np.sqrt(var + ct(eps))
    d *= inv
    d *= scale.astype(ct, copy=False)
    if bias is not None:
        d += bias.astype(ct, copy=False)
    return [d.astype(x.dtype, copy=False), mean, inv]


def _two_d(x, at, f):
    """Softmax-like ops: along `axis` from opset 13, on the input flattened to 2-D at `axis` before."""
    if at.get("_opset", 13) >= 13:
        return f(x, int(at.get("axis", -1)))
    axis = int(at.get("axis", 1)) % max(x.ndim, 1)
    lead = int(np.prod(x.shape[:axis], dtype=np.int64))
    return f(x.reshape(lead, -1), 1).reshape(x.shape)


def _softmax(x, axis):
    e = x - x.max(axis=axis, keepdims=True)  # (in place from here: attention's [heads, L, L] each layer)
    np.exp(e, out=e)
    e /= e.sum(axis=axis, keepdims=True)
    return e.astype(x.dtype, copy=False)


def _log_softmax(x, axis):
    s = x - x.max(axis=axis, keepdims=True)
    return (s - np.log(np.exp(s).sum(axis=axis, keepdims=True))).astype(x.dtype)


def _hardmax(x, axis):
    i = np.expand_dims(np.argmax(x, axis=axis), axis)
    y = np.zeros_like(x)
    np.put_along_axis(y, i, 1, axis=axis)
    return y


OPS["Softmax"] = lambda ins, at: [_two_d(ins[0], at, _softmax)]
OPS["LogSoftmax"] = lambda ins, at: [_two_d(ins[0], at, _log_softmax)]
OPS["Hardmax"] = lambda ins, at: [_two_d(ins[0], at, _hardmax)]


# ---- masks, comparisons, small math ---------------------------------------------------------
@op("Trilu")
def trilu(ins, at):
    x = ins[0]
    k = int(np.asarray(ins[1]).reshape(())) if len(ins) > 1 and ins[1] is not None else 0
    return [np.triu(x, k) if int(at.get("upper", 1)) else np.tril(x, k)]


def _binary(f):
    return lambda ins, at: [np.asarray(f(ins[0], ins[1]))]


for _name, _f in {"GreaterOrEqual": np.greater_equal, "LessOrEqual": np.less_equal, "Xor": np.logical_xor,
                  "BitwiseAnd": np.bitwise_and, "BitwiseOr": np.bitwise_or}.items():
    OPS[_name] = _binary(_f)

for _name, _f in {"Sin": np.sin, "Cos": np.cos, "Sign": np.sign, "Round": np.rint, "Atan": np.arctan,
                  "BitwiseNot": np.invert}.items():
    OPS[_name] = (lambda f: lambda ins, at: [np.asarray(f(ins[0])).astype(ins[0].dtype)])(_f)
OPS["IsNaN"] = lambda ins, at: [np.isnan(ins[0])]


@op("Softplus")
def softplus(ins, at):
    x = ins[0]
    return [np.logaddexp(0, x.astype(np.float64)).astype(x.dtype)]


@op("Mod")
def mod(ins, at):
    a, b = ins
    if int(at.get("fmod", 0)):
        return [np.fmod(a, b).astype(a.dtype)]
    return [np.mod(a, b).astype(a.dtype)]


@op("IsInf")
def is_inf(ins, at):
    x = ins[0]
    pos, neg = int(at.get("detect_positive", 1)), int(at.get("detect_negative", 1))
    return [(np.isposinf(x) & bool(pos)) | (np.isneginf(x) & bool(neg))]


@op("CumSum")
def cumsum(ins, at):
    x, axis = ins[0], int(np.asarray(ins[1]).reshape(()))
    y = np.flip(x, axis) if int(at.get("reverse", 0)) else x
    s = np.cumsum(y, axis=axis, dtype=x.dtype)
    if int(at.get("exclusive", 0)):
        s = s - y
    return [np.flip(s, axis) if int(at.get("reverse", 0)) else s]


def _arg(f, flipped):
    def fn(ins, at):
        x = ins[0]
        axis = int(at.get("axis", 0)) % x.ndim
        if int(at.get("select_last_index", 0)):
            i = x.shape[axis] - 1 - f(np.flip(x, axis), axis=axis)
        else:
            i = f(x, axis=axis)
        i = i.astype(np.int64)
        return [np.expand_dims(i, axis) if int(at.get("keepdims", 1)) else i]
    return fn


OPS["ArgMax"] = _arg(np.argmax, False)
OPS["ArgMin"] = _arg(np.argmin, False)


@op("Einsum")
def einsum(ins, at):
    eq = _str(at.get("equation"), "")
    return [np.einsum(eq.replace(" ", ""), *ins)]


OPS["ReduceL2"] = reducer(lambda x, axis, keepdims: np.sqrt(np.sum(np.square(x.astype(np.float64)), axis,
                                                                   keepdims=keepdims)))
OPS["ReduceL1"] = reducer(lambda x, axis, keepdims: np.sum(np.abs(x), axis, keepdims=keepdims))
OPS["ReduceSumSquare"] = reducer(lambda x, axis, keepdims: np.sum(np.square(x), axis, keepdims=keepdims))
OPS["ReduceProd"] = reducer(lambda x, axis, keepdims: np.prod(x, axis, keepdims=keepdims))
OPS["ReduceLogSumExp"] = reducer(lambda x, axis, keepdims: np.log(np.sum(np.exp(x.astype(np.float64)), axis,
                                                                            keepdims=keepdims)))


@op("Expand")
def expand(ins, at):
    x, s = ins
    y = np.empty(np.broadcast_shapes(x.shape, tuple(int(d) for d in s)), x.dtype)
    y[...] = x  # (a third faster than broadcast_to(...).copy())
    return [y]


@op("Range")
def range_(ins, at):
    """n = max(ceil((limit - start) / delta), 0) values start + i * delta, in the inputs' type."""
    s, lim, d = (np.asarray(v).reshape(()) for v in ins)
    n = max(int(np.ceil((float(lim) - float(s)) / float(d))), 0)
    if np.issubdtype(s.dtype, np.integer):
        return [(s + np.arange(n, dtype=np.int64) * d).astype(s.dtype)]
    return [(s + np.arange(n, dtype=s.dtype) * d).astype(s.dtype)]


@op("DynamicQuantizeLinear")
def dynamic_quantize_linear(ins, at):
    """uint8 per tensor with the range widened to include 0: scale = (max - min) / 255 (1 when the
    range is empty, as ONNX Runtime does), zero point = saturate(round(-min / scale)), half to even."""
    x = ins[0]
    s, z = dynamic_qparams(x)
    return [quantize_u8(x, s, z), np.float32(s), np.uint8(z)]


@op("MatMulInteger")
def matmul_integer(ins, at):
    """(a - a_zero_point) @ (b - b_zero_point) in int32, numpy's broadcasting; a zero point one, or one per
    row of a 2-D a / per column of a 2-D b, as ONNX defines it."""
    a, b = ins[0], ins[1]
    za = ins[2] if len(ins) > 2 and ins[2] is not None else np.zeros((), a.dtype)
    zb = ins[3] if len(ins) > 3 and ins[3] is not None else np.zeros((), b.dtype)
    za = np.asarray(za, np.int64)
    za = za.reshape(-1, 1) if za.size > 1 else za.reshape(())  # (one per row of a 2-D a)
    return [np.matmul(a.astype(np.int64) - za, b.astype(np.int64) - np.asarray(zb, np.int64)).astype(np.int32)]


# ---- cubic resampling (mode='cubic' of Resize) -------------------------------------------------
def cubic_weights(frac, a):
    """The 4 taps' weights at offsets -1, 0, 1, 2 for fractional positions `frac` (Keys' kernel)."""
    d = np.stack([1 + frac, frac, 1 - frac, 2 - frac], axis=-1)
    ad = np.abs(d)
    near = ((a + 2) * ad - (a + 3)) * ad * ad + 1
    far = ((a * ad - 5 * a) * ad + 8 * a) * ad - 4 * a
    return np.where(ad <= 1, near, np.where(ad < 2, far, 0.0))


def cubic_axis(y, ax, src, at):
    """Resample axis `ax` of y at source positions `src` with Keys' cubic (coefficient
    cubic_coeff_a, default -0.75); taps outside the input take its edge, or with exclude_outside=1
    get weight 0 and the others are renormalized."""
    n_in = y.shape[ax]
    a = float(at.get("cubic_coeff_a", -0.75))
    base = np.floor(src).astype(np.int64)
    w = cubic_weights(src - base, a)
    idx = base[:, None] + np.arange(-1, 3)[None, :]
    if int(at.get("exclude_outside", 0)):
        w = np.where((idx >= 0) & (idx < n_in), w, 0.0)
        w = w / w.sum(axis=1, keepdims=True)
    idx = np.clip(idx, 0, n_in - 1)
    yd = np.moveaxis(y.astype(np.float64), ax, -1)
    out = np.einsum("...ok,ok->...o", yd[..., idx], w)
    return np.moveaxis(out, -1, ax).astype(y.dtype)


@op("NonZero")
def nonzero(ins, at):
    x = ins[0]
    return [np.array(np.nonzero(x.reshape(1) if x.ndim == 0 else x), np.int64).reshape(max(x.ndim, 1), -1)]
