"""The streaming histogram (native update vs its numpy reference, exact rebinning, fixed memory)
and every calibration method on synthetic data with known answers."""
from __future__ import annotations

import numpy as np
import pytest

from qtool.calibrate import histogram as H
from qtool.calibrate.histogram import NBINS, SAMPLE_PER_IMAGE, Histogram, accumulate_reference
from qtool import qparams as Q
from qtool.calibrate.methods import METHODS

native = pytest.mark.skipif(H._native is None, reason="native histogram update not built")


def _hist(*chunks, nbins=NBINS):
    h = Histogram(nbins)
    for c in chunks:
        h.observe(np.asarray(c, np.float32))
    return h


# --- the accumulator ----------------------------------------------------------------------------------

@native
@pytest.mark.parametrize("e,k0", [(-8, -300), (-3, 0), (0, -40), (-20, -(1 << 20)), (2, 5)])
def test_native_accumulate_equals_reference(e, k0):
    rng = np.random.default_rng(abs(e) + abs(k0) % 97)
    w = 2.0 ** e
    x = np.concatenate([rng.standard_normal(5000) * 100 * w,  # spans the window and beyond (clipped)
                        (k0 + rng.integers(0, 64, 300)) * w,  # exactly on bin edges, negative ones too
                        np.array([0.0, -0.0, k0 * w, (k0 + 63) * w - w / 4])]).astype(np.float32)
    counts = np.zeros(64, np.int64)
    H._native.accumulate(x, counts, e, k0)
    ref = accumulate_reference(x, 64, e, k0)
    assert counts.sum() == x.size
    np.testing.assert_array_equal(counts, ref)


@native
def test_native_accumulate_adds_to_existing_counts():
    x = np.array([0.5, 1.5, 1.75, -0.25], np.float32)
    counts = np.full(8, 10, np.int64)
    H._native.accumulate(x, counts, 0, -2)
    np.testing.assert_array_equal(counts - 10, accumulate_reference(x, 8, 0, -2))


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def stats_isa(request):
    """Each compiled path of the statistics kernels in turn (capped at what this CPU has)."""
    if H._native is None:
        pytest.skip("native histogram update not built")
    prev = H._native.set_isa(request.param)
    if H._native.isa() != request.param:
        H._native.set_isa(prev)
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    H._native.set_isa(prev)


def _tricky(rng, size, e, k0):
    """Half exact zeros (the hot bin after a ReLU), values on bin edges, beyond the window on
    both sides, negative zero, NaN and infinities."""
    w = 2.0 ** e
    x = rng.standard_normal(size) * 40 * w + (k0 + 32) * w
    x[rng.random(size) < 0.5] = 0.0
    edges = rng.random(size) < 0.1
    x[edges] = (k0 + rng.integers(-4, 70, edges.sum())) * w
    x = x.astype(np.float32)
    for v in (np.nan, np.inf, -np.inf, -0.0):
        x[rng.integers(0, size, 3)] = v
    return x


@pytest.mark.parametrize("e,k0", [(-8, -300), (-3, 0), (0, -40), (2, 5), (-9, 10), (-20, -(1 << 20)),
                                  (-30, (1 << 24) - 10), (120, -40), (-130, 3)])
@pytest.mark.parametrize("size,offset,step", [(16 * 37, 0, 1), (16 * 37 + 5, 0, 1), (16 * 37 + 5, 3, 4),
                                              (1000, 62, 1), (15, 0, 1), (5003, 1, 7)])
def test_every_isa_accumulates_bit_exact(stats_isa, e, k0, size, offset, step):
    rng = np.random.default_rng(size + step + abs(e))
    x = _tricky(rng, size, e, k0)
    counts = np.full(64, 7, np.int64)
    H._native.accumulate(x, counts, e, k0, offset, step)
    sampled = H.sampled_blocks(x, offset, step)
    # NaN and infinities are not counted
    np.testing.assert_array_equal(counts - 7, accumulate_reference(sampled[np.isfinite(sampled)], 64, e, k0))


