"""Native INT8 kernels (NHWC, u8 activations x s8 per-channel weights). See API.md.

The C extension `_native` holds AVX-512 VNNI, AVX2 and portable C variants of every kernel and
dispatches once from the CPU's features; this module checks arguments, computes output shapes
and folds the zero-point compensation into the bias at pack time.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from qtool.kernel_params import BinaryQuant, ConvGeometry, DeconvGeometry, PoolWindow
from qtool.qparams import U8_MAX, U8_MIN
from qtool.windows import out_size

from . import _native
from .deconv_phases import axis_phases, deconv_out_hw, phase_weights, unsupported

ISAS = ("scalar", "avx2", "avx512vnni", "amx")

__all__ = ["ConvGeometry", "PoolWindow", "BinaryQuant", "info", "set_isa", "get_isa", "available_isas", "set_num_threads", "get_num_threads",
           "conv_multiplier", "PackedConv", "pack_conv2d", "conv2d", "pack_gemm", "gemm", "add",
           "maxpool2d", "avgpool2d", "global_avgpool", "concat", "conv_out_hw",
           "quantize_nchw_to_nhwc", "dequantize_nhwc_to_nchw", "bind_conv2d", "bind_gemm",
           "DeconvGeometry", "PackedDeconv", "pack_deconv2d", "deconv2d", "bind_deconv2d",
           "bind_add", "bind_maxpool2d", "bind_avgpool2d", "bind_global_avgpool", "bind_concat",
           "bind_quantize_nchw_to_nhwc", "bind_dequantize_nhwc_to_nchw", "mul", "bind_mul", "lut",
           "bind_lut", "peak_gmacs", "set_exact_only", "set_spin_us", "get_spin_us", "pool_wakeup",
           "pool_prewake"]


# ---- runtime / dispatch --------------------------------------------------------------------
def info() -> dict:
    """Chosen ISA, best ISA, CPU/OS support flags, thread count and kernel names."""
    return _native.info()


def set_isa(name: str | None) -> str:
    """Force 'amx' | 'avx512vnni' | 'avx2' | 'scalar' (capped at what the CPU supports); None = best."""
    if name is None:
        return ISAS[_native.set_isa(-1)]
    if name not in ISAS:
        raise ValueError(f"unknown ISA {name!r}; expected one of {ISAS}")
    return ISAS[_native.set_isa(ISAS.index(name))]


def get_isa() -> str:
    return ISAS[_native.get_isa()]


def available_isas() -> list[str]:
    best = ISAS.index(info()["best_isa"])
    return list(ISAS[: best + 1])


def set_num_threads(n: int) -> None:
    _native.set_num_threads(int(n))


def get_num_threads() -> int:
    return _native.get_num_threads()


def set_spin_us(us: float) -> None:
    """How long an idle pool worker spins after a job before it sleeps (default 100 us, or env
    QTOOL_SPIN_US). Measured on the clock, the same time on every CPU."""
    _native.set_spin_ns(float(us) * 1000.0)


def get_spin_us() -> float:
    return _native.get_spin_ns() / 1000.0


def pool_prewake() -> None:
    """Wake the pool's sleeping workers and return at once, so that a job posted within their
    spin time (100 us) starts without the OS wake-up; NativeSession calls it as a run starts."""
    _native.pool_prewake()


def pool_wakeup(samples: int = 15) -> dict:
    """The pool's worker wake-up latency, measured here: microseconds from the call that posts a
    job to a worker starting it, the worker asleep (left idle past its spin) or still spinning
    (the job right after another); medians and maxima of `samples` each, None with one thread.
    Also the spin time and what one `pause` instruction takes on this CPU."""
    def stats(asleep):
        v = [t / 1000.0 for t in (_native.pool_wake_ns(asleep) for _ in range(samples)) if t >= 0]
        return (float(np.median(v)), float(max(v))) if v else (None, None)
    sleep_med, sleep_max = stats(1)
    spin_med, spin_max = stats(0)
    return {"spin_us": get_spin_us(), "pause_ns": _native.pause_ns(), "threads": get_num_threads(),
            "samples": samples, "wake_from_sleep_us": sleep_med, "wake_from_sleep_max_us": sleep_max,
            "wake_while_spinning_us": spin_med, "wake_while_spinning_max_us": spin_max}


_PEAK_KIND = {"avx2": (1, "vpshufb+vpmaddubsw+vpmaddwd+vpaddd"), "avx2-exact": (2, "2 vpshufb + 4 vpmaddwd/vpaddd"),
              "avx512vnni": (3, "vpdpbusd zmm"), "amx": (3, "vpdpbusd zmm (AVX-512 part of the tier)")}
_peak_cache: dict = {}


def peak_gmacs(isa: str | None = None, seconds: float = 0.05) -> tuple[float, str]:
    """(GMAC/s on one thread, what was timed): a register-only loop of the GEMM instruction mix
    of `isa` (default: the active one; 'avx2-exact' = the 16-bit kernel's mix), measured on this
    machine once per process. (0.0, ...) when the CPU cannot run it or the tier has no loop."""
    isa = isa or get_isa()
    if isa not in _peak_cache:
        kind, what = _PEAK_KIND.get(isa, (0, "none"))
        _peak_cache[isa] = (_native.peak_gmacs(kind, float(seconds)) if kind else 0.0, what)
    return _peak_cache[isa]


def set_exact_only(on: bool) -> None:
    """Objects packed afterwards use the tier's exact 16-bit kernels where it has them (AVX2:
    vpmaddwd instead of vpmaddubsw), for comparisons. Both are bit-exact."""
    _native.set_exact_only(int(bool(on)))


def conv_multiplier(x_scale, w_scales, y_scale) -> np.ndarray:
    """float32((x_scale * w_scale[c]) / y_scale), the expression ONNX Runtime's QLinearConv uses."""
    xs = np.float32(x_scale)
    ws = np.atleast_1d(np.asarray(w_scales, np.float32))
    return ((xs * ws) / np.float32(y_scale)).astype(np.float32)


