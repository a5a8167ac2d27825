"""The float32 transformer kernels (qtool.kernels.f32) on every ISA tier against their numpy references,
over row lengths around the 16-lane edges, with a canary-filled output:
  erf, erf GELU, DynamicQuantizeLinear, the dynamic MatMul epilogue: bit for bit (the numpy ops the
      runtime runs without them: fp32_ops_transformer.erf32, dynamic_quant);
  LayerNorm, Softmax: within 2e-6 of a float64 reference, scaled by the row (float32 sums in another
      order; exp within 2 ulp), and the same bits on every tier (fixed lanes, no contraction)."""
from __future__ import annotations

import numpy as np
import pytest

import qtool.kernels as K  # noqa: E402
from helpers import kernel_set  # noqa: E402
from qtool.runtime.dynamic_quant import dynamic_qparams, quantize_u8  # noqa: E402
from qtool.runtime.fp32_ops_transformer import erf32  # noqa: E402

F = K.f32
TIERS = [t for t in K.available_isas() if t != "amx"]
LENGTHS = [1, 15, 16, 17, 33, 100, 384]
CANARY = np.float32(-7.5e30)


@pytest.fixture(params=TIERS)
def tier(request):
    with kernel_set(request.param) as t:
        yield t


def _x(rows, n, scale=3.0, seed=0):
    return (np.random.default_rng(seed + n).standard_normal((rows, n)) * scale).astype(np.float32)


def _canary(shape, dtype=np.float32):
    return np.full(shape, CANARY if dtype == np.float32 else 77, dtype)


@pytest.mark.parametrize("n", LENGTHS)
def test_erf_and_gelu_are_numpys_bits(tier, n):
    x = _x(5, n)
    x[0, 0] = 9.0  # beyond the clip
    y = F.erf(x, out=_canary(x.shape))
    np.testing.assert_array_equal(y, erf32(x))
    f = np.float32
    for div, k in ((True, f(1.4142135)), (False, f(0.70710677))):
        want = (x * (erf32(x / k if div else x * k) + f(1.0))) * f(0.5)
        got = F.gelu_erf(x, k, div, 1.0, 0.5, out=_canary(x.shape))
        np.testing.assert_array_equal(got, want)


def _ln64(x, g, b, eps):
    d = x.astype(np.float64)
    m = d.mean(-1, keepdims=True)
    v = ((d - m) ** 2).mean(-1, keepdims=True)
    return (d - m) / np.sqrt(v + eps) * g + b


@pytest.mark.parametrize("n", LENGTHS)
def test_layernorm_within_float32_sums(tier, n):
    x = _x(7, n) + np.float32(5)  # an offset: the two passes keep the variance exact enough
    g, b = _x(1, n, 1.0, 1).reshape(-1), _x(1, n, 1.0, 2).reshape(-1)
    y = F.layernorm(x, g, b, 1e-5, out=_canary(x.shape))
    want = _ln64(x, g, b, 1e-5)
    scale = np.abs(g).max() * 1 + np.abs(b).max()
    assert np.abs(y - want).max() <= 2e-6 * scale * max(1.0, np.sqrt(n) / 4)
    y0 = F.layernorm(x, None, None, 1e-5)
    np.testing.assert_allclose(y0, _ln64(x, 1.0, 0.0, 1e-5), atol=4e-6)


