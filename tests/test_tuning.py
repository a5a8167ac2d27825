"""Output-aware weight rounding (quantize/rounding.py) and activation ranges (quantize/range_search.py)
on small onnx.helper models calibrated from in-memory samples."""
import warnings

import numpy as np
import pytest
from onnx import helper

from helpers import init, make_model, run, save
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions
from qtool.quantize.qdq import quantize_graph
from qtool.quantize.context import QuantizeContext
from qtool.quantize.range_search import search_ranges
from qtool.quantize.samples import SampleSet
from qtool.quantize.rounding import conv_patches, layer_hessians, round_weights
from qtool.ortsession import run_first_output
from qtool import qparams as Q
from qtool.quantize.qdq import BuildOptions


def _calibrated(model, tmp_path, samples):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return calibrate(save(model, tmp_path / "m.onnx"), samples,
                         CalibrateOptions(config=None, method="minmax", threads=1, show_progress=False),
                         workdir=str(tmp_path / "work"))


def _correlated(rng, n, c, hw):
    """Inputs whose channels are strongly correlated (and not centred): what makes rounding choices matter."""
    base = rng.standard_normal((n, 2, hw, hw))
    mix = rng.standard_normal((c, 2))
    return (np.einsum("ck,nkhw->nchw", mix, base) + 0.3 * rng.standard_normal((n, c, hw, hw)) + 0.5).astype(np.float32)


def test_conv_patches_reproduce_the_convolution():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 7, 9)).astype(np.float32)
    w = rng.standard_normal((6, 2, 3, 3)).astype(np.float32)
    m = make_model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 0, 1, 2],
                                     strides=[2, 1], group=2)],
                   [init("w", w)], [("x", [2, 4, 7, 9])], [("y", None)])
    y = run(m, {"x": x})[0]  # [2, 6, oh, ow]
    p = conv_patches(x, (3, 3), (2, 1), (1, 0, 1, 2), 2, np.random.default_rng(0), max_positions=10 ** 6)
    # p: [G, N * oh * ow, 18]; group g's output channels are 3g .. 3g + 2
    wg = w.reshape(2, 3, -1)
    got = np.einsum("gnk,gck->gcn", p, wg).reshape(6, 2, -1)  # [Cout, images, positions]
    want = y.transpose(1, 0, 2, 3).reshape(6, 2, -1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_round_weights_never_worse_than_nearest_and_stays_within_a_step():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 12)).astype(np.float32)
    s = Q.weight_scales(w, 0)
    a = rng.standard_normal((12, 3))
    h = (a @ a.T + 0.05 * np.eye(12))[None]  # strongly correlated inputs
    q0, q1 = Q.quantize_weight(w, s, 0), round_weights(w, s, 0, h)

    def obj(q):
        e = (Q.dequantize_weight(q, s, 0) - w).astype(np.float64)
        return float(np.einsum("ck,kl,cl->", e, h[0], e))
    assert obj(q1) < 0.7 * obj(q0)
    assert np.all(np.abs(q1.astype(np.float64) - w / s[:, None]) < 1.0)
    # uncorrelated inputs: nearest is already optimal, nothing moves
    np.testing.assert_array_equal(round_weights(w, s, 0, np.eye(12)[None] * 3.0), q0)