# ---- helpers -------------------------------------------------------------------------------
def _u8(x, name: str) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8:
        raise ValueError(f"{name}: expected a uint8 ndarray, got {getattr(x, 'dtype', type(x))}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: array of shape {x.shape} is not C-contiguous")
    return x


def _out(out, shape, dtype=np.uint8) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype)
    if (not isinstance(out, np.ndarray) or out.dtype != dtype or tuple(out.shape) != tuple(shape)
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"out: expected a writable C-contiguous {np.dtype(dtype).name} array of "
                         f"shape {tuple(shape)}, got {getattr(out, 'dtype', None)} "
                         f"{getattr(out, 'shape', None)}")
    return out


def _pair(v, name):
    t = tuple(int(i) for i in (v if hasattr(v, "__len__") else (v, v)))
    if len(t) != 2:
        raise ValueError(f"{name}: expected 2 values, got {t}")
    return t


def _pads(p):
    t = tuple(int(i) for i in p)
    if len(t) == 2:
        t = (t[0], t[1], t[0], t[1])
    if len(t) != 4 or min(t) < 0:
        raise ValueError(f"pads: expected (top, left, bottom, right) >= 0, got {p}")
    return t


def _clamp(lo, hi):
    lo, hi = int(lo), int(hi)
    if not (U8_MIN <= lo <= hi <= U8_MAX):
        raise ValueError(f"clamp [{lo}, {hi}] is not inside [0, 255]")
    return lo, hi


