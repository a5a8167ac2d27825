"""fp32 numpy implementations of the ONNX ops the runtime does not run in int8.

One function per op, `fn(inputs, attrs) -> list of outputs`, registered by name in FP32_OPS.
They serve two purposes: ops with no int8 kernel run here (dequantize before, quantize
after), and constant subgraphs (shape arithmetic, folded weights) are evaluated once at load.
Semantics follow the ONNX operator specs (opset 11-19) for the common cases; an attribute
combination that is not supported raises NotImplementedError with the op and attribute named,
which the loader turns into a QtoolError.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from qtool.runtime.fp32_ops_transformer import OPS as TRANSFORMER_OPS
from qtool.runtime.reduce_op import reducer
from qtool.runtime.fp32_ops_transformer import cubic_axis
from qtool.windows import out_size

FP32_OPS = {}


def op(*names):
    def deco(fn):
        for n in names:
            FP32_OPS[n] = fn
        return fn
    return deco


def _elementwise(f):
    return lambda ins, at: [f(*ins)]


# the arithmetic writes C order whatever its inputs' (numpy's default follows a transposed input's memory
# order): the kernels after it read rows in place (MPNet's position bias + mask, a transposed view plus a
# row, reached the native Softmax strided and was copied there on every run)
for _name, _f in {
    "Add": functools.partial(np.add, order="C"), "Sub": functools.partial(np.subtract, order="C"),
    "Mul": functools.partial(np.multiply, order="C"), "Pow": lambda a, b: np.power(a, b).astype(a.dtype, copy=False),
    "Sqrt": np.sqrt, "Exp": np.exp, "Log": np.log, "Neg": np.negative, "Abs": np.abs,
    "Floor": np.floor, "Ceil": np.ceil, "Reciprocal": np.reciprocal, "Tanh": np.tanh,
    "Equal": np.equal, "Less": np.less, "Greater": np.greater, "Not": np.logical_not,
    "And": np.logical_and, "Or": np.logical_or, "Where": np.where,
    "Identity": lambda a: a,
}.items():
    FP32_OPS[_name] = _elementwise(_f)


@op("Div")
def div(ins, at):
    a, b = ins
    if np.issubdtype(a.dtype, np.integer) and np.issubdtype(b.dtype, np.integer):
        return [(np.trunc(a / b)).astype(a.dtype)]
    return [np.divide(a, b, order="C").astype(np.result_type(a, b), copy=False)]


def _reduce_variadic(f):
    def fn(ins, at):
        out = ins[0]
        for x in ins[1:]:
            out = f(out, x)
        return [out]
    return fn


FP32_OPS["Min"] = _reduce_variadic(np.minimum)
FP32_OPS["Max"] = _reduce_variadic(np.maximum)
FP32_OPS["Sum"] = _reduce_variadic(np.add)
FP32_OPS["Mean"] = lambda ins, at: [_reduce_variadic(np.add)(ins, at)[0] / np.float32(len(ins))]


@op("Relu")
def relu(ins, at):
    return [np.maximum(ins[0], 0).astype(ins[0].dtype)]


@op("LeakyRelu")
def leaky_relu(ins, at):
    x = ins[0]
    return [np.where(x >= 0, x, x * np.float32(at.get("alpha", 0.01))).astype(x.dtype)]


@op("Clip")
def clip(ins, at):
    x = ins[0]
    lo = ins[1] if len(ins) > 1 and ins[1] is not None else at.get("min", None)
    hi = ins[2] if len(ins) > 2 and ins[2] is not None else at.get("max", None)
    if lo is not None:
        x = np.maximum(x, np.asarray(lo, x.dtype))
    if hi is not None:
        x = np.minimum(x, np.asarray(hi, x.dtype))
    return [x]


@op("Sigmoid")
def sigmoid(ins, at):
    x = ins[0]
    return [_sig(x).astype(x.dtype)]


def _sig(v):
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x below about -88: 1 / inf = 0, as it should
        return 1.0 / (1.0 + np.exp(-v))


@op("HardSigmoid")
def hard_sigmoid(ins, at):
    x = ins[0]
    a, b = np.float32(at.get("alpha", 0.2)), np.float32(at.get("beta", 0.5))
    return [np.clip(x * a + b, 0, 1).astype(x.dtype)]


@op("HardSwish")
def hard_swish(ins, at):
    x = ins[0]
    return [(x * np.clip(x * np.float32(1 / 6) + np.float32(0.5), 0, 1)).astype(x.dtype)]


@functools.lru_cache(maxsize=None)
def _np_dtype(onnx_type: int):
    from onnx.helper import tensor_dtype_to_np_dtype
    return tensor_dtype_to_np_dtype(onnx_type)


@op("Cast")
def cast(ins, at):
    return [ins[0].astype(_np_dtype(int(at["to"])))]


@op("Shape")
def shape(ins, at):
    s = np.array(ins[0].shape, np.int64)
    return [s[at.get("start", 0):at.get("end", None)]]


@op("Size")
def size(ins, at):
    return [np.array(ins[0].size, np.int64)]


@op("ConstantOfShape")
def constant_of_shape(ins, at):
    v = at.get("value")
    v = np.zeros(1, np.float32) if v is None else v
    return [np.full(tuple(int(d) for d in ins[0]), v.reshape(-1)[0], v.dtype)]


@op("Reshape")
def reshape(ins, at):
    x, s = ins
    s = [int(d) for d in s]
    if not at.get("allowzero", 0):
        s = [x.shape[i] if d == 0 else d for i, d in enumerate(s)]
    return [x.reshape(s)]


@op("Flatten")
def flatten(ins, at):
    x = ins[0]
    ax = at.get("axis", 1) % max(x.ndim, 1) if at.get("axis", 1) != x.ndim else x.ndim
    return [x.reshape(int(np.prod(x.shape[:ax])), -1)]


@op("Transpose")
def transpose(ins, at):
    return [np.transpose(ins[0], at.get("perm"))]


def _axes(ins, at):
    if len(ins) > 1 and ins[1] is not None:
        return [int(a) for a in ins[1]]
    return at.get("axes")


@op("Squeeze")
def squeeze(ins, at):
    ax = _axes(ins, at)
    return [np.squeeze(ins[0], axis=None if ax is None else tuple(ax))]


@op("Unsqueeze")
def unsqueeze(ins, at):
    x = ins[0]
    axes = _axes(ins, at)
    rank = x.ndim + len(axes)
    shape = list(x.shape)
    for a in sorted(a % rank for a in axes):
        shape.insert(a, 1)
    return [x.reshape(shape)]  # (a view, as np.expand_dims gives, without its checks: a few us per call)


@op("Concat")
def concat(ins, at):
    return [np.concatenate([i for i in ins if i is not None], axis=at["axis"])]


@op("Split")
def split(ins, at, n_out=None):
    x = ins[0]
    axis = at.get("axis", 0)
    sp = ins[1] if len(ins) > 1 and ins[1] is not None else at.get("split")
    if sp is None:  # equal parts; opset 18's num_outputs: the last part is the smaller one
        n = at.get("num_outputs", at["_n_outputs"])
        size = -(-x.shape[axis] // n)
        sp = [size] * (n - 1) + [x.shape[axis] - size * (n - 1)]
    idx = np.cumsum(sp)[:-1]
    return list(np.split(x, idx, axis=axis))


@op("Gather")
def gather(ins, at):
    return [np.take(ins[0], ins[1].astype(np.int64), axis=at.get("axis", 0))]


@op("GatherElements")
def gather_elements(ins, at):
    x, i = ins[0], ins[1].astype(np.int64)
    ax = at.get("axis", 0) % x.ndim
    # the output has the indices' shape: off the axis they may be shorter than the data (no broadcasting)
    x = x[tuple(slice(None) if d == ax else slice(0, n) for d, n in enumerate(i.shape))]
    return [np.take_along_axis(x, np.where(i < 0, i + x.shape[ax], i), axis=ax)]


@op("DepthToSpace")
def depth_to_space(ins, at):
    x, b = ins[0], int(at["blocksize"])
    n, c, h, w = x.shape
    mode = at.get("mode", b"DCR")
    if (mode.decode() if isinstance(mode, bytes) else mode) == "DCR":
        y = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:  # CRD
        y = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    return [y.reshape(n, c // (b * b), h * b, w * b)]


@op("SpaceToDepth")
def space_to_depth(ins, at):
    x, b = ins[0], int(at["blocksize"])
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b).transpose(0, 3, 5, 1, 2, 4)
    return [y.reshape(n, c * b * b, h // b, w // b)]


@op("Slice")
def slice_(ins, at):
    x = ins[0]
    if len(ins) > 1:
        starts, ends = ins[1], ins[2]
        axes = ins[3] if len(ins) > 3 and ins[3] is not None else range(len(starts))
        steps = ins[4] if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    else:
        starts, ends = at["starts"], at["ends"]
        axes = at.get("axes", range(len(starts)))
        steps = [1] * len(starts)
    sl = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = int(a) % x.ndim
        n = x.shape[a]
        s, e, st = int(s), int(e), int(st)
        s = max(-n - 1, min(s, n)) if st < 0 else max(-n, min(s, n))
        e = max(-n - 1, min(e, n))
        if st < 0 and e < -n:
            e = None
        sl[a] = slice(s, e, st)
    return [x[tuple(sl)]]


@op("Tile")
def tile(ins, at):
    return [np.tile(ins[0], tuple(int(r) for r in ins[1]))]


@op("Pad")
def pad(ins, at):
    x = ins[0]
    pads = ins[1] if len(ins) > 1 else at["pads"]
    cval = ins[2].reshape(-1)[0] if len(ins) > 2 and ins[2] is not None and ins[2].size else at.get("value", 0)
    if len(ins) > 3 and ins[3] is not None:
        raise NotImplementedError("Pad with axes input")
    mode = at.get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    pads = [int(p) for p in pads]
    r = x.ndim
    begin, end = pads[:r], pads[r:]
    # negative pads crop
    sl = tuple(slice(-b if b < 0 else None, e if e < 0 else None) for b, e in zip(begin, end))
    x = x[sl]
    pw = [(max(b, 0), max(e, 0)) for b, e in zip(begin, end)]
    if mode == "constant":
        return [np.pad(x, pw, mode="constant", constant_values=cval)]
    if mode in ("reflect", "edge"):
        return [np.pad(x, pw, mode=mode)]
    raise NotImplementedError(f"Pad mode={mode}")


FP32_OPS["ReduceMean"] = reducer(np.mean)
FP32_OPS["ReduceSum"] = reducer(np.sum)
FP32_OPS["ReduceMax"] = reducer(np.max)
FP32_OPS["ReduceMin"] = reducer(np.min)


@op("MatMul")
def matmul(ins, at):
    # strided views (attention's transposed heads) take numpy's loop instead of BLAS: 100x slower
    a, b = (x if x.ndim < 3 or x.flags.c_contiguous else np.ascontiguousarray(x) for x in ins[:2])
    return [np.matmul(a, b)]


@op("Gemm")
def gemm(ins, at):
    a, b = ins[0], ins[1]
    a = a.T if at.get("transA", 0) else a
    b = b.T if at.get("transB", 0) else b
    y = np.float32(at.get("alpha", 1.0)) * (a @ b)
    if len(ins) > 2 and ins[2] is not None:
        y = y + np.float32(at.get("beta", 1.0)) * ins[2]
    return [y.astype(np.float32)]


@op("BatchNormalization")
def batch_norm(ins, at):
    x, g, b, m, v = ins[:5]
    sh = (1, -1) + (1,) * (x.ndim - 2)
    k = (g / np.sqrt(v + np.float32(at.get("epsilon", 1e-5)))).astype(np.float32)
    return [(x * k.reshape(sh) + (b - m * k).reshape(sh)).astype(np.float32)]


MAX_WINDOW_ELEMS = 1 << 28  # a Conv/pool's padded input or im2col taps x output, per batch


def check_window(x_shape, k_hw, strides, dilations, pads, what="window"):
    """The attributes of a Conv or pool are a model's to choose: kernel, strides and dilations >= 1,
    pads >= 0, an output of at least one element, and a padded input and kernel x output that stay
    under MAX_WINDOW_ELEMS, checked before any loop over the taps or any padding is allocated."""
    if len(k_hw) != 2 or len(strides) != 2 or len(dilations) != 2 or len(pads) != 4:
        raise ValueError(f"{what} needs 2 kernel sizes, strides and dilations and 4 pads, has {list(k_hw)}, "
                         f"{list(strides)}, {list(dilations)}, {list(pads)}")
    if min(k_hw) < 1 or min(strides) < 1 or min(dilations) < 1 or min(pads) < 0:
        raise ValueError(f"{what} kernel {list(k_hw)}, strides {list(strides)}, dilations {list(dilations)} must be "
                         f">= 1 and pads {list(pads)} >= 0")
    n, c = int(x_shape[0]), int(x_shape[1])
    padded = [int(x_shape[2 + i]) + pads[i] + pads[i + 2] for i in range(2)]
    out = [(padded[i] - (k_hw[i] - 1) * dilations[i] - 1) // strides[i] + 1 for i in range(2)]
    if min(out) < 1:
        raise ValueError(f"{what} kernel {list(k_hw)} (dilations {list(dilations)}) does not fit the padded input "
                         f"{padded}")
    if n * c * padded[0] * padded[1] > MAX_WINDOW_ELEMS or n * c * k_hw[0] * k_hw[1] * out[0] * out[1] > MAX_WINDOW_ELEMS:
        raise ValueError(f"{what} on input {list(x_shape)} with kernel {list(k_hw)} and pads {list(pads)} is over "
                         f"{MAX_WINDOW_ELEMS} elements")
    return out


def conv_pads(at, in_hw, k_hw):
    """Explicit [top, left, bottom, right]-style pads (ONNX order: begins then ends)."""
    nd = len(k_hw)
    strides = at.get("strides", [1] * nd)
    dil = at.get("dilations", [1] * nd)
    ap = at.get("auto_pad", b"NOTSET")
    ap = ap.decode() if isinstance(ap, bytes) else ap
    if ap in ("NOTSET", ""):
        return list(at.get("pads", [0] * (2 * nd)))
    if ap == "VALID":
        return [0] * (2 * nd)
    begins, ends = [], []
    for i in range(nd):
        out = -(-in_hw[i] // strides[i])
        total = max(0, (out - 1) * strides[i] + (k_hw[i] - 1) * dil[i] + 1 - in_hw[i])
        small, big = total // 2, total - total // 2
        begins.append(small if ap == "SAME_UPPER" else big)
        ends.append(big if ap == "SAME_UPPER" else small)
    return begins + ends


@dataclass(frozen=True)
class Window2d:
    """A 2-D sliding window over a padded NCHW tensor: kernel, strides, dilations, and the output
    grid it covers."""
    kh: int
    kw: int
    sh: int
    sw: int
    dh: int
    dw: int
    oh: int
    ow: int


def _im2col(x, win: Window2d):
    """x: padded NCHW -> [N, C, kh, kw, oh, ow] strided view."""
    n, c, h, w = x.shape
    s = x.strides
    return np.lib.stride_tricks.as_strided(
        x, (n, c, win.kh, win.kw, win.oh, win.ow),
        (s[0], s[1], s[2] * win.dh, s[3] * win.dw, s[2] * win.sh, s[3] * win.sw), writeable=False)


@op("Conv")
def conv(ins, at):
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    if x.ndim != 4:
        raise NotImplementedError(f"Conv on rank {x.ndim} input")
    o, ci, kh, kw = w.shape
    g = at.get("group", 1)
    sh, sw = at.get("strides", [1, 1])
    dh, dw = at.get("dilations", [1, 1])
    p = conv_pads(at, x.shape[2:], (kh, kw))
    check_window(x.shape, (kh, kw), (sh, sw), (dh, dw), p, "Conv")
    if ci * g != x.shape[1] or g < 1 or o % g:
        raise ValueError(f"Conv weight {list(w.shape)} with group {g} does not fit input {list(x.shape)}")
    xp = np.pad(x, ((0, 0), (0, 0), (p[0], p[2]), (p[1], p[3])))
    oh = (xp.shape[2] - (kh - 1) * dh - 1) // sh + 1
    ow = (xp.shape[3] - (kw - 1) * dw - 1) // sw + 1
    cols = _im2col(xp, Window2d(kh, kw, sh, sw, dh, dw, oh, ow))
    n = x.shape[0]
    og = o // g
    outs = []
    for gi in range(g):
        cg = cols[:, gi * ci:(gi + 1) * ci].reshape(n, ci * kh * kw, oh * ow)
        wg = w[gi * og:(gi + 1) * og].reshape(og, -1)
        outs.append(np.matmul(wg, cg))
    y = np.concatenate(outs, axis=1).reshape(n, o, oh, ow)
    if b is not None:
        y = y + b.reshape(1, -1, 1, 1)
    return [y.astype(np.float32)]


def _as_2d(at: dict) -> dict:
    """A 1-D ConvTranspose's attributes as those of the 2-D one over a height-1 input."""
    two = dict(at)
    for k, fill in (("strides", 1), ("dilations", 1), ("output_padding", 0), ("kernel_shape", 1)):
        if at.get(k) is not None:
            two[k] = [fill] + list(at[k])
    if at.get("pads") is not None:
        two["pads"] = [0, at["pads"][0], 0, at["pads"][1]]
    if at.get("output_shape") is not None:
        two["output_shape"] = [1] + list(at["output_shape"])[-1:]
    return two


