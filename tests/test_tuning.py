"""Output-aware weight rounding (quantize/rounding.py) and activation ranges (quantize/range_search.py)
on small onnx.helper models calibrated from in-memory samples."""
import warnings

import numpy as np
from onnx import helper

from helpers import init, make_model, run, save
from qtool.calibrate.run import calibrate
from qtool.quantize.qdq import quantize_graph
from qtool.quantize.context import QuantizeContext
from qtool.quantize.range_search import search_ranges
from qtool.quantize.samples import SampleSet
from qtool.quantize.rounding import conv_patches, layer_hessians, round_weights
from qtool.ortsession import run_first_output
from qtool import qparams as Q


def _calibrated(model, tmp_path, samples):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return calibrate(save(model, tmp_path / "m.onnx"), samples, None, "minmax", str(tmp_path / "work"),
                         show_progress=False, threads=1)


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

    def err(**kw):
        q = quantize_graph(r.fused, r.table, activations=False, **kw)
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
    y = run_first_output(quantize_graph(r.fused, r.table, ranges=res.ranges).model, feeds)
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