def test_output_aware_rounding_lowers_a_conv_output_error(tmp_path):
    """Weights only, on the calibration samples themselves: the conv output's error is dW x, whose mean
    square the rounding lowers (bias correction removes the mean part in both cases)."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 6, 3, 3)) * 0.3
    m = make_model([helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", kernel_shape=[3, 3])],
                   [init("w", w), init("b", np.zeros(4))], [("x", ["N", 6, 8, 8])], [("y", None)])
    xs = _correlated(rng, 12, 6, 8)
    r = _calibrated(m, tmp_path, [{"x": xs[k:k + 4]} for k in range(0, 12, 4)])
    feeds = [{"x": xs}]
    hess = layer_hessians(r.fused, feeds)
    assert set(hess) == {"conv"} and hess["conv"].shape == (1, 54, 54)
    ref = run_first_output(r.fused, feeds)

    def err(hessians=None):
        q = quantize_graph(r.fused, r.table, BuildOptions(activations=False, hessians=hessians))
        return float(((run_first_output(q.model, feeds) - ref) ** 2).mean())
    assert err(hessians=hess) < 0.8 * err()


def _outlier_channel_chain(rng):
    """x -> c1 (1x1) -> t -> c2 (1x1) -> y, where t's channel 0 is 20x larger than the others (it sets
    t's min/max range) but c2 ignores it (zero weights): clipping t costs nothing at the output."""
    w1 = rng.standard_normal((4, 4, 1, 1)) * 0.5
    w1[0] *= 20.0
    w2 = rng.standard_normal((3, 4, 1, 1)) * 0.5
    w2[:, 0] = 0.0
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["t"], name="c1", kernel_shape=[1, 1]),
             helper.make_node("Conv", ["t", "w2", "b2"], ["y"], name="c2", kernel_shape=[1, 1])]
    return make_model(nodes, [init("w1", w1), init("b1", np.zeros(4)), init("w2", w2), init("b2", np.zeros(3))],
                      [("x", ["N", 4, 6, 6])], [("y", None)])


def test_range_search_clips_what_the_output_does_not_need(tmp_path):
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((16, 4, 6, 6)).astype(np.float32)
    r = _calibrated(_outlier_channel_chain(rng), tmp_path, [{"x": xs[k:k + 4]} for k in range(0, 16, 4)])
    feeds = [{"x": xs}]
    ref = run_first_output(r.fused, feeds)
    res = search_ranges(QuantizeContext(r.fused, r.table, "minmax"), SampleSet(list(range(16)), {"x": xs}, ref))
    lo, hi = r.table.range("t", "minmax")
    assert res.kept and "t" in res.ranges, res.to_dict()
    assert res.ranges["t"][1] - res.ranges["t"][0] < 0.8 * (hi - lo)
    assert res.sqnr_tuned_db > res.sqnr_default_db + 1.0
    # and the int8 model built with the tuned ranges is the closer one
    y = run_first_output(quantize_graph(r.fused, r.table, BuildOptions(ranges=res.ranges)).model, feeds)
    y0 = run_first_output(quantize_graph(r.fused, r.table).model, feeds)
    assert ((y - ref) ** 2).sum() < ((y0 - ref) ** 2).sum()


def test_range_search_keeps_the_default_when_clipping_hurts(tmp_path):
    """The same chain with c2 reading channel 0 as well: clipping t now costs more than it saves."""
    rng = np.random.default_rng(3)
    m = _outlier_channel_chain(rng)
    w2 = next(t for t in m.graph.initializer if t.name == "w2")
    w2.CopyFrom(init("w2", np.full((3, 4, 1, 1), 0.5)))
    xs = rng.standard_normal((16, 4, 6, 6)).astype(np.float32)
    r = _calibrated(m, tmp_path, [{"x": xs[k:k + 4]} for k in range(0, 16, 4)])
    feeds = [{"x": xs}]
    res = search_ranges(QuantizeContext(r.fused, r.table, "minmax"),
                        SampleSet(list(range(16)), {"x": xs}, run_first_output(r.fused, feeds)))
    assert "t" not in res.ranges, res.to_dict()


def _problem(rng, g, c, k, pair_safe):
    """One layer's rounding problem: weights [G*C, K], scales, a correlated covariance per group."""
    from qtool.quantize.encoding import _flat_partners
    w = rng.standard_normal((g * c, k)) * rng.uniform(0.2, 3.0, (g * c, 1))
    s = Q.weight_scales(w.astype(np.float32), 0).astype(np.float64)
    if pair_safe:  # a scale that leaves some pairs past the limit: the descent has trims to improve on
        s = s * 0.6
    a = rng.standard_normal((g, k, 3))
    h = a @ a.transpose(0, 2, 1) + 0.05 * np.eye(k)[None]
    partners = _flat_partners(k)
    if pair_safe and k > 3:
        partners[1], partners[3] = 3, 1  # ORT's conv K order is not always neighbours in the row
        partners[0], partners[2] = -1, -1  # and a weight may pair with padding
    return w, s, h, partners