@op("ConvTranspose")
def conv_transpose(ins, at):
    """Each input pixel scatters its kernel into the output (stride apart), per group; then the pads are
    cut off (or, with output_shape, the pads it implies: ONNX's rule, SAME_UPPER puts the odd one last).
    1-D: the 2-D one over a height-1 input."""
    x, w = ins[0], ins[1]
    if x.ndim == 3 and w.ndim == 3:
        y = conv_transpose([x[:, :, None], w[:, :, None]] + list(ins[2:]), _as_2d(at))[0]
        return [y[:, :, 0]]
    b = ins[2] if len(ins) > 2 else None
    if x.ndim != 4 or w.ndim != 4:
        raise NotImplementedError(f"ConvTranspose on rank {x.ndim} input")
    n, cin, h, wd = x.shape
    g = at.get("group", 1)
    if cin != w.shape[0] or cin % g:
        raise ValueError(f"ConvTranspose weight {list(w.shape)} with group {g} does not fit input {list(x.shape)}")
    og, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    sh, sw = at.get("strides", [1, 1])
    dh, dw = at.get("dilations", [1, 1])
    oph, opw = at.get("output_padding", [0, 0])
    full_h, full_w = (h - 1) * sh + (kh - 1) * dh + 1 + oph, (wd - 1) * sw + (kw - 1) * dw + 1 + opw
    auto = at.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if at.get("output_shape") is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
        want = at["output_shape"][-2:] if at.get("output_shape") is not None else [h * sh, wd * sw]
        tot = [max(0, full_h - want[0]), max(0, full_w - want[1])]
        first = [t // 2 for t in tot] if auto == "SAME_UPPER" else [t - t // 2 for t in tot]
        pads = [first[0], first[1], tot[0] - first[0], tot[1] - first[1]]
    else:
        pads = list(at.get("pads", [0, 0, 0, 0]))
    y = np.zeros((n, og * g, full_h, full_w), np.float32)
    cg = cin // g
    for gi in range(g):
        xg = x[:, gi * cg:(gi + 1) * cg].reshape(n, cg, h * wd)
        wg = w[gi * cg:(gi + 1) * cg].reshape(cg, og * kh * kw)
        wt = np.ascontiguousarray(wg.T)  # C order: BLAS (numpy's own loop otherwise)
        cols = (wt @ xg[0])[None] if n == 1 else np.matmul(wt, xg)
        cols = cols.reshape(n, og, kh, kw, h, wd)  # every tap of every input pixel
        out = y[:, gi * og:(gi + 1) * og]
        for ky in range(kh):
            for kx in range(kw):
                out[:, :, ky * dh:ky * dh + (h - 1) * sh + 1:sh, kx * dw:kx * dw + (wd - 1) * sw + 1:sw] += cols[:, :, ky, kx]
    y = y[:, :, pads[0]:full_h - pads[2], pads[1]:full_w - pads[3]]
    if b is not None:
        y = y + b.reshape(1, -1, 1, 1)
    return [np.ascontiguousarray(y, np.float32)]


def _pool_geometry(x, at):
    if x.ndim != 4 or len(at.get("kernel_shape", ())) != 2:
        raise NotImplementedError(f"pooling on rank {x.ndim} input with kernel {list(at.get('kernel_shape', []))}")
    kh, kw = at["kernel_shape"]
    sh, sw = at.get("strides", [1, 1])
    dh, dw = at.get("dilations", [1, 1])
    p = conv_pads(at, x.shape[2:], (kh, kw))
    check_window(x.shape, (kh, kw), (sh, sw), (dh, dw), p, "pooling")
    ceil = at.get("ceil_mode", 0)
    oh = [out_size(x.shape[2 + i], k, s, d, p[i], p[i + 2], bool(ceil))
          for i, (k, s, d) in enumerate(((kh, sh, dh), (kw, sw, dw)))]
    return Window2d(kh, kw, sh, sw, dh, dw, oh[0], oh[1]), p


def _taps(xp, win: Window2d):
    """The kh*kw strided views of a padded NCHW tensor, one per kernel tap."""
    kh, kw, sh, sw, dh, dw, oh, ow = win.kh, win.kw, win.sh, win.sw, win.dh, win.dw, win.oh, win.ow
    for i in range(kh):
        for j in range(kw):
            yield xp[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]


@op("MaxPool")
def max_pool(ins, at):
    x = ins[0]
    win, p = _pool_geometry(x, at)
    kh, kw, sh, sw, dh, dw, oh, ow = win.kh, win.kw, win.sh, win.sw, win.dh, win.dw, win.oh, win.ow
    eh = max(0, (oh - 1) * sh + (kh - 1) * dh + 1 - x.shape[2] - p[0])
    ew = max(0, (ow - 1) * sw + (kw - 1) * dw + 1 - x.shape[3] - p[1])
    xp = np.pad(x, ((0, 0), (0, 0), (p[0], eh), (p[1], ew)), constant_values=-np.inf)
    y = None
    for v in _taps(xp, win):
        y = v.copy() if y is None else np.maximum(y, v, out=y)
    return [y.astype(x.dtype)]


@op("AveragePool")
def avg_pool(ins, at):
    x = ins[0]
    win, p = _pool_geometry(x, at)
    kh, kw, sh, sw, dh, dw, oh, ow = win.kh, win.kw, win.sh, win.sw, win.dh, win.dw, win.oh, win.ow
    eh = max(0, (oh - 1) * sh + (kh - 1) * dh + 1 - x.shape[2] - p[0])
    ew = max(0, (ow - 1) * sw + (kw - 1) * dw + 1 - x.shape[3] - p[1])
    xp = np.pad(x, ((0, 0), (0, 0), (p[0], eh), (p[1], ew)))
    s = None
    for v in _taps(xp, win):
        s = v.copy() if s is None else np.add(s, v, out=s)
    if at.get("count_include_pad", 0):
        ones = np.pad(np.ones((1, 1) + x.shape[2:], np.float32), ((0, 0), (0, 0), (p[0], p[2]), (p[1], p[3])), constant_values=1)
        ones = np.pad(ones, ((0, 0), (0, 0), (0, max(0, eh - p[2])), (0, max(0, ew - p[3]))))
    else:
        ones = np.pad(np.ones((1, 1) + x.shape[2:], np.float32), ((0, 0), (0, 0), (p[0], eh), (p[1], ew)))
    cnt = _im2col(ones, win).sum(axis=(2, 3))
    return [(s / cnt).astype(x.dtype)]


@op("GlobalAveragePool")
def global_avg_pool(ins, at):
    x = ins[0]
    return [x.mean(axis=tuple(range(2, x.ndim)), keepdims=True).astype(x.dtype)]


@op("GlobalMaxPool")
def global_max_pool(ins, at):
    x = ins[0]
    return [x.max(axis=tuple(range(2, x.ndim)), keepdims=True)]


def _source_positions(ctm, n_in, n_out, s, dtype):
    """Input coordinate of each output position along one axis (cubic: in float32, as ONNX Runtime
    computes them; its taps and weights follow them)."""
    o, s = np.arange(n_out, dtype=dtype), dtype(s)
    if ctm == "asymmetric":
        return o / s
    if ctm == "align_corners":
        return o * (n_in - 1) / max(n_out - 1, 1)
    if ctm == "pytorch_half_pixel" and n_out == 1:
        return np.zeros(1)
    if ctm == "tf_crop_and_resize":
        raise NotImplementedError("Resize with tf_crop_and_resize")
    return (o + 0.5) / s - 0.5


@op("Resize", "Upsample")
def resize(ins, at):
    x = ins[0]
    mode = at.get("mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in ("nearest", "linear", "bilinear", "cubic"):
        raise NotImplementedError(f"Resize mode={mode} (nearest, linear and cubic only)")
    if mode != "nearest" and at.get("antialias", 0):
        raise NotImplementedError("Resize with antialias")
    scales = sizes = None
    if len(ins) == 2:  # Upsample / Resize-10: (X, scales)
        scales = ins[1]
    else:
        scales = ins[2] if len(ins) > 2 and ins[2] is not None and ins[2].size else None
        sizes = ins[3] if len(ins) > 3 and ins[3] is not None and ins[3].size else None
    axes = [a % x.ndim for a in at["axes"]] if at.get("axes") is not None else list(range(x.ndim))
    if sizes is not None:
        pol = at.get("keep_aspect_ratio_policy", b"stretch")
        pol = pol.decode() if isinstance(pol, bytes) else pol
        want = {a: int(v) for a, v in zip(axes, sizes)}
        if pol == "stretch":
            sc = {a: want[a] / x.shape[a] for a in axes}
            out_d = want
        else:  # opset 18: one scale for the given axes, the aspect ratio kept
            f = (min if pol == "not_larger" else max)(want[a] / x.shape[a] for a in axes)
            sc = {a: f for a in axes}
            out_d = {a: int(np.floor(x.shape[a] * f + 0.5)) for a in axes}
        out = [out_d.get(a, x.shape[a]) for a in range(x.ndim)]
        scales = [sc.get(a, 1.0) for a in range(x.ndim)]
    else:
        sc = {a: float(v) for a, v in zip(axes, scales)}
        scales = [sc.get(a, 1.0) for a in range(x.ndim)]
        out = [int(np.floor(i * s)) for i, s in zip(x.shape, scales)]
    ctm = at.get("coordinate_transformation_mode", b"half_pixel")
    ctm = ctm.decode() if isinstance(ctm, bytes) else ctm
    nm = at.get("nearest_mode", b"round_prefer_floor")
    nm = nm.decode() if isinstance(nm, bytes) else nm
    y = x
    for ax, (n_in, n_out, s) in enumerate(zip(x.shape, out, scales)):
        if n_in == n_out:
            continue
        src = _source_positions(ctm, n_in, n_out, s, np.float32 if mode == "cubic" else np.float64)
        if mode == "cubic":
            y = cubic_axis(y, ax, src, at)
            continue
        if mode != "nearest":  # (linear, each axis in turn: n-linear; positions outside the input take its edge)
            src = np.clip(src, 0, n_in - 1)
            lo = np.floor(src).astype(np.int64)
            hi = np.minimum(lo + 1, n_in - 1)
            frac = (src - lo).astype(np.float32)
            shape = [1] * y.ndim
            shape[ax] = n_out
            frac = frac.reshape(shape)
            a, b = np.take(y, lo, axis=ax), np.take(y, hi, axis=ax)
            b -= a  # (a + (b - a) * frac in place: two upsampled copies held, not five)
            b *= frac
            b += a
            y = b
            continue
        if nm == "floor":
            idx = np.floor(src)
        elif nm == "ceil":
            idx = np.ceil(src)
        elif nm == "round_prefer_ceil":
            idx = np.floor(src + 0.5)
        else:
            idx = np.ceil(src - 0.5)
        idx = np.clip(idx, 0, n_in - 1).astype(np.int64)
        y = np.take(y, idx, axis=ax)
    return [y]


@op("DequantizeLinear")
def dequantize_linear(ins, at):
    q, s = ins[0], ins[1]
    z = ins[2] if len(ins) > 2 and ins[2] is not None else np.zeros_like(s, dtype=q.dtype)
    axis = at.get("axis", 1)
    if s.ndim == 1 and s.size > 1:
        sh = [1] * q.ndim
        sh[axis] = -1
        s, z = s.reshape(sh), z.reshape(sh)
    return [((q.astype(np.int32) - z.astype(np.int32)).astype(np.float32) * s).astype(np.float32)]


@op("QuantizeLinear")
def quantize_linear(ins, at):
    x, s = ins[0], ins[1]
    z = ins[2] if len(ins) > 2 and ins[2] is not None else np.zeros((), np.uint8)
    axis = at.get("axis", 1)
    if s.ndim == 1 and s.size > 1:
        sh = [1] * x.ndim
        sh[axis] = -1
        s, z = s.reshape(sh), z.reshape(sh)
    info = np.iinfo(z.dtype)
    y = np.rint(x / s) + z.astype(np.float32)
    return [np.clip(y, info.min, info.max).astype(z.dtype)]


def _recurrent_setup(ins, at, gates: int):
    """(X [T, B, I], W, R, B as [dirs, gates * H, ...], initial h [dirs, B, H], directions, H) of an
    LSTM/GRU node, checked for what these loops compute (default activations, no clip, time first, every
    sequence full length)."""
    x, w, r = ins[0], ins[1], ins[2]
    b = ins[3] if len(ins) > 3 and ins[3] is not None else None
    lens = ins[4] if len(ins) > 4 and ins[4] is not None else None
    h0 = ins[5] if len(ins) > 5 and ins[5] is not None else None
    if at.get("activations") is not None or at.get("clip") is not None:
        raise NotImplementedError("LSTM/GRU with activations or clip other than the defaults")
    if at.get("layout", 0):
        raise NotImplementedError("LSTM/GRU with layout 1 (batch first; ONNX Runtime runs none either)")
    t, n = x.shape[0], x.shape[1]
    if lens is not None and np.any(np.asarray(lens) != t):
        raise NotImplementedError("LSTM/GRU with sequences shorter than the input (sequence_lens)")
    d = w.shape[0]
    hidden = w.shape[1] // gates
    direction = at.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    dirs = ["forward", "reverse"] if direction == "bidirectional" else [direction]
    if len(dirs) != d:
        raise ValueError(f"LSTM/GRU direction {direction} with weights for {d} directions")
    if b is None:
        b = np.zeros((d, 2 * gates * hidden), np.float32)
    if h0 is None:
        h0 = np.zeros((d, n, hidden), np.float32)
    return x, w, r, b, h0, dirs, hidden


def _recurrent_outputs(ys, hs, extra):
    """Y [T, dirs, B, H] and the last states [dirs, B, H]."""
    outs = [np.stack(ys, axis=1), np.stack(hs)] + [np.stack(e) for e in extra]
    return [o.astype(np.float32) for o in outs]


@op("LSTM")
def lstm(ins, at):
    """ONNX LSTM (gates i, o, f, c), default activations, no peepholes: one step at a time per direction."""
    x, w, r, b, h0, dirs, hdim = _recurrent_setup(ins, at, 4)
    c0 = ins[6] if len(ins) > 6 and ins[6] is not None else None
    if len(ins) > 7 and ins[7] is not None or at.get("input_forget", 0):
        raise NotImplementedError("LSTM with peepholes or input_forget")
    if c0 is None:
        c0 = np.zeros_like(h0)
    ys, hs, cs = [], [], []
    for k, way in enumerate(dirs):
        xw = np.matmul(x, w[k].T) + b[k][:4 * hdim] + b[k][4 * hdim:]  # [T, B, 4H], all steps at once
        h, c = h0[k].astype(np.float32), c0[k].astype(np.float32)
        out = [None] * x.shape[0]
        for t in (range(x.shape[0]) if way == "forward" else range(x.shape[0] - 1, -1, -1)):
            g = xw[t] + h @ r[k].T
            i, o, f, cc = _sig(g[:, :hdim]), _sig(g[:, hdim:2 * hdim]), _sig(g[:, 2 * hdim:3 * hdim]), np.tanh(g[:, 3 * hdim:])
            c = f * c + i * cc
            h = o * np.tanh(c)
            out[t] = h
        ys.append(np.stack(out))
        hs.append(h)
        cs.append(c)
    return _recurrent_outputs(ys, hs, [cs])


@op("GRU")
def gru(ins, at):
    """ONNX GRU (gates z, r, h), default activations, linear_before_reset either way."""
    x, w, r, b, h0, dirs, hdim = _recurrent_setup(ins, at, 3)
    before = at.get("linear_before_reset", 0)
    ys, hs = [], []
    for k, way in enumerate(dirs):
        wb, rb = b[k][:3 * hdim], b[k][3 * hdim:]
        xw = np.matmul(x, w[k].T) + wb  # [T, B, 3H]
        h = h0[k].astype(np.float32)
        out = [None] * x.shape[0]
        for t in (range(x.shape[0]) if way == "forward" else range(x.shape[0] - 1, -1, -1)):
            hr = h @ r[k][:2 * hdim].T + rb[:2 * hdim]
            z, rr = _sig(xw[t][:, :hdim] + hr[:, :hdim]), _sig(xw[t][:, hdim:2 * hdim] + hr[:, hdim:])
            if before:
                hh = np.tanh(xw[t][:, 2 * hdim:] + rr * (h @ r[k][2 * hdim:].T + rb[2 * hdim:]))
            else:
                hh = np.tanh(xw[t][:, 2 * hdim:] + (rr * h) @ r[k][2 * hdim:].T + rb[2 * hdim:])
            h = (1 - z) * hh + z * h
            out[t] = h
        ys.append(np.stack(out))
        hs.append(h)
    return _recurrent_outputs(ys, hs, [])


for _name, _fn in TRANSFORMER_OPS.items():
    FP32_OPS[_name] = _fn
