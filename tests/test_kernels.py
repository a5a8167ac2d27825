"""One parametrized tester for every native kernel under every ISA this CPU supports
(AVX-512 VNNI, AVX2 and portable C are forced through qtool.kernels.set_isa; the AVX2 tier's
exact 16-bit kernels, kept beside its vpmaddubsw ones, through set_exact_only as "avx2-exact"),
against the numpy reference in qtool.kernels.reference. Shapes sit around the tile edges (MR, NR,
K groups and blocks, channel tiles); the output buffer is surrounded and pre-filled by a canary;
equality must be exact."""
from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("qtool.kernels")
from helpers import kernel_set  # noqa: E402
from qtool.kernels import reference as R  # noqa: E402
from qtool.kernel_params import BinaryQuant, ConvGeometry, PoolWindow  # noqa: E402

ISAS = K.available_isas()
# every registered kernel set: each tier, and the AVX2 tier's exact kernels
KERNEL_SETS = ISAS + (["avx2-exact"] if "avx2" in ISAS else [])
CANARIES = (0xA5, 0x5A)
GUARD = 67  # canary bytes before and after the output


@pytest.fixture(params=KERNEL_SETS)
def isa(request):
    with kernel_set(request.param) as tier:
        K._native.set_parallel_min_ns(0)  # thread even the tiny test ops (tile splits get exercised)
        assert K.get_isa() == tier
        yield tier
        K._native.set_parallel_min_ns(15000)


def canary_out(shape, dtype, canary):
    itemsize = np.dtype(dtype).itemsize
    size = int(np.prod(shape)) * itemsize
    big = np.full(size + 2 * GUARD * itemsize, canary, np.uint8)
    view = big[GUARD * itemsize:GUARD * itemsize + size].view(dtype).reshape(shape)
    return big, view


def check(name, got, want, big, canary, itemsize, info=""):
    pre, post = big[:GUARD * itemsize], big[len(big) - GUARD * itemsize:]
    assert (pre == canary).all() and (post == canary).all(), \
        f"{name}: wrote outside the output ({info}); before: {np.flatnonzero(pre != canary)}, " \
        f"after: {np.flatnonzero(post != canary)}"
    assert got.shape == want.shape, f"{name}: shape {got.shape} != reference {want.shape} ({info})"
    bad = np.argwhere(got != want) if got.dtype != np.float32 else \
        np.argwhere(got.view(np.int32) != want.astype(np.float32).view(np.int32))
    if len(bad):
        idx = [tuple(int(i) for i in b) for b in bad[:8]]
        detail = ", ".join(f"{i}: got {got[i]} want {want[i]}" for i in idx)
        raise AssertionError(f"{name}: {len(bad)} of {got.size} values differ ({info}), output shape "
                             f"{got.shape}; first: {detail}")


def rand_u8(rng, shape):
    x = rng.integers(0, 256, size=shape, dtype=np.uint8)
    if x.size > 4:  # make sure the extremes occur
        x.flat[0], x.flat[-1] = 255, 0
    return x


def rand_w(rng, shape):
    w = rng.integers(-127, 128, size=shape, dtype=np.int8)
    if w.size > 4:
        w.flat[0], w.flat[-1] = 127, -127
    return w


def pick_multiplier(rng, acc_std, cout):
    """Per-channel multipliers that spread outputs over the u8 range (and hit clamps)."""
    base = 60.0 / max(float(acc_std), 1.0)
    return (base * rng.uniform(0.3, 3.0, size=cout)).astype(np.float32)