def conv_out_hw(h, w, kernel, strides, pads, dilations, ceil_mode=False):
    """ONNX output spatial size (pads = top, left, bottom, right)."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    pt, pl, pb, pr = pads
    oh, ow = out_size(h, kh, sh, dh, pt, pb, ceil_mode), out_size(w, kw, sw, dw, pl, pr, ceil_mode)
    if oh < 1 or ow < 1:
        raise ValueError(f"output would be empty: input {h}x{w}, kernel {kh}x{kw}, strides "
                         f"{sh}x{sw}, pads {pads}, dilations {dh}x{dw}")
    return oh, ow


# ---- convolution / gemm --------------------------------------------------------------------
@dataclass
class PackedConv:
    """Packed weights + requantization of one Conv (or Gemm), bound to one microkernel."""

    cin: int
    cout: int
    kh: int
    kw: int
    strides: tuple
    pads: tuple
    dilations: tuple
    group: int
    kind: str          # 'gemm' | 'igemm' | 'dwconv'
    out_dtype: type
    kernel: str
    isa: str
    _cap: object = field(repr=False)

    def out_shape(self, n, h, w):
        oh, ow = conv_out_hw(h, w, (self.kh, self.kw), self.strides, self.pads, self.dilations)
        return (n, oh, ow, self.cout)


def _bias_mult(bias, multiplier, cout, w_rows, x_zp):
    """Fold -x_zp * sum(w) into the int32 bias; broadcast the multiplier to float32[cout]."""
    b = np.zeros(cout, np.int64) if bias is None else np.asarray(bias).astype(np.int64).reshape(-1)
    if b.shape != (cout,):
        raise ValueError(f"bias: expected shape ({cout},), got {np.shape(bias)}")
    b = b - int(x_zp) * w_rows.astype(np.int64).sum(axis=1)
    if b.min(initial=0) < -(2 ** 31) or b.max(initial=0) > 2 ** 31 - 1:
        raise ValueError("bias with zero-point compensation does not fit int32")
    m = np.asarray(multiplier, np.float32).reshape(-1)
    if m.size == 1:
        m = np.full(cout, m[0], np.float32)
    if m.shape != (cout,):
        raise ValueError(f"multiplier: expected shape ({cout},) or a scalar, got {np.shape(multiplier)}")
    return np.ascontiguousarray(b.astype(np.int32)), np.ascontiguousarray(m)


def pack_conv2d(w, bias, *, x_zp, multiplier, y_zp, lo=0, hi=255,
                geometry: ConvGeometry = ConvGeometry()) -> PackedConv:
    """Pack an ONNX OIHW int8 weight for NHWC convolution (see API.md)."""
    w = np.asarray(w)
    if w.dtype != np.int8 or w.ndim != 4:
        raise ValueError(f"weights: expected int8 [Cout, Cin/group, KH, KW], got {w.dtype} {w.shape}")
    if w.size and (w.min() < -127):
        raise ValueError("weights must be in [-127, 127] (symmetric int8)")
    cout, cin_g, kh, kw = (int(s) for s in w.shape)
    group = int(geometry.group)
    if group < 1 or cout % group:
        raise ValueError(f"group={group} does not divide Cout={cout}")
    if not (0 <= int(x_zp) <= 255 and 0 <= int(y_zp) <= 255):
        raise ValueError(f"zero points must be in [0, 255], got x_zp={x_zp} y_zp={y_zp}")
    strides, dilations = _pair(geometry.strides, "strides"), _pair(geometry.dilations, "dilations")
    pads = _pads(geometry.pads)
    if min(strides) < 1 or min(dilations) < 1:
        raise ValueError(f"strides {strides} and dilations {dilations} must be >= 1")
    lo, hi = _clamp(lo, hi)
    cout_g = cout // group
    depthwise = group > 1 and cin_g == 1 and cout_g == 1
    # [G][Cout_g][KH*KW][Cin_g]: taps major, input channels minor (NHWC order)
    wt = np.ascontiguousarray(w.transpose(0, 2, 3, 1).reshape(cout, kh * kw * cin_g))
    b, m = _bias_mult(bias, multiplier, cout, wt, x_zp)
    cap = _native.conv_create(wt, b, m, group, cin_g, cout_g, kh, kw, strides[0], strides[1],
                              pads[0], pads[1], dilations[0], dilations[1], int(x_zp), int(y_zp),
                              lo, hi, 0, int(depthwise))
    ci = _native.conv_info(cap)
    if depthwise:
        kind = "dwconv"
    elif (kh, kw) == (1, 1) and strides == (1, 1) and pads == (0, 0, 0, 0) and group == 1:
        kind = "gemm"
    else:
        kind = "igemm"
    return PackedConv(cin_g * group, cout, kh, kw, strides, pads, dilations, group, kind, np.uint8,
                      ci["kernel"], ci["isa"], cap)


def _nhwc_in_out(p, x, out):
    """A convolution's (or ConvTranspose's) uint8 NHWC input checked against p.cin -> (n, h, w, out shape, y)."""
    _u8(x, "x")
    if x.ndim != 4 or x.shape[3] != p.cin:
        raise ValueError(f"x: expected NHWC [N, H, W, {p.cin}], got {x.shape}")
    n, h, w, _ = x.shape
    shape = p.out_shape(n, h, w)
    return n, h, w, shape, _out(out, shape)


def _plan_conv2d(p: PackedConv, x, out):
    n, h, w, shape, y = _nhwc_in_out(p, x, out)
    return y, _native.conv_run, (p._cap, x, n, h, w, y, shape[1], shape[2])


def _call(plan):
    y, fn, args = plan
    fn(*args)
    return y


def _bind(plan):
    """A zero-argument callable that reruns the op on the same (pre-checked) buffers: the
    executor binds every op once at plan time and pays no per-call argument checks."""
    _, fn, args = plan
    return functools.partial(fn, *args)


def conv2d(p: PackedConv, x: np.ndarray, out=None) -> np.ndarray:
    """uint8 NHWC [N, H, W, Cin] -> uint8 NHWC [N, OH, OW, Cout]."""
    return _call(_plan_conv2d(p, x, out))


def bind_conv2d(p: PackedConv, x: np.ndarray, out: np.ndarray):
    return _bind(_plan_conv2d(p, x, out))


@dataclass
class PackedDeconv:
    """A ConvTranspose packed as one convolution per output phase (deconv_phases.py)."""

    cin: int
    cout: int
    kh: int
    kw: int
    strides: tuple
    pads: tuple
    output_padding: tuple
    group: int
    kernel: str
    isa: str
    phases: tuple = field(repr=False)   # ((PackedConv, py, px), ...)
    _arg: tuple = field(repr=False)     # ((capsule, py, px), ...), what deconv_run takes

    def out_shape(self, n, h, w):
        oh, ow = deconv_out_hw(h, w, (self.kh, self.kw), self.strides, self.pads, self.output_padding)
        return (n, oh, ow, self.cout)


def pack_deconv2d(w, bias, *, x_zp, multiplier, y_zp, lo=0, hi=255,
                  geometry: DeconvGeometry = DeconvGeometry()) -> PackedDeconv:
    """Pack an ONNX ConvTranspose int8 weight [Cin, Cout/group, KH, KW] (see API.md): the exact int32
    sums of the transposed convolution, requantized as a convolution's."""
    w = np.asarray(w)
    if w.dtype != np.int8 or w.ndim != 4:
        raise ValueError(f"weights: expected int8 [Cin, Cout/group, KH, KW], got {w.dtype} {w.shape}")
    group = int(geometry.group)
    if group < 1 or w.shape[0] % group:
        raise ValueError(f"group={group} does not divide Cin={w.shape[0]}")
    strides, pads, opad = _pair(geometry.strides, "strides"), _pads(geometry.pads), _pair(geometry.output_padding, "output_padding")
    kh, kw = int(w.shape[2]), int(w.shape[3])
    if min(strides) < 1 or min(opad) < 0:
        raise ValueError(f"strides {strides} must be >= 1 and output_padding {opad} >= 0")
    why = unsupported((kh, kw), strides, pads)
    if why:
        raise ValueError(f"ConvTranspose: {why}")
    phases = []
    for ph in axis_phases(kh, strides[0], pads[0]):
        for pw in axis_phases(kw, strides[1], pads[1]):
            sub = phase_weights(w, group, ph, pw, strides)
            pc = pack_conv2d(sub, bias, x_zp=x_zp, multiplier=multiplier, y_zp=y_zp, lo=lo, hi=hi,
                             geometry=ConvGeometry((1, 1), (ph.pad, pw.pad, 0, 0), (1, 1), group))
            phases.append((pc, ph.phase, pw.phase))
    first = phases[0][0]
    return PackedDeconv(first.cin, first.cout, kh, kw, strides, pads, opad, group, first.kernel, first.isa,
                        tuple(phases), tuple((pc._cap, py, px) for pc, py, px in phases))