@pytest.mark.parametrize("shape", [(1, 3, 7, 7), (2, 16, 5, 3), (4, 33, 1, 1), (1, 1, 1, 1), (3, 17), (1, 64, 112, 112)])
def test_every_isa_scans_min_max_and_channel_sums(stats_isa, shape):
    rng = np.random.default_rng(int(np.prod(shape)))
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    x.flat[rng.integers(0, x.size)] = -50.0
    x.flat[rng.integers(0, x.size)] = 60.0
    inner = int(np.prod(shape[2:]))
    sums = np.zeros(shape[1], np.float64)
    mn, mx, has_nan = H._native.scan(x, inner, sums)
    finite = not has_nan
    ref_sums = np.zeros(shape[1], np.float64)
    assert (mn, mx, finite) == H.scan_reference(x, inner, ref_sums)  # min and max: exact
    np.testing.assert_allclose(sums, ref_sums, rtol=1e-12, atol=1e-9)  # sums: double, any order


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("pos", [0, 31, 32, 50])
def test_every_isa_scan_reports_non_finite(stats_isa, bad, pos):
    x = np.linspace(-1, 2, 51, dtype=np.float32)
    x[pos] = bad
    mn, mx, finite = H.scan(x)
    assert not finite
    if bad != bad:  # NaN is skipped by min and max
        rest = np.delete(x, pos)
        assert (mn, mx) == (float(rest.min()), float(rest.max()))


def test_scan_rejects_a_shape_that_is_not_n_runs_per_channel():
    if H._native is None:
        pytest.skip("native histogram update not built")
    with pytest.raises(ValueError, match="runs"):
        H._native.scan(np.zeros(10, np.float32), 3, np.zeros(2))


def test_observe_with_nan_and_inf_counts_only_finite_values():
    h = _hist(np.array([np.nan, 1.0, -np.inf, 2.0, 0.5] * 4, np.float32))
    assert h.n == 12 and h.counts.sum() == 12 and (h.min, h.max) == (0.5, 2.0)


def _same(a: Histogram, b: Histogram):
    assert (a.e, a.k0, a.n, a.n_observed, a.min, a.max) == (b.e, b.k0, b.n, b.n_observed, b.min, b.max)
    np.testing.assert_array_equal(a.counts, b.counts)


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2)])
def test_merge_equals_one_histogram_of_all_values(order):
    """Two workers' histograms (one of them coarser, with a range the other never saw) merge into
    exactly the histogram one accumulator would have built from all the values."""
    rng = np.random.default_rng(1)
    chunks = [rng.standard_normal(3000).astype(np.float32) * s + o for s, o in [(0.01, 0), (5, -2), (0.2, 0.3), (50, 40)]]
    chunks = [chunks[k] for k in order]
    one = _hist(*chunks)
    a, b = _hist(*chunks[0::2]), _hist(*chunks[1::2])
    assert a.e != b.e or a.k0 != b.k0
    a.merge(b)
    _same(a, one)
    np.testing.assert_array_equal(a.counts, accumulate_reference(np.concatenate(chunks), NBINS, a.e, a.k0))


def test_merge_with_empty_histograms():
    full = _hist(np.linspace(-1, 3, 500))
    empty = Histogram()
    empty.merge(full)
    _same(empty, full)
    before = full.counts.copy()
    full.merge(Histogram())
    np.testing.assert_array_equal(full.counts, before)
    with pytest.raises(ValueError):
        full.merge(Histogram(64))


def test_growth_keeps_exact_counts_min_max_and_memory():
    """Ranges growing on both sides force repeated width doublings; the result must equal the
    histogram of all the data binned directly at the final resolution."""
    rng = np.random.default_rng(0)
    chunks = [rng.standard_normal(2000).astype(np.float32) * s + o
              for s, o in [(0.01, 0), (0.1, 0.05), (1, -0.5), (10, 3), (0.5, 0), (300, -100), (0.001, 1e-3)]]
    h = Histogram()
    for c in chunks:
        h.observe(c)
        assert h.counts.shape == (NBINS,) and h.counts.dtype == np.int64
    alld = np.concatenate(chunks)
    assert h.n == alld.size == h.counts.sum()
    assert h.min == float(alld.min()) and h.max == float(alld.max())
    np.testing.assert_array_equal(h.counts, accumulate_reference(alld, h.nbins, h.e, h.k0))
    # at least half the bins span the data: the resolution is as fine as the window allows
    assert (h.max - h.min) / h.width >= NBINS / 2 - 2


