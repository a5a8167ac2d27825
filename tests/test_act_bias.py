"""act_bias.py: each int8 input quantizer's mean rounding error, measured and taken out of the bias."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from helpers import init, make_model, run
from qtool.quantize.act_bias import InputShift, _coverage, _rounding_error
from qtool.qparams import activation_qparams


def _conv(group=1, pads=(1, 1, 1, 1), strides=(1, 1)):
    return helper.make_node("Conv", ["x", "w"], ["y"], name="c", kernel_shape=[3, 3], pads=list(pads),
                            strides=list(strides), group=group)


def test_each_tap_counts_where_it_reads_the_input():
    c = _coverage(_conv(), (3, 5), [3, 3])
    # rows: the top tap reads padding for output row 0 (of 3), the bottom one for row 2
    np.testing.assert_allclose(c[:, 1], [2 / 3, 1, 2 / 3])
    np.testing.assert_allclose(c[1, :], [4 / 5, 1, 4 / 5])
    assert c[0, 0] == pytest.approx(2 / 3 * 4 / 5)
    np.testing.assert_allclose(_coverage(_conv(pads=(0, 0, 0, 0)), (3, 5), [3, 3]), np.ones((3, 3)))
    assert _coverage(helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER"), (3, 5), [3, 3]) is None


@pytest.mark.parametrize("group,strides", [(1, (1, 1)), (2, (1, 1)), (4, (2, 2))])
def test_the_shift_is_what_the_conv_makes_of_the_mean_error(group, strides):
    """W d with each tap's coverage is the mean over output positions of the convolution of an input
    that is d everywhere (its padding 0): what the rounding's mean error does to the output."""
    rng = np.random.default_rng(group)
    cin, cout, h, wd = 4, 8, 3, 7
    w = rng.standard_normal((cout, cin // group, 3, 3)).astype(np.float32)
    d = rng.standard_normal(cin).astype(np.float32)
    node = _conv(group, strides=strides)
    m = make_model([node], [init("w", w)], [("x", [1, cin, h, wd])], [("y", None)])
    y = run(m, {"x": np.broadcast_to(d.reshape(1, cin, 1, 1), (1, cin, h, wd)).astype(np.float32)})[0]
    s = InputShift("x", 0.1, 128, d.astype(np.float64), _coverage(node, (h, wd), [3, 3]))
    np.testing.assert_allclose(s.output_shift(node, w), y.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-5)


def test_a_gemm_shift_follows_its_weight_layout():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 4))  # [K, N]
    d = rng.standard_normal(6)
    s = InputShift("x", 0.1, 128, d)
    np.testing.assert_allclose(s.output_shift(helper.make_node("Gemm", ["x", "w"], ["y"]), w), d @ w)
    np.testing.assert_allclose(s.output_shift(helper.make_node("Gemm", ["x", "w"], ["y"], transB=1), w.T), d @ w)
    assert s.output_shift(helper.make_node("Gemm", ["x", "w"], ["y"]), w.T) is None  # (shapes that do not fit)


def test_the_rounding_error_rounds_as_quantize_linear():
    qp = activation_qparams(-1.0, 1.0)
    x = np.array([[[[0.5 * qp.scale]], [[3.0]]]], np.float32)  # a half step (to even: 0), and past the range
    m = make_model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                    helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])],
                   [init("s", np.float32(qp.scale)), helper.make_tensor("z", onnx.TensorProto.UINT8, [], [qp.zero_point])],
                   [("x", [1, 2, 1, 1])], [("y", [1, 2, 1, 1])])
    np.testing.assert_allclose(_rounding_error(x, qp), (run(m, {"x": x})[0] - x).reshape(2), atol=1e-7)


def test_a_crowded_input_no_longer_shifts_the_output(tmp_path, monkeypatch):
    """x -> Conv -> HardSwish (fp32) -> Conv -> y, the second Conv's input crowded below a step (most of
    hard-swish's outputs between -0.375 and 0 beside a few large ones): the int8 model's mean error per
    output channel falls with the correction, and quantize.json names the layers corrected."""
    import json
    import warnings

    from helpers import save
    from qtool.api import calibrate, quantize
    from qtool.quantize import run as quantize_run
    rng = np.random.default_rng(3)
    w1 = rng.standard_normal((8, 3, 1, 1)).astype(np.float32)
    b1 = np.full(8, -2.0, np.float32)
    b1[0] = 4.0
    w1[0] *= 20.0  # (one wide channel sets the range: the rest crowd the steps near 0)
    m = make_model([helper.make_node("Conv", ["x", "w1", "b1"], ["z"], name="c1", kernel_shape=[1, 1]),
                    helper.make_node("HardSwish", ["z"], ["h"], name="hs"),
                    helper.make_node("Conv", ["h", "w2", "b2"], ["y"], name="c2", kernel_shape=[3, 3], pads=[1] * 4)],
                   [init("w1", w1), init("b1", b1), init("w2", np.abs(rng.standard_normal((4, 8, 3, 3))) * 0.3),
                    init("b2", np.zeros(4))], [("x", ["N", 3, 6, 6])], [("y", ["N", 4, 6, 6])], opset=14)
    path = save(m, str(tmp_path / "m.onnx"))
    data = tmp_path / "data"
    data.mkdir()
    xs = [rng.standard_normal((1, 3, 6, 6)).astype(np.float32) for _ in range(24)]
    for k, x in enumerate(xs):
        np.save(data / f"{k:02d}.npy", x)

    def mean_error(q):
        m8 = onnx.load(q.path)
        return np.abs(np.mean([run(m8, {"x": x})[0] - run(m, {"x": x})[0] for x in xs], axis=(0, 1, 3, 4))).mean()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(path, str(data), method="minmax", workdir=str(tmp_path / "w"), verbose=False, threads=1)
        corrected = quantize(str(tmp_path / "w"), strict=True, verbose=False, rounding=False, sensitivity=False)
        report = json.loads((tmp_path / "w" / "quantize.json").read_text())
        monkeypatch.setattr(quantize_run, "correct_activation_bias", lambda ctx, samples, say: {})
        plain = quantize(str(tmp_path / "w"), strict=True, verbose=False, rounding=False, sensitivity=False,
                         output=str(tmp_path / "plain.onnx"))
    assert "c2" in report["activation_bias_layers"]
    assert mean_error(corrected) < 0.5 * mean_error(plain), (mean_error(corrected), mean_error(plain))
