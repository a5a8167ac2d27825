"""ConvTranspose in int8 (rules/conv.py): weights per output channel along W's axis 1, bias int32 at
s_in * s_w, the input uint8 per tensor; what ONNX Runtime and qtool's runtime compute from it."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from helpers import calibrate_options, init, make_model, run, save, write_samples
from qtool.calibrate.run import calibrate
from qtool.quantize.run import quantize


def _decoder(rng, group=1, one_d=False):
    """x -> Conv -> Relu -> ConvTranspose (stride 2, kernel 4, pads 1: a decoder's upsampling) -> Relu
    -> Conv -> y; with `one_d`, 1-D and (qtool's runtime has no 1-D Conv) x -> ConvTranspose -> Relu
    -> ConvTranspose -> y."""
    k, pads, sp = ([4], [1, 1], (12,)) if one_d else ([4, 4], [1, 1, 1, 1], (12, 12))
    up = dict(strides=[2] * len(k), kernel_shape=k, pads=pads, group=group)
    tail = (3,) * len(k)
    if one_d:
        nodes = [helper.make_node("ConvTranspose", ["x", "w1", "b1"], ["c1"], name="conv1", **up),
                 helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
                 helper.make_node("ConvTranspose", ["r1", "wt", "bt"], ["y"], name="up", **up)]
        inits = [init("w1", rng.standard_normal((3, 16) + tuple(k)) * 0.3), init("b1", rng.standard_normal(16) * 0.1)]
        out = tuple(4 * s for s in sp)
    else:
        nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=pads, name="conv1"),
                 helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
                 helper.make_node("ConvTranspose", ["r1", "wt", "bt"], ["u1"], name="up", **up),
                 helper.make_node("Relu", ["u1"], ["r2"], name="relu2"),
                 helper.make_node("Conv", ["r2", "w2", "b2"], ["y"], pads=pads, name="conv2")]
        inits = [init("w1", rng.standard_normal((16, 3) + tail) * 0.3), init("b1", rng.standard_normal(16) * 0.1),
                 init("w2", rng.standard_normal((2, 8) + tail) * 0.3), init("b2", np.zeros(2))]
        out = tuple(2 * s for s in sp)
    inits += [init("wt", rng.standard_normal((16, 8 // group) + tuple(k)) * 0.15),
              init("bt", rng.standard_normal(8) * 0.1)]
    return make_model(nodes, inits, [("x", ["N", 3, *sp])], [("y", ["N", 8 if one_d else 2, *out])]), (1, 3) + sp


def _quantized(tmp_path, model, shape, seed=0):
    rng = np.random.default_rng(seed)
    path = save(model, tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(8)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(path, data, calibrate_options(show_progress=False, threads=1), str(tmp_path / "work"))
        q = quantize(str(tmp_path / "work"))
    return q


def _sqnr(ref, out):
    err = max(float(np.sum((ref.astype(np.float64) - out) ** 2)), 1e-30)
    return 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / err)


@pytest.mark.parametrize("one_d", [False, True], ids=["2d", "1d"])
def test_conv_transpose_is_int8_close_to_fp32_and_both_runtimes_agree(tmp_path, one_d):
    """The QDQ graph: ConvTranspose reads int8 weights through a DequantizeLinear along axis 1 (one scale
    per output channel), an int32 bias at s_in * s_w, its input through a uint8 per-tensor pair. ORT and
    qtool's runtime (which dequantizes and runs it in float, as ORT does) agree, and the output is close to
    fp32."""
    from qtool.runtime import NativeSession
    rng = np.random.default_rng(1)
    model, shape = _decoder(rng, one_d=one_d)
    q = _quantized(tmp_path, model, shape)
    status = {d["name"]: d["status"] for d in q.report["nodes"]}
    assert status["up"] == "int8"
    m = onnx.load(q.path)
    made = {o: n for n in m.graph.node for o in n.output}
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    up = next(n for n in m.graph.node if n.name == "up")
    x_dq, w_dq, b_dq = (made[i] for i in up.input)
    assert x_dq.op_type == w_dq.op_type == b_dq.op_type == "DequantizeLinear"
    assert inits[x_dq.input[0]].dtype == np.uint8 if x_dq.input[0] in inits else made[x_dq.input[0]].op_type == "QuantizeLinear"
    wq, ws = inits[w_dq.input[0]], inits[w_dq.input[1]]
    assert wq.dtype == np.int8 and ws.shape == (8,) and wq.shape[1] == 8
    assert next(a.i for a in w_dq.attribute if a.name == "axis") == 1
    assert np.abs(wq).max() == 127  # full range: ORT never pairs these weights (no pair-safe trim)
    s_in = inits[x_dq.input[1]]
    bq, bs = inits[b_dq.input[0]], inits[b_dq.input[1]]
    assert bq.dtype == np.int32
    np.testing.assert_allclose(bs, s_in * ws, rtol=1e-6)
    fp32 = onnx.load(str(tmp_path / "work" / "fused.onnx"))
    x = rng.standard_normal((2,) + shape[1:]).astype(np.float32)
    ref, ort_y = run(fp32, {"x": x})[0], run(m, {"x": x})[0]
    assert _sqnr(ref, ort_y) > 25
    ours = NativeSession(q.path, threads=1).run(None, {"x": x})[0]
    # (both run the layer in float: summation order may move a value across a step, nothing more)
    assert _sqnr(ort_y, ours) > 50


def test_conv_transpose_weights_are_exact_under_onnx_runtimes_int16_pair_sums(tmp_path):
    """The default target (portable) promises the exact int8 result on every ORT path: the model, its
    ConvTranspose int8 among pair-safe Convs, computes the same under x86-without-VNNI arithmetic
    (saturating int16 pairs) as exactly."""
    from qtool.arithmetic import ARITHMETICS
    from qtool.runtime import NativeSession
    rng = np.random.default_rng(2)
    model, shape = _decoder(rng)
    q = _quantized(tmp_path, model, shape, seed=2)
    assert q.report["target"] == "portable"
    x = rng.standard_normal((3,) + shape[1:]).astype(np.float32) * 4  # large inputs: saturating pairs would show
    exact, novnni = (NativeSession(q.path, threads=1, arithmetic=a).run(None, {"x": x})[0] for a in ARITHMETICS)
    np.testing.assert_array_equal(exact, novnni)


def test_grouped_conv_transpose_stays_fp32_and_says_why(tmp_path):
    rng = np.random.default_rng(3)
    model, shape = _decoder(rng, group=2)
    q = _quantized(tmp_path, model, shape)
    up = next(d for d in q.report["nodes"] if d["name"] == "up")
    assert up["status"] == "fp32" and "grouped ConvTranspose" in up["reason"]
    assert next(d for d in q.report["nodes"] if d["name"] == "conv1")["status"] == "int8"


def test_bias_correction_of_a_conv_transpose_counts_one_stride_phase_per_output():
    """Rounding shifts a ConvTranspose's output by sum(dW * E[x]) over the taps an output value reads:
    1 / prod(strides) of all of them on average (kernel 4, stride 2: 2 x 2 of its 4 x 4 taps)."""
    from qtool.quantize.weights import WeightLayer, WeightRounding, quantize_weight
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((6, 5, 4, 4)) * 0.2).astype(np.float32)
    mean_x = rng.uniform(0.5, 2.0, 6)
    x = np.broadcast_to(mean_x[None, :, None, None], (1, 6, 9, 9)).astype(np.float32)
    b = np.zeros(5, np.float32)
    layer = WeightLayer(w, 1, b, mean_x, "ConvTranspose", 1, 0.25)
    qw = quantize_weight(layer, WeightRounding())
    from qtool.runtime.fp32_ops import conv_transpose
    at = dict(strides=[2, 2], pads=[1, 1, 1, 1])
    from qtool import qparams as Q
    wd = Q.dequantize_weight(qw.q, qw.scale, 1)
    ref = conv_transpose([x, w, b], at)[0][..., 2:-2, 2:-2]  # (away from the borders)
    raw = conv_transpose([x, wd, b], at)[0][..., 2:-2, 2:-2]
    fixed = conv_transpose([x, wd, qw.bias], at)[0][..., 2:-2, 2:-2]
    mean_err = lambda y: np.abs((y - ref).mean(axis=(0, 2, 3))).mean()  # noqa: E731
    assert mean_err(fixed) < 0.2 * mean_err(raw)


def test_an_input_on_a_shifted_lattice_is_not_shifted_for_a_conv_transpose(tmp_path):
    """Images read by a ConvTranspose first: no Add moves them onto the 8-bit grid (a Conv's bias takes such
    a shift back out; a ConvTranspose's output pixels each read another subset of its taps, so none can)."""
    from helpers import write_config, write_images
    from qtool.calibrate.options import CalibrateOptions, Sampling
    from qtool.quantize.qdq import BuildOptions, quantize_graph
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("ConvTranspose", ["x", "wt", "bt"], ["u"], name="up", strides=[2, 2], kernel_shape=[2, 2]),
             helper.make_node("Relu", ["u"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2", "b2"], ["y"], name="conv2")]
    inits = [init("wt", rng.standard_normal((3, 8, 2, 2)) * 0.3), init("bt", rng.standard_normal(8) * 0.1),
             init("w2", rng.standard_normal((4, 8, 1, 1)) * 0.3), init("b2", rng.standard_normal(4) * 0.1)]
    model = make_model(nodes, inits, [("x", [None, 3, 16, 16])], [("y", [None, 4, 32, 32])])
    write_images(tmp_path / "d", 8, h=16, w=16)
    cfg = write_config(tmp_path / "cfg.toml")  # (p - 127.5) / 127.5: the points half a step off any grid
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = calibrate(save(model, tmp_path / "m.onnx"), str(tmp_path / "d"),
                      CalibrateOptions(config=cfg, method="minmax", threads=1, sampling=Sampling(batch=4),
                                       show_progress=False), workdir=str(tmp_path / "w"))
    assert "x" in r.table.lattices
    out = quantize_graph(r.fused, r.table, BuildOptions())
    assert not out.input_shifts and not any(n.op_type == "Add" for n in out.model.graph.node)
    assert {d.name: d.status for d in out.plan.decisions}["up"] == "int8"