def test_bounded_memory_after_many_observations():
    rng = np.random.default_rng(1)
    h = Histogram()
    for k in range(200):
        h.observe(rng.standard_normal(500) * (1 + k))
    assert h.counts.size == NBINS and h.n == 100_000 and h.counts.sum() == h.n
    d = h.to_dict()
    assert len(d["counts"]) <= NBINS


def test_min_max_see_every_value_of_a_big_tensor():
    x = np.random.default_rng(10).standard_normal(1 << 20).astype(np.float32)
    x[12345], x[777777] = 9.5, -8.25
    h = _hist(x)
    assert (h.min, h.max) == (-8.25, 9.5) and 0 < h.n <= x.size and h.counts.sum() == h.n


def test_non_finite_values_are_ignored():
    h = _hist([1.0, np.nan, np.inf, -2.0, -np.inf])
    assert (h.min, h.max, h.n, h.counts.sum()) == (-2.0, 1.0, 2, 2)


def test_first_batch_all_zeros_then_real_data():
    h = _hist(np.zeros(100), [0.0, 1.0, 2.0, -3.0])
    assert h.counts.sum() == h.n == 104 and (h.min, h.max) == (-3.0, 2.0)
    np.testing.assert_array_equal(h.counts, accumulate_reference(np.array([0.0] * 101 + [1, 2, -3], np.float32),
                                                                 h.nbins, h.e, h.k0))


def test_first_batch_constant_nonzero():
    h = _hist(np.full(64, 0.5), np.linspace(-1, 1, 65))
    assert h.counts.sum() == h.n == 129 and (h.min, h.max) == (-1.0, 1.0)


def test_to_dict_round_trip():
    rng = np.random.default_rng(2)
    h = _hist(rng.standard_normal(3000), rng.uniform(-5, 20, 1000))
    g = Histogram.from_dict(h.to_dict())
    assert (g.e, g.k0, g.n, g.min, g.max) == (h.e, g.k0, h.n, h.min, h.max)
    np.testing.assert_array_equal(g.edges()[np.argmax(g.counts > 0)], h.edges()[np.argmax(h.counts > 0)])
    for m, fn in METHODS.items():
        assert fn(g) == pytest.approx(fn(h)), m


# --- the methods ----------------------------------------------------------------------------------------

def test_every_method_on_empty_histogram():
    for m, fn in METHODS.items():
        assert fn(Histogram()) == (0.0, 0.0), m


def test_minmax_exact():
    x = np.random.default_rng(3).standard_normal(10_000).astype(np.float32) * 3 + 1
    lo, hi = METHODS["minmax"](_hist(x[:5000], x[5000:]))
    assert (lo, hi) == (float(x.min()), float(x.max()))


def test_percentile_clips_planted_outlier():
    x = np.random.default_rng(4).standard_normal(200_000).astype(np.float32)
    x[17] = 1000.0
    x[18] = -800.0
    lo, hi = METHODS["percentile"](_hist(x))
    assert 3.0 < hi < 6.0 and -6.0 < lo < -3.0


def test_percentile_keeps_nonnegative_data_at_its_min():
    x = np.abs(np.random.default_rng(5).standard_normal(50_000)).astype(np.float32) + 0.25
    lo, hi = METHODS["percentile"](_hist(x))
    assert lo == float(x.min()) and hi <= float(x.max())


def _outlier_data(signed, n):
    rng = np.random.default_rng(6)
    x = rng.standard_normal(n) if signed else np.maximum(rng.standard_normal(n), 0)
    x = x.astype(np.float32)
    x[0] = 500.0
    return x


def _hist_chunked(x, chunk=SAMPLE_PER_IMAGE):
    """Observed in chunks small enough that every value is counted (no per-call subsampling)."""
    return _hist(*(x[k:k + chunk] for k in range(0, x.size, chunk)))


def _quant_mse(x, lo, hi):
    return float(np.mean((Q.fake_quantize(x, Q.activation_qparams(lo, hi)) - x).astype(np.float64) ** 2))