@pytest.mark.parametrize("g,c,k", [(1, 16, 12), (3, 4, 9), (2, 5, 1), (1, 1, 33)])
@pytest.mark.parametrize("pair_safe", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_native_descent_gives_the_numpy_reference_bit_for_bit(g, c, k, pair_safe, threads):
    from qtool.quantize import rounding as R
    if R._native is None:
        pytest.skip("the rounding extension is not built")
    rng = np.random.default_rng(g * 100 + c * 10 + k + pair_safe)
    w, s, h, partners = _problem(rng, g, c, k, pair_safe)
    v = (w / s[:, None]).reshape(g, c, k)
    if pair_safe:
        from qtool.quantize.encoding import project
        q0 = project(v.reshape(g * c, k), np.clip(np.rint(v.reshape(g * c, k)), -127, 127), partners)
        q0 = q0.astype(np.float64).reshape(g, c, k)
        extra = dict(v=v, partners=partners)
    else:
        lo, hi = np.clip(np.floor(v), -127, 127), np.clip(np.ceil(v), -127, 127)
        q0 = np.clip(np.rint(v), -127, 127)
        extra = dict(lo=lo, hi=hi)
    sg = s.reshape(g, c)
    results = []
    for native in (False, True):
        q = q0.copy()
        grad = np.matmul(q * sg[:, :, None] - w.reshape(g, c, k), h)
        R.descend(q, grad, h, sg, 4, R.Moves(**extra), native=native, threads=threads)
        results.append((q, grad))
    assert not np.array_equal(results[0][0], q0) or k == 1  # the descent moved something: the test compares work
    np.testing.assert_array_equal(results[1][0], results[0][0])
    np.testing.assert_array_equal(results[1][1], results[0][1])


def test_input_covariance_streams_to_the_covariance_even_where_the_mean_dwarfs_the_spread():
    from qtool.quantize.rounding import InputCovariance
    rng = np.random.default_rng(3)
    mix = rng.standard_normal((5, 5))
    x = (rng.standard_normal((2, 3000, 5)) @ mix + 1000.0).astype(np.float32)  # mean 1000, spread ~2
    acc = InputCovariance(2, 5)
    for lo, hi in ((0, 7), (7, 1000), (1000, 1000), (1000, 3000)):  # 7, 993, none and 2000 samples
        acc.add(x[:, lo:hi])
    assert acc.n == 3000
    acc.n = 10 ** 9  # (no shrinkage toward the diagonal: compare the raw estimate)
    got = acc.hessian() * (10 ** 9 / 3000)
    want = np.stack([np.cov(x[g].astype(np.float64).T, bias=True) for g in range(2)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(acc.mean, x.astype(np.float64).mean(axis=1), rtol=1e-7)


def test_shifted_conv_patches_are_the_patches_minus_the_shift_padding_included():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 4, 7, 9)).astype(np.float32) + 5.0
    c = x.mean(axis=(0, 2, 3))
    kw = dict(kernel=(3, 3), strides=(2, 1), pads=(1, 0, 1, 2), groups=2)
    plain = conv_patches(x, rng=np.random.default_rng(0), **kw)
    shifted = conv_patches(x, rng=np.random.default_rng(0), shift=c, **kw)
    np.testing.assert_allclose(shifted, plain - np.repeat(c.reshape(2, 2), 9, axis=1)[:, None, :], atol=1e-5)


def test_the_hessian_is_made_in_place_of_its_accumulator():
    """hessian() spends the accumulator (its [G, K, K] becomes the result: one copy of every layer's
    covariance, not two or three), with the same values as the copying formula."""
    from qtool.quantize.rounding import InputCovariance
    rng = np.random.default_rng(5)
    acc = InputCovariance(3, 6)
    acc.add(rng.standard_normal((3, 20, 6)).astype(np.float32))
    m2, n = acc.m2.copy(), acc.n
    cov = m2 / n
    a = 6 / (6 + n)
    want = (1 - a) * cov
    want[:, np.arange(6), np.arange(6)] = np.einsum("gkk->gk", cov)
    store = acc.m2
    got = acc.hessian()
    assert got is store and acc.m2 is None
    np.testing.assert_array_equal(got, want)