# (n, h, w, cin, cout, kh, kw, stride, pads, dilation, group)
CONV_CASES = [
    (1, 1, 1, 1, 1, 1, 1, 1, (0, 0, 0, 0), 1, 1),
    (1, 3, 3, 3, 7, 1, 1, 1, (0, 0, 0, 0), 1, 1),
    (1, 2, 4, 4, 32, 1, 1, 1, (0, 0, 0, 0), 1, 1),       # M = 8 = MR
    (1, 3, 3, 5, 33, 1, 1, 1, (0, 0, 0, 0), 1, 1),       # M = 9, N = NR + 1
    (2, 4, 5, 17, 31, 1, 1, 1, (0, 0, 0, 0), 1, 1),      # batch 2
    (1, 5, 5, 64, 65, 1, 1, 1, (0, 0, 0, 0), 1, 1),
    (1, 4, 3, 67, 16, 1, 1, 1, (0, 0, 0, 0), 1, 1),
    (1, 7, 7, 18, 17, 1, 1, 2, (0, 0, 0, 0), 1, 1),      # 1x1 stride 2 (downsample)
    (1, 6, 6, 3, 5, 3, 3, 1, (1, 1, 1, 1), 1, 1),
    (1, 7, 9, 6, 20, 3, 3, 2, (1, 1, 1, 1), 1, 1),
    (2, 5, 5, 13, 9, 3, 3, 1, (0, 2, 1, 0), 1, 1),       # asymmetric pads
    (1, 11, 11, 3, 16, 7, 7, 2, (3, 3, 3, 3), 1, 1),     # ResNet stem shape
    (1, 9, 9, 3, 8, 3, 3, 2, (0, 0, 1, 1), 1, 1),        # EfficientNet stem (TF padding)
    (1, 8, 8, 10, 12, 3, 3, 1, (2, 2, 2, 2), 2, 1),      # dilation 2
    (1, 6, 7, 6, 10, 3, 3, 1, (1, 1, 1, 1), 1, 2),       # groups
    (2, 5, 5, 12, 36, 3, 3, 2, (1, 1, 1, 1), 1, 4),
    (1, 5, 6, 4, 8, 1, 3, 1, (0, 1, 0, 1), 1, 4),        # group with cin_g = 1, cout_g = 2
    (1, 9, 9, 4, 4, 3, 3, 1, (1, 1, 1, 1), 1, 4),        # depthwise
    (1, 9, 8, 17, 17, 3, 3, 2, (1, 1, 1, 1), 1, 17),
    (2, 7, 7, 63, 63, 3, 3, 1, (1, 1, 1, 1), 1, 63),
    (1, 6, 5, 64, 64, 3, 3, 2, (0, 0, 1, 1), 1, 64),
    (1, 5, 9, 65, 65, 5, 5, 1, (2, 2, 2, 2), 1, 65),
    (1, 11, 10, 130, 130, 5, 5, 2, (1, 2, 2, 1), 1, 130),
    (1, 7, 7, 24, 24, 3, 3, 1, (2, 2, 2, 2), 2, 24),     # depthwise dilation
    (1, 4, 4, 40, 40, 1, 1, 1, (0, 0, 0, 0), 1, 40),     # depthwise 1x1
    (1, 1, 1, 8, 8, 3, 3, 1, (1, 1, 1, 1), 1, 1),        # input smaller than the kernel
    (1, 2, 2, 16, 16, 5, 5, 2, (2, 2, 2, 2), 1, 16),
    (1, 7, 7, 1152, 1152, 5, 5, 1, (2, 2, 2, 2), 1, 1152),  # EfficientNet-Lite0's last depthwise
    (1, 3, 3, 2, 4, 3, 3, 2, (1, 1, 1, 1), 1, 1),        # im2col with padding everywhere
    (1, 9, 8, 96, 40, 3, 3, 1, (1, 1, 1, 1), 1, 1),      # K-blocked taps (8 + 1), half panel
    (2, 15, 15, 256, 33, 3, 3, 2, (1, 1, 1, 1), 1, 1),   # K-blocked taps (3 x 3), batch 2
    (1, 9, 9, 66, 64, 5, 5, 1, (2, 2, 2, 2), 1, 1),      # K-blocked taps (11 + 11 + 3), K % 4
    (1, 8, 9, 200, 70, 3, 3, 1, (1, 1, 1, 1), 1, 2),     # K-blocked with groups
    (1, 9, 8, 1024, 36, 1, 1, 1, (0, 0, 0, 0), 1, 1),    # 1x1, K split into virtual taps
    (1, 7, 7, 2048, 32, 1, 1, 2, (0, 0, 0, 0), 1, 1),    # 1x1 stride 2, K split
    (1, 7, 9, 1000, 17, 1, 1, 1, (1, 0, 0, 1), 1, 1),    # 1x1 padded, K split (1000 = 4 * 250)
    (2, 20, 17, 3, 8, 3, 3, 1, (1, 1, 1, 1), 1, 1),      # im2col: wide moves inside, exact at edges
    (1, 16, 16, 5, 8, 3, 3, 2, (0, 0, 1, 1), 1, 1),      # im2col: TF padding, stride 2
    (1, 20, 20, 4, 16, 7, 7, 2, (3, 3, 3, 3), 1, 1),     # im2col: 28-byte kernel rows (32-byte moves)
    (1, 12, 12, 3, 8, 3, 3, 1, (2, 2, 2, 2), 2, 1),      # im2col with dilation
    (2, 33, 30, 3, 64, 7, 7, 2, (3, 3, 3, 3), 1, 1),     # AMX stem: im2col rows read in place
    (1, 20, 20, 3, 32, 3, 3, 2, (0, 0, 1, 1), 1, 1),     # AMX 3x3 stem: K = 27 padded to 64
    (1, 10, 10, 100, 40, 1, 1, 1, (0, 0, 0, 0), 1, 1),   # AMX: rows read in place, K % 64 != 0
    (1, 8, 8, 40, 48, 1, 1, 1, (0, 0, 0, 0), 1, 1),      # AMX: K = 40 in place, then packed (end of x)
    (1, 3, 4, 48, 80, 1, 1, 1, (0, 0, 0, 0), 1, 1),      # AMX: K <= 64, A tiles kept over 3 panels, 12 rows
    (1, 4, 80, 112, 24, 1, 1, 2, (0, 0, 0, 0), 1, 1),    # AMX: stride-2 rows read in place
    (1, 8, 12, 256, 48, 1, 1, 1, (0, 0, 0, 0), 1, 2),    # AMX: grouped 1x1 read in place
    # M in row chunks (operators-conv.c row_chunk): the panels run over one chunk, then the next
    (2, 69, 70, 64, 256, 1, 1, 1, (0, 0, 0, 0), 1, 1),   # 1x1 (8 panels), a short last chunk
    (2, 60, 61, 32, 80, 3, 3, 1, (1, 1, 1, 1), 1, 1),    # 3x3, half-width last panel, short last chunk
    (1, 30, 31, 1024, 64, 1, 1, 1, (0, 0, 0, 0), 1, 1),  # K split and K-blocked inside each chunk
    (2, 41, 39, 3, 40, 5, 5, 1, (2, 2, 2, 2), 1, 1),     # im2col per task: 82 rows of 39 pixels, half panel
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "n{}h{}w{}c{}o{}k{}x{}s{}p{}d{}g{}".format(*c[:8], "".join(map(str, c[8])), *c[9:]))
def test_conv2d(isa, case):
    n, h, w, cin, cout, kh, kw, s, pads, d, g = case
    rng = np.random.default_rng(hash(case) & 0xFFFF)
    x = rand_u8(rng, (n, h, w, cin))
    wt = rand_w(rng, (cout, cin // g, kh, kw))
    bias = rng.integers(-20000, 20000, size=cout, dtype=np.int32)
    x_zp, y_zp = int(rng.integers(0, 256)), int(rng.integers(0, 256))
    acc = R.conv2d_acc(wt, bias, x, x_zp, (s, s), pads, (d, d), g)
    mult = pick_multiplier(rng, acc.std(), cout)
    lo, hi = (0, 255) if rng.random() < 0.5 else (y_zp // 2, 255 - (255 - y_zp) // 3)
    kw_args = dict(x_zp=x_zp, multiplier=mult, y_zp=y_zp, lo=lo, hi=hi,
                   geometry=ConvGeometry((s, s), pads, (d, d), g))
    want = R.conv2d(wt, bias, x, **kw_args)
    p = K.pack_conv2d(wt, bias, **kw_args)
    assert p.isa == isa
    if g == cin == cout and g > 1:
        assert p.kind == "dwconv"
    # the AMX tier runs depthwise, short-K and narrow convolutions (K < 24 or Cout/group <= 16,
    # operators-conv.c QT_AMX_MIN_K/N) on its AVX-512 kernels, everything else on tiles
    on_tiles = p.kind != "dwconv" and cin // g * kh * kw >= 24 and cout // g > 16
    assert (isa if on_tiles or isa != "amx" else "avx512").split("vnni")[0] in p.kernel
    if isa == "avx2":
        assert ("maddubs" in p.kernel) != bool(K._native.get_exact_only()), p.kernel
    for canary in CANARIES:
        big, out = canary_out(want.shape, np.uint8, canary)
        got = K.conv2d(p, x, out=out)
        check(p.kernel, got, want, big, canary, 1, f"case {case}, x_zp={x_zp} y_zp={y_zp} [{lo},{hi}]")
    assert (K.conv2d(p, x) == want).all()  # second call reuses the cached indirection
    if cin // g * kh * kw * 32 > 24 * 1024:  # large panels: also the K-blocked path on every run
        K._native.set_kblock(2)
        try:
            pb = K.pack_conv2d(wt, bias, **kw_args)
        finally:
            K._native.set_kblock(1)
        check(pb.kernel + " (K-blocked)", K.conv2d(pb, x), want, np.full(2 * GUARD, 0, np.uint8), 0, 1,
              f"case {case}")


GEMM_CASES = [(m, k, nn) for m, k, nn in [
    (1, 1, 1), (1, 3, 15), (2, 4, 16), (7, 5, 17), (8, 31, 32), (9, 64, 33), (17, 129, 100),
    (33, 7, 64), (3, 1280, 1000), (16, 2048, 31), (1, 2051, 40), (1, 13, 70), (1, 1280, 1000),
    (100, 100, 40), (96, 128, 33), (65, 200, 17), (40, 60, 100)]]


@pytest.mark.parametrize("out_dtype", ["uint8", "float32"])
@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: "m{}k{}n{}".format(*c))
def test_gemm(isa, case, out_dtype):
    m, k, nn = case
    rng = np.random.default_rng(m * 1000003 + k * 1009 + nn)
    x = rand_u8(rng, (m, k))
    wt = rand_w(rng, (nn, k))
    bias = rng.integers(-50000, 50000, size=nn, dtype=np.int32)
    x_zp, y_zp = int(rng.integers(0, 256)), int(rng.integers(0, 256))
    acc = R.gemm(wt, bias, x, x_zp=x_zp, multiplier=np.ones(nn, np.float32), out_dtype="float32")
    mult = pick_multiplier(rng, acc.std(), nn)
    want = R.gemm(wt, bias, x, x_zp=x_zp, multiplier=mult, y_zp=y_zp, out_dtype=out_dtype)
    p = K.pack_gemm(wt, bias, x_zp=x_zp, multiplier=mult, y_zp=y_zp, out_dtype=out_dtype)
    dt = np.dtype(out_dtype)
    for canary in CANARIES:
        big, out = canary_out(want.shape, dt, canary)
        got = K.gemm(p, x, out=out)
        check(p.kernel, got, want, big, canary, dt.itemsize, f"case {case} {out_dtype}")


@pytest.mark.parametrize("mult", [0.5, 0.25, 1.5])
def test_gemm_round_half_even(isa, mult):
    """acc * mult lands exactly on .5: ties must go to even, like np.rint and ORT."""
    k = 3
    x = np.arange(64, dtype=np.uint8).reshape(64, 1).repeat(k, 1)
    wt = np.array([[1, 0, 0], [-1, 0, 0], [1, 1, 1]], np.int8)
    want = R.gemm(wt, None, x, x_zp=0, multiplier=mult, y_zp=128)
    p = K.pack_gemm(wt, None, x_zp=0, multiplier=mult, y_zp=128)
    big, out = canary_out(want.shape, np.uint8, 0xA5)
    check(p.kernel, K.gemm(p, x, out=out), want, big, 0xA5, 1, f"mult {mult}")


ADD_SIZES = [(1,), (15,), (16,), (17,), (3, 33), (1, 5, 7, 64), (16385,), (2, 7, 7, 2048 // 8 + 3)]


@pytest.mark.parametrize("shape", ADD_SIZES, ids=str)
def test_add(isa, shape):
    rng = np.random.default_rng(len(shape) * 7 + int(np.prod(shape)))
    a, b = rand_u8(rng, shape), rand_u8(rng, shape)
    q = dict(a_scale=float(rng.uniform(0.01, 0.1)), a_zp=int(rng.integers(0, 256)),
             b_scale=float(rng.uniform(0.01, 0.1)), b_zp=int(rng.integers(0, 256)),
             y_scale=float(rng.uniform(0.02, 0.2)), y_zp=int(rng.integers(0, 256)))
    for lo, hi in ((0, 255), (q["y_zp"], 255)):
        want = R.add(a, b, BinaryQuant(**q, lo=lo, hi=hi))
        for canary in CANARIES:
            big, out = canary_out(shape, np.uint8, canary)
            got = K.add(a, b, BinaryQuant(**q, lo=lo, hi=hi), out=out)
            check(K.info()["kernels"]["add"], got, want, big, canary, 1, f"shape {shape} {q} [{lo},{hi}]")


# (n, h, w, c, kernel, stride, pads, dilation, ceil_mode)
POOL_CASES = [
    (1, 9, 9, 64, 3, 2, (1, 1, 1, 1), 1, False),   # ResNet maxpool
    (2, 8, 7, 17, 2, 2, (0, 0, 0, 0), 1, False),
    (1, 7, 7, 5, 3, 2, (0, 0, 0, 0), 1, True),
    (1, 10, 10, 3, 3, 1, (1, 0, 2, 1), 1, False),
    (1, 9, 9, 33, 2, 1, (0, 0, 0, 0), 2, False),
    (1, 6, 5, 130, 5, 3, (2, 2, 2, 2), 1, True),
]


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: "n{}h{}w{}c{}k{}s{}".format(*c[:6]))
def test_maxpool(isa, case):
    n, h, w, c, k, s, pads, d, ceil = case
    rng = np.random.default_rng(h * 31 + c)
    x = rand_u8(rng, (n, h, w, c))
    win = PoolWindow((k, k), (s, s), pads, (d, d), ceil)
    want = R.maxpool2d(x, win)
    for canary in CANARIES:
        big, out = canary_out(want.shape, np.uint8, canary)
        got = K.maxpool2d(x, win, out=out)
        check("maxpool2d", got, want, big, canary, 1, f"case {case}")


@pytest.mark.parametrize("cip", [False, True])
@pytest.mark.parametrize("case", [c for c in POOL_CASES if c[7] == 1], ids=lambda c: "n{}h{}w{}c{}k{}s{}".format(*c[:6]))
def test_avgpool(isa, case, cip):
    n, h, w, c, k, s, pads, _, ceil = case
    rng = np.random.default_rng(h * 37 + c)
    x = rand_u8(rng, (n, h, w, c))
    q = dict(x_zp=int(rng.integers(0, 256)), multiplier=float(rng.uniform(0.5, 2.0)),
             y_zp=int(rng.integers(0, 256)))
    win = PoolWindow((k, k), (s, s), pads, ceil_mode=ceil, count_include_pad=cip)
    want = R.avgpool2d(x, win, **q)
    for canary in CANARIES:
        big, out = canary_out(want.shape, np.uint8, canary)
        got = K.avgpool2d(x, win, out=out, **q)
        check("avgpool2d", got, want, big, canary, 1, f"case {case} cip={cip} {q}")


@pytest.mark.parametrize("shape", [(1, 7, 7, 2048), (2, 3, 5, 17), (1, 1, 1, 1), (1, 7, 7, 1280)], ids=str)
def test_global_avgpool(isa, shape):
    rng = np.random.default_rng(int(np.prod(shape)))
    x = rand_u8(rng, shape)
    q = dict(x_zp=int(rng.integers(0, 256)), multiplier=float(rng.uniform(0.5, 4.0)),
             y_zp=int(rng.integers(0, 256)), lo=3, hi=250)
    want = R.global_avgpool(x, **q)
    for canary in CANARIES:
        big, out = canary_out(want.shape, np.uint8, canary)
        got = K.global_avgpool(x, out=out, **q)
        check("global_avgpool", got, want, big, canary, 1, f"shape {shape} {q}")


@pytest.mark.parametrize("axis", [3, 1, 0])
def test_concat(isa, axis):
    rng = np.random.default_rng(axis)
    shapes = [[2, 3, 4, 6] for _ in range(3)]
    for s, c in zip(shapes, (5, 17, 1)):
        s[axis] = c
    shapes = [tuple(s) for s in shapes]
    xs = [rand_u8(rng, s) for s in shapes]
    scales, zps = [0.05, 0.1, 0.03], [10, 128, 0]
    q = dict(scales=scales, zps=zps, y_scale=0.05, y_zp=10)   # first input is a plain copy
    want = R.concat(xs, axis, **q)
    for canary in CANARIES:
        big, out = canary_out(want.shape, np.uint8, canary)
        got = K.concat(xs, axis, out=out, **q)
        check("concat", got, want, big, canary, 1, f"axis {axis} shapes {shapes}")


def test_dispatch_info():
    inf = K.info()
    assert inf["isa"] in K.ISAS and inf["best_isa"] in K.ISAS
    assert K.ISAS.index(inf["isa"]) <= K.ISAS.index(inf["best_isa"])
    prev = K.get_isa()
    try:
        assert K.set_isa("scalar") == "scalar"
        assert K.info()["kernels"]["igemm"].endswith("__scalar")
        assert K.set_isa(None) == inf["best_isa"]
        with pytest.raises(ValueError):
            K.set_isa("sse9")
    finally:
        K.set_isa(prev)


def test_errors_name_shapes():
    p = K.pack_conv2d(np.ones((4, 3, 3, 3), np.int8), None, x_zp=0, multiplier=0.1, y_zp=0)
    with pytest.raises(ValueError, match=r"\[N, H, W, 3\]"):
        K.conv2d(p, np.zeros((1, 3, 8, 8), np.uint8))
    with pytest.raises(ValueError, match="C-contiguous"):
        K.conv2d(p, np.zeros((1, 8, 8, 6), np.uint8)[..., :3])
    with pytest.raises(ValueError, match="shape"):
        K.conv2d(p, np.zeros((1, 8, 8, 3), np.uint8), out=np.zeros((1, 6, 6, 5), np.uint8))


def test_threads_agree():
    rng = np.random.default_rng(5)
    x = rand_u8(rng, (1, 14, 14, 40))
    wt = rand_w(rng, (48, 40, 3, 3))
    p = K.pack_conv2d(wt, None, x_zp=7, multiplier=0.002, y_zp=9, geometry=ConvGeometry(pads=(1, 1, 1, 1)))
    prev = K.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            K.set_num_threads(t)
            outs.append(K.conv2d(p, x))
        assert all((o == outs[0]).all() for o in outs)
    finally:
        K.set_num_threads(prev)


def _wait_sleeping(want, limit_s=2.0):
    """Poll (busy: an awake worker sleeps again 100 us later) until `want` workers sleep."""
    import time
    t_end = time.perf_counter() + limit_s
    while time.perf_counter() < t_end:
        if (now := K._native.pool_sleeping()) == want:
            return now
    return K._native.pool_sleeping()


def test_pool_prewake_wakes_sleeping_workers():
    """pool_prewake posts an empty job: the asleep workers wake and spin (the next job starts
    without the OS wake-up), then fall asleep again after their spin time."""
    prev, prev_spin = K.get_num_threads(), K.get_spin_us()
    try:
        K.set_num_threads(2)
        K.set_spin_us(1000)
        x = np.zeros((64, 56, 56, 32), np.uint8)
        K.add(x, x, BinaryQuant(a_scale=1.0, a_zp=0, b_scale=1.0, b_zp=0, y_scale=1.0, y_zp=0))  # starts a worker
        import time
        time.sleep(0.3)  # every worker (earlier tests may have started more) past its spin, asleep
        asleep = K._native.pool_sleeping()
        assert asleep >= 1
        K.set_spin_us(50000)  # awake long enough to be seen on a busy machine
        K.pool_prewake()
        assert _wait_sleeping(0) == 0
        assert _wait_sleeping(asleep) == asleep  # back to sleep after the spin
    finally:
        K.set_num_threads(prev)
        K.set_spin_us(prev_spin)


def test_pool_jobs_of_every_size_after_prewakes():
    """Jobs with few and many chunks, each after an empty (prewake) job or right after another:
    a worker late from one job must not run a chunk of the next one under the old job's claim."""
    rng = np.random.default_rng(11)
    prev = K.get_num_threads()
    try:
        K.set_num_threads(2)
        for i in range(300):
            n = int(rng.integers(1, 200_000))
            a, b = rand_u8(rng, (n,)), rand_u8(rng, (n,))
            kw = BinaryQuant(a_scale=0.02, a_zp=100, b_scale=0.03, b_zp=7, y_scale=0.05, y_zp=50)
            if i % 3 == 0:
                K.pool_prewake()
            assert (K.add(a, b, kw) == R.add(a, b, kw)).all(), n
    finally:
        K.set_num_threads(prev)


@pytest.mark.parametrize("shape", [(1, 3, 17, 9), (2, 5, 4, 3), (3, 40), (2, 3, 6, 37), (1, 3, 4, 16)], ids=str)
def test_quantize_dequantize(isa, shape):
    rng = np.random.default_rng(len(shape))
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    x.flat[:4] = [0.5 * 0.05, -1.5 * 0.05, 1e9, -1e9]  # ties and saturation
    scale, zp = 0.05, 117
    want = R.quantize_nchw_to_nhwc(x, scale, zp)
    big, out = canary_out(want.shape, np.uint8, 0xA5)
    check("quantize", K.quantize_nchw_to_nhwc(x, scale, zp, out=out), want, big, 0xA5, 1, str(shape))
    want_f = R.dequantize_nhwc_to_nchw(want, scale, zp)
    big, out = canary_out(want_f.shape, np.float32, 0x5A)
    check("dequantize", K.dequantize_nhwc_to_nchw(want, scale, zp, out=out), want_f, big, 0x5A, 4, str(shape))


def test_bind_reruns_on_same_buffers():
    rng = np.random.default_rng(11)
    x = rand_u8(rng, (1, 6, 6, 8))
    p = K.pack_conv2d(rand_w(rng, (8, 8, 3, 3)), None, x_zp=4, multiplier=0.003, y_zp=6,
                      geometry=ConvGeometry(pads=(1,) * 4))
    out = np.empty(p.out_shape(1, 6, 6), np.uint8)
    run = K.bind_conv2d(p, x, out)
    run()
    assert (out == K.conv2d(p, x)).all()
    x[...] = rand_u8(rng, x.shape)  # new data in the same buffer
    run()
    assert (out == K.conv2d(p, x)).all()
    b = rand_u8(rng, x.shape)
    y = np.empty_like(x)
    q = BinaryQuant(a_scale=0.1, a_zp=3, b_scale=0.2, b_zp=4, y_scale=0.3, y_zp=5)
    K.bind_add(x, b, y, q)()
    assert (y == R.add(x, b, q)).all()


@pytest.mark.parametrize("env", ["scalar", "avx2", "avx512vnni"])
def test_qtool_isa_env_caps_dispatch(env):
    """QTOOL_ISA forces a lower ISA at import and never raises it above what the CPU supports."""
    import os
    import subprocess
    import sys
    code = "import qtool.kernels as K; i = K.info(); print(i['isa'], i['best_isa'])"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "QTOOL_ISA": env},
                         capture_output=True, text=True, check=True)
    isa, best = out.stdout.split()  # the child's own best (it may not run under valgrind)
    assert isa == K.ISAS[min(K.ISAS.index(env), K.ISAS.index(best))]


@pytest.mark.parametrize("bshape", ["same", "se"])
@pytest.mark.parametrize("shape", [(1, 5, 7, 17), (2, 3, 3, 64), (1, 1, 1, 3)], ids=str)
def test_mul(isa, shape, bshape):
    rng = np.random.default_rng(int(np.prod(shape)) + len(bshape))
    a = rand_u8(rng, shape)
    b = rand_u8(rng, shape if bshape == "same" else (shape[0], 1, 1, shape[3]))
    q = dict(a_scale=float(rng.uniform(0.01, 0.1)), a_zp=int(rng.integers(0, 256)),
             b_scale=float(rng.uniform(0.001, 0.01)), b_zp=int(rng.integers(0, 256)),
             y_scale=float(rng.uniform(0.005, 0.05)), y_zp=int(rng.integers(0, 256)))
    want = R.mul(a, np.broadcast_to(b, shape), BinaryQuant(**q, lo=3, hi=250))
    for canary in CANARIES:
        big, out = canary_out(shape, np.uint8, canary)
        check("mul", K.mul(a, b, BinaryQuant(**q, lo=3, hi=250), out=out), want, big, canary, 1, f"{shape} {bshape} {q}")


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("shape", [(1, 5, 7, 17), (1, 3, 300, 64), (70,)], ids=str)
def test_lut(isa, shape, per_channel):
    if per_channel and len(shape) < 2:
        pytest.skip("per-channel tables need a channel axis")
    rng = np.random.default_rng(int(np.prod(shape)))
    x = rand_u8(rng, shape)
    table = rng.integers(0, 256, (shape[-1], 256) if per_channel else (256,), dtype=np.uint8)
    want = R.lut(x, table)
    for canary in CANARIES:
        big, out = canary_out(shape, np.uint8, canary)
        check(K.info()["kernels"]["lut"], K.lut(x, table, out=out), want, big, canary, 1, f"{shape}")


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork()")
def test_pool_survives_fork():
    """A forked child (multiprocessing) has no worker threads; kernels must still run there."""
    import os
    if "vgpreload" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("under valgrind the child's exit code is valgrind's")
    rng = np.random.default_rng(9)
    x = rand_u8(rng, (1, 28, 28, 64))
    p = K.pack_conv2d(rand_w(rng, (64, 64, 3, 3)), None, x_zp=1, multiplier=1e-3, y_zp=2,
                      geometry=ConvGeometry(pads=(1,) * 4))
    want = K.conv2d(p, x)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(0 if (K.conv2d(p, x) == want).all() else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


# ---- the AVX2 vpmaddubsw kernels: which int16 pairs they may form -------------------------------
# vpmaddubsw adds two u8 x s8 products into a saturating int16: exact when the weights' signs
# differ or |w_a + w_b| <= 128 (255 * 128 = 32640), not at 129 (255 * 129 = 32895 > 32767).

def pairing(p):
    return K._native.conv_info(p._cap)["pairing"]


def gaussian_w(rng, shape):
    """int8 weights as quantized trained layers look: per output channel, max |w| = 127."""
    f = rng.standard_normal(shape)
    f = f / np.abs(f).reshape(shape[0], -1).max(1).reshape((-1,) + (1,) * (len(shape) - 1)) * 127
    return np.rint(f).astype(np.int8)


def portable(w, axis_order):
    """Make every same-sign pair at even K (ONNX Runtime's order: Conv (kh, kw, cin) with cin
    fastest, Gemm along K, depthwise the taps row-major) sum to at most 128 in magnitude, by
    shrinking such pairs toward 0: what the 'portable' quantization target guarantees."""
    flat = np.ascontiguousarray(w.transpose(axis_order)).reshape(w.shape[0], -1).astype(np.int64)
    for r in flat:
        for k in range(0, len(r) - 1, 2):
            a, b = r[k], r[k + 1]
            if a * b > 0 and abs(a + b) > 128:
                s = 128 / (abs(a) + abs(b))
                r[k], r[k + 1] = np.sign(a) * int(abs(a) * s), np.sign(b) * int(abs(b) * s)
    inv = np.argsort(axis_order)
    shape = tuple(w.shape[i] for i in axis_order)
    return flat.astype(np.int8).reshape(shape).transpose(inv)


def run_conv(isa, w, x, g=1, s=1, pad=0, x_zp=0):
    rng = np.random.default_rng(w.size)
    cout = w.shape[0]
    bias = rng.integers(-5000, 5000, size=cout, dtype=np.int32)
    acc = R.conv2d_acc(w, bias, x, x_zp, (s, s), (pad,) * 4, (1, 1), g)
    q = dict(x_zp=x_zp, multiplier=pick_multiplier(rng, acc.std(), cout), y_zp=77,
             geometry=ConvGeometry(strides=(s, s), pads=(pad,) * 4, group=g))
    p = K.pack_conv2d(w, bias, **q)
    want = R.conv2d(w, bias, x, **q)
    big, out = canary_out(want.shape, np.uint8, 0xA5)
    check(p.kernel, K.conv2d(p, x, out=out), want, big, 0xA5, 1, f"w {w.shape} pairing {pairing(p)}")
    return p


EDGE_PAIRS = {  # (w_a, w_b) repeated along K: sums at exactly 128 are safe, 129 are not
    "pos128": (64, 64), "pos127+1": (127, 1), "neg128": (-64, -64), "neg127-1": (-127, -1),
    "pos129": (127, 2), "neg129": (-65, -64), "opposite": (127, -127),
}


@pytest.mark.parametrize("name", sorted(EDGE_PAIRS))
@pytest.mark.parametrize("k", [4, 16, 27, 64])
def test_pairing_edges_gemm(isa, name, k):
    """Inputs at 255 everywhere make any unsafe pair saturate; the result must stay exact."""
    a, b = EDGE_PAIRS[name]
    w = np.tile(np.array([a, b], np.int8), (5, (k + 1) // 2))[:, :k].copy()
    w[1] = w[1, ::-1]           # other columns: the other order, a single weight, random
    w[2, 1:] = 0
    w[3] = np.random.default_rng(k).integers(-127, 128, k)
    x = np.full((9, k), 255, np.uint8)
    x[4:] = np.random.default_rng(1).integers(0, 256, (5, k))
    p = K.pack_gemm(w, None, x_zp=3, multiplier=np.float32(1e-4), y_zp=0, out_dtype="float32")
    want = R.gemm(w, None, x, x_zp=3, multiplier=np.float32(1e-4), out_dtype="float32")
    big, out = canary_out(want.shape, np.float32, 0x5A)
    check(p.kernel, K.gemm(p, x, out=out), want, big, 0x5A, 4, f"{name} k={k} {pairing(p)}")
    if isa == "avx2" and "maddubs" in p.kernel:
        pr = pairing(p)
        if name in ("pos128", "pos127+1", "neg128", "neg127-1", "opposite"):
            # safe in the natural order: every column-block of the first two columns stays natural
            assert pr["natural"] >= 2 * pr["blocks"] // 5, pr
        if name in ("pos129", "neg129") and k >= 4:
            # every pair of columns 0/1 would saturate: reordered or split, never natural there
            assert pr["reordered"] + pr["fallback"] > 0, pr


@pytest.mark.parametrize("value", [64, 65, 100, 127])
def test_pairing_no_safe_pair_splits(isa, value):
    """All weights equal and > 64: no pairing is safe (each pair sums > 128), so every block takes
    the exact path (two passes); at 64 the natural pairs are safe."""
    w = np.full((20, 3, 3, 40), value, np.int8)
    w[::2] *= -1
    x = np.full((1, 6, 7, 40), 255, np.uint8)
    x[0, 3:] = np.random.default_rng(value).integers(0, 256, (3, 7, 40))
    p = run_conv(isa, w.transpose(0, 3, 1, 2).copy(), x, pad=1, x_zp=200)
    if isa == "avx2" and "maddubs" in p.kernel:
        pr = pairing(p)
        assert (pr["fallback"] == pr["blocks"]) if value > 64 else (pr["natural"] == pr["blocks"]), pr


@pytest.mark.parametrize("value", [64, 65, 127])
@pytest.mark.parametrize("k", [3, 5])
def test_pairing_depthwise_edges(isa, k, value):
    """Depthwise: taps paired per 32-channel tile; equal taps > 64 leave no safe pairing (the tile
    runs the 16-bit form), 64 is safe in ONNX's row-major order."""
    c = 70
    w = np.full((c, 1, k, k), value, np.int8)
    w[1::3] *= -1
    x = np.full((1, 9, 8, c), 255, np.uint8)
    x[0, 5:] = np.random.default_rng(k).integers(0, 256, (4, 8, c))
    p = run_conv(isa, w, x, g=c, pad=k // 2, x_zp=0)
    if isa == "avx2" and "maddubs" in p.kernel:
        pr = pairing(p)
        assert (pr["fallback"] == c) if value > 64 else (pr["natural"] == c), pr


# (n, h, w, cin, cout, kh, kw, stride, pad, group)
PORTABLE_CASES = [(1, 6, 6, 64, 40, 1, 1, 1, 0, 1), (1, 7, 7, 32, 33, 3, 3, 1, 1, 1),
                  (1, 9, 9, 3, 24, 3, 3, 2, 1, 1), (1, 8, 8, 17, 20, 3, 3, 1, 1, 1),
                  (1, 5, 5, 200, 17, 1, 1, 1, 0, 1), (1, 9, 9, 48, 48, 3, 3, 1, 1, 48),
                  (1, 9, 9, 40, 40, 5, 5, 2, 2, 40)]


@pytest.mark.parametrize("case", PORTABLE_CASES, ids=lambda c: "c{}o{}k{}g{}".format(c[3], c[4], c[5], c[9]))
def test_portable_weights_take_the_fast_path(isa, case):
    """Weights whose same-sign pairs in ONNX Runtime's K order sum to <= 128 (the 'portable'
    target) are accepted as they are: no reordering, no second pass, no 16-bit fallback."""
    n, h, wd, cin, cout, kh, kw, s, pad, g = case
    rng = np.random.default_rng(cin * 7 + cout)
    w = gaussian_w(rng, (cout, cin // g, kh, kw))
    # ONNX Runtime's K order: (kh, kw, cin) with cin fastest; depthwise: (kh, kw)
    w = portable(w, (0, 2, 3, 1))
    x = rand_u8(rng, (n, h, wd, cin))
    x[0, 0] = 255
    p = run_conv(isa, w, x, g=g, s=s, pad=pad, x_zp=int(rng.integers(0, 256)))
    if isa == "avx2" and "maddubs" in p.kernel:
        pr = pairing(p)
        assert pr["natural"] == pr["blocks"] and pr["blocks"] > 0, pr


def test_portable_gemm_takes_the_fast_path(isa):
    rng = np.random.default_rng(3)
    w = portable(gaussian_w(rng, (40, 1281)), (0, 1))
    x = rand_u8(rng, (3, 1281))
    p = K.pack_gemm(w, None, x_zp=9, multiplier=np.float32(1e-4), y_zp=0, out_dtype="float32")
    want = R.gemm(w, None, x, x_zp=9, multiplier=np.float32(1e-4), out_dtype="float32")
    check(p.kernel, K.gemm(p, x), want, np.full(2 * GUARD, 0, np.uint8), 0, 4, "portable gemm")
    if isa == "avx2" and "maddubs" in p.kernel:
        pr = pairing(p)
        assert pr["natural"] == pr["blocks"], pr


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 20, 24, 28, 31, 32, 33, 47, 48])
def test_gemm_k_blocks(isa, k):
    """K around the vpmaddubsw kernel's blocks (16, then 8, 4 and 1-3 at the end), Gaussian and
    uniform weights (reordered pairs, split blocks), rows and columns around its 4 x 16 tile."""
    rng = np.random.default_rng(k)
    for wt in (gaussian_w(rng, (17, k)), rand_w(rng, (17, k))):
        for m in (1, 4, 5):
            x = rand_u8(rng, (m, k))
            p = K.pack_gemm(wt, None, x_zp=200, multiplier=np.float32(1e-3), out_dtype="float32")
            want = R.gemm(wt, None, x, x_zp=200, multiplier=np.float32(1e-3), out_dtype="float32")
            big, out = canary_out(want.shape, np.float32, 0xA5)
            check(p.kernel, K.gemm(p, x, out=out), want, big, 0xA5, 4, f"k={k} m={m}")


@pytest.mark.parametrize("c", [1, 4, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100])
def test_depthwise_channel_tiles(isa, c):
    """Channel counts around the 32-channel tile (16-byte, masked and byte-copied tails) with
    Gaussian weights (16-bit form) and small ones (vpmaddubsw form)."""
    rng = np.random.default_rng(c)
    x = rand_u8(rng, (1, 7, 6, c))
    for w in (gaussian_w(rng, (c, 1, 3, 3)), rng.integers(-60, 61, (c, 1, 3, 3), dtype=np.int8)):
        run_conv(isa, w, x, g=c, pad=1, x_zp=int(rng.integers(0, 256)))