@pytest.mark.parametrize("signed", [False, True])
def test_entropy_clips_far_outlier_and_stays_in_range(signed):
    h = _hist(_outlier_data(signed, 100_000))
    lo, hi = METHODS["entropy"](h)
    assert h.min <= lo <= hi <= h.max
    assert 1.5 < hi < 50, f"entropy range [{lo}, {hi}]"
    if signed:
        assert -50 < lo < -1.5


@pytest.mark.parametrize("signed", [False, True])
def test_mse_clips_far_outlier_and_beats_minmax_on_real_error(signed):
    """One value at 500 among 2M N(0,1) (or its ReLU). The squared-error optimum is a compromise
    (about 140: n (T/255)^2 / 12 against (500 - T)^2); it must lie well below the outlier and give a
    smaller actual fake-quantization error than the minmax range or a clip to the bulk."""
    x = _outlier_data(signed, 2_000_000)
    h = _hist_chunked(x)
    assert h.n == x.size
    lo, hi = METHODS["mse"](h)
    assert h.min <= lo <= hi <= h.max
    assert hi < 250, f"mse kept the outlier: hi={hi}"
    e = _quant_mse(x, lo, hi)
    assert e < _quant_mse(x, h.min, h.max)
    assert e < _quant_mse(x, max(h.min, -5.0), 5.0)


@pytest.mark.parametrize("method", ["mse", "entropy"])
def test_search_methods_keep_full_range_of_uniform_data(method):
    x = np.random.default_rng(7).uniform(-2, 5, 50_000).astype(np.float32)
    lo, hi = METHODS[method](_hist(x))
    assert hi > 4.0 and lo < -1.5


def test_entropy_relu6_spikes_do_not_collapse_range():
    """ReLU6 output: a big spike of exact zeros, another at 6, the rest spread between."""
    rng = np.random.default_rng(8)
    x = np.concatenate([np.zeros(40_000), np.full(20_000, 6.0), rng.uniform(0, 6, 40_000)]).astype(np.float32)
    lo, hi = METHODS["entropy"](_hist(rng.permutation(x)))
    assert lo == 0.0
    assert hi > 5.0, f"entropy collapsed the ReLU6 range to {hi}"


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_returns_finite_ordered_floats(method):
    rng = np.random.default_rng(9)
    h = _hist(rng.standard_normal(1000) * 0.01, rng.exponential(2.0, 1000))
    lo, hi = METHODS[method](h)
    assert isinstance(lo, float) and isinstance(hi, float)
    assert np.isfinite([lo, hi]).all() and h.min <= lo < hi <= h.max



class _BoundedNumpy:
    """numpy, except that zeros() refuses arrays far larger than the histogram itself."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def zeros(shape, *a, **k):
        assert int(np.prod(shape)) <= 16 * NBINS, f"entropy allocates {int(np.prod(shape)):,} bins"
        return np.zeros(shape, *a, **k)


def test_entropy_memory_bounded_on_narrow_positive_band(monkeypatch):
    from qtool.calibrate.methods import entropy
    monkeypatch.setattr(entropy, "np", _BoundedNumpy())
    x = (0.0625 + np.random.default_rng(0).uniform(-1e-6, 1e-6, 1000)).astype(np.float32)
    h = _hist(x)
    lo, hi = entropy.compute(h)
    assert h.min <= lo <= hi <= h.max


def test_mse_cost_in_chunks_is_the_whole_matrix_bit_for_bit():
    """mse scores its 100 candidate ranges a few at a time (cache); each candidate's cost is the same
    row sum as in one [100, bins] matrix, so the range chosen is the same to the last bit."""
    from qtool.calibrate.methods import mse
    rng = np.random.default_rng(3)
    centers = np.sort(rng.standard_normal(1800)) * 3
    counts = rng.integers(0, 1000, 1800).astype(np.float64)
    lo, hi = -3 * np.linspace(0.05, 1, 100), 4 * np.linspace(0.05, 1, 100)
    whole = mse._cost(centers, counts, lo, hi, chunk=1000)
    for chunk in (1, 7, 8, 64):
        assert np.array_equal(mse._cost(centers, counts, lo, hi, chunk=chunk), whole)