def _plan_deconv2d(p: PackedDeconv, x, out):
    n, h, w, shape, y = _nhwc_in_out(p, x, out)
    sh, sw = p.strides
    scratch = np.empty(n * -(-shape[1] // sh) * -(-shape[2] // sw) * p.cout if (sh, sw) != (1, 1) else 1, np.uint8)
    return y, _native.deconv_run, (p._arg, x, n, h, w, y, shape[1], shape[2], sh, sw, scratch)


def deconv2d(p: PackedDeconv, x: np.ndarray, out=None) -> np.ndarray:
    """uint8 NHWC [N, H, W, Cin] -> uint8 NHWC [N, OH, OW, Cout], OH = (H - 1) * sh + KH - pads + output_padding."""
    return _call(_plan_deconv2d(p, x, out))


def bind_deconv2d(p: PackedDeconv, x: np.ndarray, out: np.ndarray):
    return _bind(_plan_deconv2d(p, x, out))


def pack_gemm(w, bias, *, x_zp, multiplier, y_zp=0, lo=0, hi=255, out_dtype="uint8") -> PackedConv:
    """Pack int8 weights [N, K] (output-channel major) for y[M, N] = x[M, K] @ w.T (see API.md)."""
    w = np.asarray(w)
    if w.dtype != np.int8 or w.ndim != 2:
        raise ValueError(f"weights: expected int8 [N, K], got {w.dtype} {w.shape}")
    if out_dtype not in ("uint8", "float32", np.uint8, np.float32):
        raise ValueError(f"out_dtype must be 'uint8' or 'float32', got {out_dtype!r}")
    f32 = np.dtype(out_dtype) == np.float32
    if not 0 <= int(x_zp) <= 255:
        raise ValueError(f"x_zp must be in [0, 255], got {x_zp}")
    lo, hi = _clamp(lo, hi)
    n, k = (int(s) for s in w.shape)
    wt = np.ascontiguousarray(w)
    b, m = _bias_mult(bias, multiplier, n, wt, x_zp)
    cap = _native.conv_create(wt, b, m, 1, k, n, 1, 1, 1, 1, 0, 0, 1, 1, int(x_zp),
                              0 if f32 else int(y_zp), lo, hi, int(f32), 2)  # 2: fully connected
    ci = _native.conv_info(cap)
    return PackedConv(k, n, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1, "gemm",
                      np.float32 if f32 else np.uint8, ci["kernel"], ci["isa"], cap)


def _plan_gemm(p: PackedConv, x, out):
    _u8(x, "x")
    if x.ndim != 2 or x.shape[1] != p.cin:
        raise ValueError(f"x: expected [M, {p.cin}], got {x.shape}")
    m = x.shape[0]
    y = _out(out, (m, p.cout), p.out_dtype)
    return y, _native.conv_run, (p._cap, x, m, 1, 1, y, 1, 1)


def gemm(p: PackedConv, x: np.ndarray, out=None) -> np.ndarray:
    """uint8 [M, K] -> uint8 (or float32) [M, N]."""
    return _call(_plan_gemm(p, x, out))


def bind_gemm(p: PackedConv, x: np.ndarray, out: np.ndarray):
    return _bind(_plan_gemm(p, x, out))


# ---- elementwise / pooling / concat --------------------------------------------------------
def _ratio(a, b) -> float:
    return float(np.float32(a) / np.float32(b))


def _plan_add(a, b, q: BinaryQuant, out):
    _u8(a, "a")
    _u8(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"add: shapes differ: {a.shape} vs {b.shape} (broadcast in the caller)")
    lo, hi = _clamp(q.lo, q.hi)
    y = _out(out, a.shape)
    return y, _native.add, (a, b, y, _ratio(q.a_scale, q.y_scale), int(q.a_zp), _ratio(q.b_scale, q.y_scale),
                            int(q.b_zp), int(q.y_zp), lo, hi)


def add(a, b, q: BinaryQuant, out=None):
    return _call(_plan_add(a, b, q, out))


def bind_add(a, b, out, q: BinaryQuant):
    return _bind(_plan_add(a, b, q, out))


@dataclass(frozen=True)
class _AvgRequant:
    """An average pool's requantization: (sum - count * x_zp) * multiplier / count + y_zp, clamped."""
    x_zp: int
    multiplier: float
    y_zp: int
    lo: int
    hi: int


_MAX = _AvgRequant(0, 1.0, 0, 0, 255)  # what the C kernel is given for a max pool (unused there)


def _pool(x, win: PoolWindow, avg: _AvgRequant | None, out):
    """avg None: max pool."""
    _u8(x, "x")
    if x.ndim != 4:
        raise ValueError(f"x: expected NHWC, got shape {x.shape}")
    kernel, strides = _pair(win.kernel, "kernel"), _pair(win.strides, "strides")
    dilations = _pair(win.dilations, "dilations")
    if min(kernel) < 1 or min(strides) < 1 or min(dilations) < 1:
        raise ValueError(f"pool: kernel {kernel}, strides {strides}, dilations {dilations} must be >= 1")
    pads = _pads(win.pads)
    rq = _MAX if avg is None else avg
    lo, hi = _clamp(rq.lo, rq.hi)
    n, h, w, c = x.shape
    oh, ow = conv_out_hw(h, w, kernel, strides, pads, dilations, win.ceil_mode)
    y = _out(out, (n, oh, ow, c))
    return y, _native.pool, (x, y, n, h, w, c, oh, ow, kernel[0], kernel[1], strides[0], strides[1],
                             pads[0], pads[1], pads[2], pads[3], dilations[0], dilations[1],
                             int(avg is not None), int(avg is not None and win.count_include_pad), int(rq.x_zp),
                             float(np.float32(rq.multiplier)), int(rq.y_zp), lo, hi)


def maxpool2d(x, window: PoolWindow, out=None):
    return _call(_pool(x, window, None, out))


def bind_maxpool2d(x, out, window: PoolWindow):
    return _bind(_pool(x, window, None, out))


def _avg_window(window: PoolWindow) -> PoolWindow:
    if tuple(window.dilations) != (1, 1):
        raise ValueError(f"avgpool2d: dilations {window.dilations}: only (1, 1)")
    return window


def avgpool2d(x, window: PoolWindow, *, x_zp, multiplier, y_zp, lo=0, hi=255, out=None):
    return _call(_pool(x, _avg_window(window), _AvgRequant(x_zp, multiplier, y_zp, lo, hi), out))


def bind_avgpool2d(x, out, window: PoolWindow, *, x_zp, multiplier, y_zp, lo=0, hi=255):
    return _bind(_pool(x, _avg_window(window), _AvgRequant(x_zp, multiplier, y_zp, lo, hi), out))


def _plan_gap(x, x_zp, multiplier, y_zp, lo, hi, out):
    _u8(x, "x")
    if x.ndim != 4:
        raise ValueError(f"x: expected NHWC, got shape {x.shape}")
    return _pool(x, PoolWindow((x.shape[1], x.shape[2])), _AvgRequant(x_zp, multiplier, y_zp, lo, hi), out)


def global_avgpool(x, *, x_zp, multiplier, y_zp, lo=0, hi=255, out=None):
    return _call(_plan_gap(x, x_zp, multiplier, y_zp, lo, hi, out))


def bind_global_avgpool(x, out, *, x_zp, multiplier, y_zp, lo=0, hi=255):
    return _bind(_plan_gap(x, x_zp, multiplier, y_zp, lo, hi, out))


def _plan_concat(xs, axis, scales, zps, y_scale, y_zp, out):
    xs = [_u8(x, f"xs[{i}]") for i, x in enumerate(xs)]
    if not xs:
        raise ValueError("concat: no inputs")
    nd = xs[0].ndim
    axis = int(axis) + (nd if int(axis) < 0 else 0)
    if not 0 <= axis < nd:
        raise ValueError(f"concat: axis {axis} out of range for rank {nd}")
    ref = xs[0].shape
    for x in xs:
        if x.ndim != nd or x.shape[:axis] != ref[:axis] or x.shape[axis + 1:] != ref[axis + 1:]:
            raise ValueError(f"concat: shapes {[x.shape for x in xs]} differ outside axis {axis}")
    if len(scales) != len(xs) or len(zps) != len(xs):
        raise ValueError("concat: need one scale and zero point per input")
    shape = list(ref)
    shape[axis] = sum(x.shape[axis] for x in xs)
    y = _out(out, tuple(shape))
    outer = int(np.prod(ref[:axis], dtype=np.int64))
    items = []
    for x, s, z in zip(xs, scales, zps):
        inner = int(np.prod(x.shape[axis:], dtype=np.int64))
        same = np.float32(s) == np.float32(y_scale) and int(z) == int(y_zp)
        items.append((x, inner, bool(same), int(z), _ratio(s, y_scale)))
    return y, _native.concat, (items, outer, y, int(y_zp))


def concat(xs, axis, *, scales, zps, y_scale, y_zp, out=None):
    return _call(_plan_concat(xs, axis, scales, zps, y_scale, y_zp, out))


def bind_concat(xs, axis, out, *, scales, zps, y_scale, y_zp):
    return _bind(_plan_concat(xs, axis, scales, zps, y_scale, y_zp, out))


def _plan_mul(a, b, q: BinaryQuant, out):
    _u8(a, "a")
    _u8(b, "b")
    lo, hi = _clamp(q.lo, q.hi)
    if a.ndim == 0:
        raise ValueError("mul: scalar inputs are not supported")
    inner = int(a.shape[-1])
    rows = a.size // inner if inner else 0
    if b.shape == a.shape:
        brp = 0
    elif a.ndim == 4 and b.shape == (a.shape[0], 1, 1, a.shape[3]):
        brp = a.shape[1] * a.shape[2]  # squeeze-excitation: b per (image, channel)
    else:
        raise ValueError(f"mul: b of shape {b.shape} must equal a's {a.shape} or be [N, 1, 1, C]")
    y = _out(out, a.shape)
    ratio = float((np.float32(q.a_scale) * np.float32(q.b_scale)) / np.float32(q.y_scale))
    return y, _native.mul, (a, b, y, rows, inner, brp, ratio, int(q.a_zp), int(q.b_zp), int(q.y_zp), lo, hi)


def mul(a, b, q: BinaryQuant, out=None):
    """ONNX Runtime's QLinearMul rounding: p = (a - a_zp) * (b - b_zp) (int32),
    y = clip(rint(float32(p) * ratio + y_zp), lo, hi), ratio = float32(a_scale * b_scale) / y_scale."""
    return _call(_plan_mul(a, b, q, out))


def bind_mul(a, b, out, q: BinaryQuant):
    return _bind(_plan_mul(a, b, q, out))


def _plan_lut(x, table, out):
    _u8(x, "x")
    t = np.asarray(table)
    if t.dtype != np.uint8 or not t.flags.c_contiguous:
        raise ValueError(f"table: expected a C-contiguous uint8 array, got {t.dtype}")
    if t.shape == (256,):
        c = 0
    elif t.ndim == 2 and t.shape[1] == 256 and x.ndim >= 1 and x.shape[-1] == t.shape[0]:
        c = int(t.shape[0])
    else:
        raise ValueError(f"table: expected [256] or [C, 256] with C = x.shape[-1], got {t.shape} for x {x.shape}")
    y = _out(out, x.shape)
    return y, _native.lut, (x, t, y, c)


def lut(x, table, out=None):
    """y = table[x] (one [256] table, or [C, 256] tables over the last (channel) axis)."""
    return _call(_plan_lut(x, table, out))


def bind_lut(x, table, out):
    return _bind(_plan_lut(x, table, out))


# ---- graph boundary ------------------------------------------------------------------------
def _nchw(shape):
    if len(shape) == 4:
        return shape
    if len(shape) == 2:
        return (shape[0], shape[1], 1, 1)
    raise ValueError(f"expected a 4-D NCHW/NHWC or 2-D [N, C] array, got shape {shape}")


def _plan_quantize(x, scale, zp, out):
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError(f"x: expected a C-contiguous float32 array, got {getattr(x, 'dtype', type(x))}")
    n, c, h, w = _nchw(x.shape)
    y = _out(out, (n, h, w, c) if x.ndim == 4 else (n, c))
    if not 0 <= int(zp) <= 255:
        raise ValueError(f"zero point {zp} not in [0, 255]")
    return y, _native.quantize, (x, y, n, c, h, w, float(np.float32(scale)), int(zp))


def quantize_nchw_to_nhwc(x, scale, zp, out=None):
    """QuantizeLinear to uint8 (y = sat(rint(x / scale) + zp), as ONNX Runtime), NCHW -> NHWC
    in one pass ([N, C] stays [N, C])."""
    return _call(_plan_quantize(x, scale, zp, out))


def bind_quantize_nchw_to_nhwc(x, out, scale, zp):
    return _bind(_plan_quantize(x, scale, zp, out))


def _plan_dequantize(x, scale, zp, out):
    _u8(x, "x")
    if x.ndim == 4:
        n, h, w, c = x.shape
        shape = (n, c, h, w)
    elif x.ndim == 2:
        (n, c), h, w = x.shape, 1, 1
        shape = (n, c)
    else:
        raise ValueError(f"x: expected NHWC or [N, C], got shape {x.shape}")
    y = _out(out, shape, np.float32)
    return y, _native.dequantize, (x, y, n, c, h, w, float(np.float32(scale)), int(zp))


def dequantize_nhwc_to_nchw(x, scale, zp, out=None):
    """DequantizeLinear (y = float32(x - zp) * scale), NHWC -> NCHW in one pass."""
    return _call(_plan_dequantize(x, scale, zp, out))


def bind_dequantize_nhwc_to_nchw(x, out, scale, zp):
    return _bind(_plan_dequantize(x, scale, zp, out))


def _init_from_env():
    import os
    isa = os.environ.get("QTOOL_ISA")
    if isa and isa not in ISAS:
        raise ValueError(f"QTOOL_ISA={isa!r}: expected one of {ISAS}")


_init_from_env()

from . import f32  # noqa: E402  (float32 transformer kernels; uses the helpers above)
