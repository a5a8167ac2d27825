"""Inputs on an 8-bit lattice (lattice.py): found in the calibration values, quantized exactly."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper, TensorProto

from qtool import qparams as Q
from qtool.calibrate.distinct import DistinctValues
from qtool.lattice import Lattice, find_lattice, lattice_qparams
from qtool.quantize.qdq import BuildOptions

PIXELS = np.arange(256, dtype=np.float32)


def _distinct(x):
    d = DistinctValues()
    d.add(x)
    return d


@pytest.mark.parametrize("norm, shift", [
    (lambda p: (p / 255 - 0.5) / 0.5, True),  # PaddleOCR: odd multiples of 1/255, half a step off any grid
    (lambda p: p / 127.5 - 1, True),  # TensorFlow "tf" mode: the same points
    (lambda p: (p - 127) / 128, False),  # EfficientNet-Lite: on a grid already
    (lambda p: p / 255, False),
])
def test_normalised_pixels_are_quantized_exactly(norm, shift):
    x = norm(PIXELS).astype(np.float32)
    lat = _distinct(x).lattice()
    assert lat is not None and lat.steps == 255 and lat.off == 0
    assert bool(lat.shift) == shift
    scale, zp, s = lattice_qparams(lat, float(x.min()), float(x.max()))
    qp = Q.ActQParams(scale, zp)
    y = (Q.quantize(x + np.float32(s), qp).astype(np.float32) - zp) * np.float32(scale) - np.float32(s)
    assert np.abs(y - x).max() < 1e-6  # every pixel exact (to float32 rounding)
    plain = Q.activation_qparams(float(x.min()), float(x.max()))
    err = np.abs((Q.quantize(x, plain).astype(np.float32) - plain.zero_point) * plain.scale - x).max()
    assert not shift or err > 0.3 * plain.scale  # where a shift is needed, the plain grid is off by half a step


def test_a_few_off_lattice_values_are_allowed_but_not_many():
    x = (PIXELS / 127.5 - 1).astype(np.float32)
    padded = np.concatenate([x, np.zeros(1000, np.float32)])  # right-padded crops: 0.0 is off the lattice
    lat = _distinct(padded).lattice()
    assert lat is not None and lat.off == 1 and lat.steps == 255
    noisy = x + np.random.default_rng(0).normal(0, 1e-3, x.shape).astype(np.float32)
    assert _distinct(noisy).lattice() is None
    assert _distinct(np.random.default_rng(0).normal(size=5000).astype(np.float32)).lattice() is None


def test_imagenet_normalisation_per_channel_is_no_single_lattice():
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    x = ((PIXELS[None, :] / 255 - mean[:, None]) / std[:, None]).astype(np.float32)
    assert _distinct(x).lattice() is None


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_distinct_values_are_np_unique_of_the_floats(dtype, native):
    """The native hash set of bit patterns (float32) and numpy's unique (any float type) hold the same
    set: +0 and -0 one value, a NaN or an infinity anywhere gives up, past MAX_DISTINCT gives up."""
    from qtool.calibrate import distinct
    from qtool.lattice import MAX_DISTINCT
    if native and distinct._native is None:
        pytest.skip("the native set is not built")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (2, 3, 8, 8)).astype(dtype) / dtype(255) - dtype(0.5)
    x.reshape(-1)[:5] = [0.0, -0.0, 0.0, -0.0, 0.5]
    d = DistinctValues(native=native)
    d.add(x)
    d.add(x[::-1] * dtype(2))
    want = np.union1d(np.unique(x.astype(np.float64)), np.unique((x[::-1] * dtype(2)).astype(np.float64)))
    assert not d.given_up and np.array_equal(d.values, want) and np.count_nonzero(d.values == 0) == 1
    for bad in (np.nan, np.inf, -np.inf):
        e = DistinctValues(native=native)
        e.add(x)
        y = x.copy()
        y.reshape(-1)[7] = bad
        e.add(y)
        assert e.given_up
    # exactly MAX_DISTINCT values, both zeros among them: kept; one more value: given up
    many = np.concatenate([[-0.0], np.arange(MAX_DISTINCT, dtype=np.float64)]).astype(np.float32)
    f = DistinctValues(native=native)
    f.add(many)
    assert not f.given_up and f.values.size == MAX_DISTINCT
    f.add(np.float32([0.0, -0.0, 1.0]))
    assert not f.given_up
    f.add(np.float32([MAX_DISTINCT + 0.5]))
    assert f.given_up


def test_spans_beyond_256_levels_and_huge_sets_are_refused():
    assert find_lattice(np.arange(300, dtype=np.float64) / 255) is None
    d = DistinctValues()
    d.add(np.arange(5000, dtype=np.float32))
    assert d.given_up and d.lattice() is None
    assert Lattice.from_dict({"spacing": -1, "offset": 0, "lo": 0, "hi": 1}) is None
    assert Lattice.from_dict({"spacing": "x"}) is None


# --- end to end: calibrate finds it, quantize builds it, ONNX Runtime and qtool's runtime run it ----------

def _first_conv_model():
    """x [N,3,16,16] -> Conv 3x3 pad 1 (+bias) -> Relu -> Conv 1x1: the input read by a layer with a bias."""
    from helpers import init, make_model, weight
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="conv2")]
    inits = [weight(rng, "w1", 8, 3, 3, 3), init("b1", rng.standard_normal(8) * 0.1),
             weight(rng, "w2", 4, 8, 1, 1), init("b2", rng.standard_normal(4) * 0.1)]
    return make_model(nodes, inits, [("x", [None, 3, 16, 16])], [("y", [None, 4, 16, 16])])


def test_quantize_puts_a_lattice_input_on_the_grid_and_keeps_the_output(tmp_path):
    import warnings

    from helpers import save, write_config, write_images
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions, Sampling
    from qtool.data.config import load_config
    from qtool.data.images import list_images, load_image
    from qtool.quantize.qdq import quantize_graph

    write_images(tmp_path / "d", 8, h=16, w=16)
    cfg = write_config(tmp_path / "cfg.toml")  # (p - 127.5) / 127.5: the points half a step off any grid
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = calibrate(save(_first_conv_model(), tmp_path / "m.onnx"), str(tmp_path / "d"),
                      CalibrateOptions(config=cfg, method="minmax", threads=1,
                                       sampling=Sampling(batch=4), show_progress=False),
                      workdir=str(tmp_path / "w"))
    assert "x" in r.table.lattices and Lattice.from_dict(r.table.lattices["x"]).shift != 0
    c = load_config(cfg)
    x = np.concatenate([load_image(f, c) for f in list_images(str(tmp_path / "d"))])
    ref = _ort(r.fused, x)
    # (the default target: exact in ONNX Runtime on every x86 tier, so the comparison below is the same on any CPU)
    on = quantize_graph(r.fused, r.table, BuildOptions(bias_correction=False))
    lattice = r.table.lattices["x"]
    r.table.lattices = {}
    off = quantize_graph(r.fused, r.table, BuildOptions(bias_correction=False))
    adds = [n for n in on.model.graph.node if n.op_type == "Add" and "x" in n.input]
    assert len(adds) == 1 and not any(n.op_type == "Add" for n in off.model.graph.node)
    assert list(on.input_shifts) == ["x"] and not off.input_shifts
    assert any("quantized exactly" in s for s in on.notes)
    # the first layer reads every pixel exactly, shifted ...
    conv1 = next(n for n in on.model.graph.node if n.op_type == "Conv" and n.name == "conv1")
    probe = onnx.ModelProto()
    probe.CopyFrom(on.model)
    probe.graph.output.append(helper.make_tensor_value_info(conv1.input[0], TensorProto.FLOAT, None))
    seen = _ort(probe, x, 1)
    shift = float(numpy_helper.to_array(next(i for i in on.model.graph.initializer if i.name == adds[0].input[1])))
    assert np.abs(seen - shift - x).max() < 1e-6
    # ... and its bias takes the shift back out: the int8 output is no further from fp32 than with the
    # calibrated grid (without the bias term it is 10 dB further: every output moves by shift * sum(w))
    err_on, err_off = _sqnr(ref, _ort(on.model, x)), _sqnr(ref, _ort(off.model, x))
    assert err_on > err_off - 0.2, (err_on, err_off)
    # qtool's runtime runs the shift as ONNX Runtime does (the default target: exact in ORT on any CPU;
    # the float output layer to float rounding)
    from qtool.runtime import NativeSession
    r.table.lattices = {"x": lattice}
    exact = quantize_graph(r.fused, r.table).model
    assert any(n.op_type == "Add" for n in exact.graph.node)
    np.testing.assert_allclose(NativeSession(exact).run(None, {"x": x})[0], _ort(exact, x), rtol=1e-5, atol=1e-5)


def _ort(model, x, k=0):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[k]


def _sqnr(ref, out):
    ref, out = ref.astype(np.float64), out.astype(np.float64)
    return 10 * np.log10((ref ** 2).sum() / ((ref - out) ** 2).sum())


def test_the_shift_is_chosen_by_measurement(tmp_path):
    """input_grid.py scores the int8 model with and without the shift on calibration samples and keeps
    the better; an input without a shifted lattice has nothing to choose."""
    import warnings

    from helpers import save, write_config, write_images
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions, Sampling
    from qtool.quantize.context import QuantizeContext
    from qtool.quantize.input_grid import choose_input_grid
    from qtool.quantize.samples import load_samples
    from qtool.data.images import list_images

    write_images(tmp_path / "d", 8, h=16, w=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = calibrate(save(_first_conv_model(), tmp_path / "m.onnx"), str(tmp_path / "d"),
                      CalibrateOptions(config=write_config(tmp_path / "cfg.toml"), method="minmax", threads=1,
                                       sampling=Sampling(batch=4), show_progress=False),
                      workdir=str(tmp_path / "w"))
    samples = load_samples(r.fused, r.table, list_images(str(tmp_path / "d")))
    ctx = QuantizeContext(r.fused, r.table, "minmax", threads=1)
    said = []
    got = choose_input_grid(ctx, samples, said.append)
    shifted, plain = got["scores_db"]["shifted onto its grid"], got["scores_db"]["as calibrated"]
    assert ctx.input_grid == (shifted > plain) and got["inputs"] == ["x"] and len(said) == 1
    # the chosen setting is what the written model has
    assert any(n.op_type == "Add" for n in ctx.build().model.graph.node) == ctx.input_grid
    ctx.table.lattices = {}
    assert choose_input_grid(ctx, samples, said.append) is None