@pytest.mark.parametrize("n", LENGTHS)
def test_softmax_within_float32(tier, n):
    x = _x(9, n, 4.0)
    x[1, :] = -1e30  # a masked row: uniform
    x[2, n // 2:] = -3.4e38  # masked positions get 0
    y = F.softmax(x, out=_canary(x.shape))
    d = x.astype(np.float64)
    e = np.exp(d - d.max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=2e-7)
    if n > 1:
        assert np.all(y[2, n // 2:] == 0)


def test_float_kernels_give_the_same_bits_on_every_tier():
    x = _x(6, 389, 3.0)
    g = _x(1, 389, 1.0, 4).reshape(-1)
    got = {}
    for t in TIERS:
        with kernel_set(t):
            got[t] = (F.layernorm(x, g, g, 1e-6), F.softmax(x), F.gelu_erf(x, 1.4142135, True, 1.0, 0.5))
    for t in TIERS[1:]:
        for a, b in zip(got[TIERS[0]], got[t]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", ["mixed", "positive", "negative", "zeros", "constant", "big"])
@pytest.mark.parametrize("n", [1, 17, 384, 20000])
def test_dynamic_quantize_is_ort_arithmetic(tier, case, n):
    x = _x(3, n, 2.0).reshape(-1)
    x = {"mixed": x, "positive": np.abs(x) + 0.5, "negative": -np.abs(x), "zeros": x * 0, "constant": x * 0 + 3,
         "big": x * 1e4}[case].astype(np.float32)
    y, s, z = F.dynamic_quantize(x, out=_canary(x.shape, np.uint8))
    s0, z0 = dynamic_qparams(x)
    assert (s.dtype, z.dtype) == (np.float32, np.uint8)
    assert np.float32(s) == np.float32(s0) and int(z) == z0
    np.testing.assert_array_equal(y, quantize_u8(x, s0, z0))


@pytest.mark.parametrize("case", ["mixed", "positive", "negative", "zeros", "big"])
@pytest.mark.parametrize("rows,n", [(1, 1), (3, 17), (70, 384), (2, 1300)])
def test_dynamic_quantize_of_a_row_product_is_the_mul_then_the_quantize(tier, case, rows, n):
    """dynamic_quantize_scaled(x, m) = DynamicQuantizeLinear(x * m): the float32 products as numpy makes them
    (rows longer than the kernel's 512-column segments and more than its 64 range slots included)."""
    x = _x(rows, n, 2.0).reshape(rows, n)
    x = {"mixed": x, "positive": np.abs(x) + 0.5, "negative": -np.abs(x), "zeros": x * 0, "big": x * 1e4}[case]
    x = x.astype(np.float32)
    m = (np.random.default_rng(n).random(n) * 4 + 1e-3).astype(np.float32)
    y, s, z = F.dynamic_quantize_scaled(x, m, out=_canary(x.shape, np.uint8))
    xm = x * m
    s0, z0 = dynamic_qparams(xm)
    assert np.float32(s) == np.float32(s0) and int(z) == z0
    np.testing.assert_array_equal(y, quantize_u8(xm, s0, z0))
    with pytest.raises(ValueError):
        F.dynamic_quantize_scaled(x, m[:-1] if n > 1 else np.ones(2, np.float32))


@pytest.mark.parametrize("n", [1, 16, 33, 384])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dynamic_epilogue_is_the_numpy_form(tier, n, with_bias):
    rng = np.random.default_rng(n)
    acc = rng.integers(-(2 ** 23), 2 ** 23, (5, n)).astype(np.float32)
    cs = rng.integers(-60000, 60000, n).astype(np.float32)
    sw = (rng.random(n) * 0.01 + 1e-4).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    s, z = np.array(0.0173, np.float32), np.array(131, np.uint8)
    want = (acc - np.float32(131) * cs) * (np.float32(s) * sw)
    if with_bias:
        want += bias
    y = acc.copy()
    F.dynamic_epilogue(y, s, z, cs, sw, bias)
    np.testing.assert_array_equal(y, want)


def test_bad_buffers_are_errors_not_crashes():
    x = _x(2, 8)
    with pytest.raises(ValueError, match="gamma"):
        F.layernorm(x, np.ones(7, np.float32), None)
    with pytest.raises(ValueError, match="out"):
        F.softmax(x, out=np.empty((2, 9), np.float32))
    with pytest.raises(ValueError, match="float32"):
        F.erf(x.astype(np.float64))


@pytest.mark.parametrize("shapes", [((1, 12, 33, 32), (1, 12, 32, 33)), ((2, 3, 17, 64), (2, 3, 64, 41)),
                                    ((5, 7), (7, 70)), ((3, 1, 9, 5), (4, 5, 8)), ((1, 6, 1, 64), (1, 6, 64, 257))])
@pytest.mark.parametrize("transposed", [False, True])
def test_matmul_within_float32_of_the_exact_products(tier, shapes, transposed):
    """numpy's matmul semantics (broadcast batch dims), row/column tails of the 8 x 32 tile, a transposed
    view of b read in place (packed per task); error within K float32 roundings of sum |a||b|."""
    rng = np.random.default_rng(len(shapes[0]) + shapes[1][-1])
    a = rng.standard_normal(shapes[0]).astype(np.float32)
    bs = shapes[1]
    b = rng.standard_normal(bs[:-2] + (bs[-1], bs[-2])).astype(np.float32).swapaxes(-1, -2) if transposed \
        else rng.standard_normal(bs).astype(np.float32)
    y = F.matmul(a, b, out=_canary(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])))
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    bound = np.matmul(np.abs(a).astype(np.float64), np.abs(b).astype(np.float64)) * a.shape[-1] * 2.0 ** -23
    assert y.shape == want.shape and np.all(np.abs(y - want) <= bound + 1e-30)


def test_matmul_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="chain"):
        F.matmul(np.ones((2, 3), np.float32), np.ones((4, 5), np.float32))
    with pytest.raises(ValueError, match="float32"):
        F.matmul(np.ones((2, 3)), np.ones((3, 5), np.float32))
