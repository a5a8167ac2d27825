"""Quantization: a small conv net calibrated from PIL images, then quantized to QDQ; the result is
checked structurally (dtypes, per-channel weights, bias scale = s_in * s_w) and numerically in ORT."""
from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from helpers import calibrate_options, init, make_model, ops, run, save, small_convnet, weight, write_config, write_images
from qtool import qparams as Q
from qtool.data.config import load_config
from qtool.data.images import list_images, load_image
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions
from qtool.calibrate.table import load_table
from qtool.errors import QtoolError
from qtool.plan import make_plan
from qtool.quantize.qdq import quantize_graph
from qtool.quantize.run import quantize
from qtool.quantize.options import QuantizeOptions, SensitivityOptions
from qtool.quantize.qdq import BuildOptions


def _cal(model, tmp_path, n=6, cfg=None, seed=1, **kw):
    data = tmp_path / "data"
    if not data.exists():
        write_images(data, n, seed=seed)
    cfg = cfg or write_config(tmp_path / "cfg.toml")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return calibrate(save(model, tmp_path / "net.onnx"), str(data),
                         calibrate_options(config=cfg, method="minmax", batch=4, show_progress=False, threads=1, **kw),
                         str(tmp_path / "work"))


def _inputs(cfg_path, folder):
    c = load_config(cfg_path)
    return np.concatenate([load_image(f, c) for f in list_images(folder)])


def _sqnr(ref, out):
    ref, out = ref.astype(np.float64), out.astype(np.float64)
    return 10 * np.log10((ref ** 2).sum() / ((ref - out) ** 2).sum())


def _inits(m):
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


def _producer(m, name):
    return next((n for n in m.graph.node if name in n.output), None)


@pytest.fixture(scope="module")
def q(calibrated):
    """The session's calibrated small net quantized without bias correction (so biases are checkable),
    with plain int8 weights (the vnni target: max |q| is 127 in every channel)."""
    root, model, data, cfg, r = calibrated
    return quantize_graph(r.fused, r.table, BuildOptions(bias_correction=False, target="vnni")), r


def test_quantized_graph_is_valid_and_clean(q):
    out, _ = q
    onnx.checker.check_model(out.model, full_check=True)
    kinds = ops(out.model)
    for op in ("BatchNormalization", "Identity", "Shape", "Pad", "Relu"):
        assert op not in kinds, op  # the Relus are fused into the Q clamp of their producers
    assert kinds["QuantizeLinear"] == len(out.plan.tensors)
    assert out.plan.summary() == {"int8": 6, "fused": 3, "passthrough": 1}


def test_weights_int8_per_channel_symmetric(q):
    out, r = q
    m, inits = out.model, _inits(out.model)
    fused_inits = _inits(r.fused)
    checked = 0
    for node in m.graph.node:
        if node.op_type not in ("Conv", "Gemm"):
            continue
        dq = _producer(m, node.input[1])
        assert dq.op_type == "DequantizeLinear"
        wq, ws, wz = (inits[i] for i in dq.input)
        axis = next(a.i for a in dq.attribute if a.name == "axis")
        assert wq.dtype == np.int8 and np.abs(wq.astype(int)).max() <= 127
        assert wz.dtype == np.int8 and not wz.any()
        assert ws.dtype == np.float32 and ws.shape == (wq.shape[axis],)
        assert axis == (0 if node.op_type == "Conv" else 0)  # Gemm here has transB=1
        # each output channel uses its full range: max |q| == 127 per channel
        assert (np.abs(np.moveaxis(wq, axis, 0).reshape(wq.shape[axis], -1)).max(1) == 127).all()
        # dequantized weights are within half a step of the fused fp32 weights
        w = fused_inits[[i for i in fused_inits if dq.input[0].startswith(i)][0]]
        err = np.abs(Q.dequantize_weight(wq, ws, axis) - w)
        assert (np.moveaxis(err, axis, 0).reshape(len(ws), -1).max(1) <= ws / 2 + 1e-7).all()
        checked += 1
    assert checked == 4


def test_activations_uint8_and_bias_int32_with_scale_s_in_times_s_w(q):
    out, r = q
    m, inits = out.model, _inits(out.model)
    fused_inits = _inits(r.fused)
    for node in m.graph.node:
        if node.op_type == "QuantizeLinear":
            s, z = inits[node.input[1]], inits[node.input[2]]
            assert z.dtype == np.uint8 and s.dtype == np.float32 and s.shape == () and s > 0
    fused_nodes = {n.name: n for n in r.fused.graph.node}
    for node in m.graph.node:
        if node.op_type not in ("Conv", "Gemm"):
            continue
        x_dq, w_dq, b_dq = (_producer(m, i) for i in node.input[:3])
        s_in = inits[x_dq.input[1]]
        s_w = inits[w_dq.input[1]]
        bq, bs, bz = (inits[i] for i in b_dq.input)
        assert bq.dtype == np.int32 and bz.dtype == np.int32 and not bz.any()
        np.testing.assert_allclose(bs, np.float32(s_in) * s_w, rtol=1e-6)
        b = fused_inits[fused_nodes[node.name].input[2]].astype(np.float64)
        shift = _grid_shift(m, inits, x_dq)
        if shift:  # the input arrives shifted onto its grid (lattice.py): the bias takes the shift back out
            w = (inits[w_dq.input[0]].astype(np.float64) - inits[w_dq.input[2]].reshape(-1, *[1] * 3)) \
                * s_w.astype(np.float64).reshape(-1, 1, 1, 1)
            b = b - shift * w.sum(axis=(1, 2, 3))
        assert np.abs(bq * bs.astype(np.float64) - b).max() <= bs.max() / 2 * 1.001  # round to nearest


def _grid_shift(m, inits, x_dq) -> float:
    """The constant added before the quantizer that `x_dq` dequantizes (0 where none)."""
    add = _producer(m, _producer(m, x_dq.input[0]).input[0])
    return float(inits[add.input[1]]) if add is not None and add.op_type == "Add" else 0.0


def test_fused_relu_gives_zero_point_zero(q):
    out, _ = q
    for t in ("a1", "a2"):  # Conv+BN+Relu outputs
        assert out.qparams[t].zero_point == 0
        assert out.plan.clamp[t] == (0.0, np.inf)


def test_int8_output_close_to_fp32(q, calibrated):
    out, r = q
    root, model, data, cfg, _ = calibrated
    held = root / "held"
    write_images(held, 5, seed=7)
    x = _inputs(cfg, held)
    ref = run(onnx.load(model), {"x": x})[0]
    got = run(out.model, {"x": x})[0]
    assert got.shape == ref.shape == (5, 5)
    assert _sqnr(ref, got) > 20, f"SQNR {_sqnr(ref, got):.1f} dB"
    assert not np.array_equal(ref, got)  # it really is quantized
    # dynamic batch survives quantization
    assert run(out.model, {"x": x[:3]})[0].shape == (3, 5)


def test_method_choice_sets_activation_qparams(calibrated):
    root, model, data, cfg, r = calibrated
    for method in ("minmax", "percentile", "entropy", "mse"):
        out = quantize_graph(r.fused, r.table, BuildOptions(method=method))
        for t in ("a1", "a2"):  # (the input "x" is on an 8-bit lattice: quantized on its grid, test_lattice.py)
            lo, hi = r.table.ranges[method][t]
            assert out.qparams[t] == Q.activation_qparams(lo, max(hi, 0.0)) or out.plan.clamp.get(t), method
        lo, hi = r.table.ranges[method]["x"]
        r.table.lattices, kept = {}, r.table.lattices
        try:
            assert quantize_graph(r.fused, r.table, BuildOptions(method=method)).qparams["x"] == Q.activation_qparams(lo, hi), method
        finally:
            r.table.lattices = kept


def test_ranges_override(calibrated):
    root, model, data, cfg, r = calibrated
    out = quantize_graph(r.fused, r.table, BuildOptions(ranges={"x": (-2.0, 2.0)}))
    assert out.qparams["x"] == Q.activation_qparams(-2.0, 2.0)


# --- bias correction --------------------------------------------------------------------------------------

def rounding_bias_model():
    """A 3x3 Conv whose weights all sit 0.45 of a step above an integer, so int8 rounding lowers every one:
    with inputs in [0, 1] (mean ~0.5) each output loses about 0.45 * s * 27 * 0.5 on average."""
    rng = np.random.default_rng(11)
    cout = 6
    s = rng.uniform(0.005, 0.02, cout)
    n = rng.integers(-100, 100, (cout, 3, 3, 3)).astype(np.float64)
    w = (n + 0.45) * s[:, None, None, None]
    w[:, 0, 0, 0] = 127 * s  # the channel max sets the scale to exactly s
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    return make_model(nodes, [init("w", w), init("b", rng.normal(0, 0.1, cout))], [("x", ["N", 3, 16, 16])],
                      [("y", ["N", cout, 16, 16])])


def test_bias_correction_reduces_mean_output_error(tmp_path):
    cfg = write_config(tmp_path / "unit.toml", mean=[0.0, 0.0, 0.0], std=[255.0, 255.0, 255.0])
    r = _cal(rounding_bias_model(), tmp_path, cfg=cfg)
    x = _inputs(cfg, tmp_path / "data")
    ref = run(r.fused, {"x": x})[0]
    errs = {}
    for bc in (False, True):
        out = quantize_graph(r.fused, r.table, BuildOptions(bias_correction=bc, target="vnni"))  # (its weights round with a bias)
        d = run(out.model, {"x": x})[0].astype(np.float64) - ref
        errs[bc] = np.abs(d.mean(axis=(0, 2, 3)))  # per-channel mean (systematic) error
    assert errs[False].mean() > 0.02, errs  # the model really has a rounding bias
    assert (errs[True] < 0.5 * errs[False]).all() and errs[True].mean() < 0.2 * errs[False].mean(), errs


# --- ops without a rule, exclusions ----------------------------------------------------------------------

@pytest.mark.parametrize("op", ["Softmax", "Erf"])
def test_op_without_rule_stays_fp32(tmp_path, op):
    from qtool.rules import RULES
    if op in RULES:
        pytest.skip(f"{op} has an int8 rule now")
    r = _cal(small_convnet(middle=op), tmp_path)
    out = quantize_graph(r.fused, r.table)
    d = out.plan.decision("middle")
    assert d.status == "fp32" and "no int8 rule" in d.reason
    assert sum(n.op_type == op for n in out.model.graph.node) == 1  # still there, in float
    assert out.plan.decision("fc").status == "int8"  # and the layers after it are still int8
    x = _inputs(tmp_path / "cfg.toml", tmp_path / "data")
    assert _sqnr(run(r.fused, {"x": x})[0], run(out.model, {"x": x})[0]) > 20


def test_exclude_keeps_node_fp32(calibrated):
    root, model, data, cfg, r = calibrated
    out = quantize_graph(r.fused, r.table, BuildOptions(exclude={"dw_conv": "excluded by the user (--exclude)"}))
    d = out.plan.decision("dw_conv")
    assert d.status == "fp32" and "--exclude" in d.reason
    conv = next(n for n in out.model.graph.node if n.name == "dw_conv")
    w = _inits(out.model)[conv.input[1]]
    assert w.dtype == np.float32 and _producer(out.model, conv.input[1]) is None
    assert any("dw_conv" in n and "--exclude" in n for n in out.notes)
    # its Relu is no longer fused into it: it stays a separate fp32 op
    assert out.plan.decision("dw_relu").status == "fp32"
    assert any(n.op_type == "Relu" for n in out.model.graph.node)


@pytest.mark.parametrize("layer", ["dw_conv", "fc"])
def test_excluded_layer_stays_fp32_in_onnx_runtime(calibrated, layer):
    """dw_conv's input also feeds the int8 residual Add, so it stays quantized; left as a plain
    DQ -> Conv(fp32 weights) -> Q, ONNX Runtime would quantize the excluded layer's weights itself
    (per tensor) and run it in int8. The model must compute the same with that pass on or off.
    fc writes the graph output, not a QuantizeLinear: that pass leaves it alone, and so does qtool."""
    import onnxruntime as ort
    root, model, data, cfg, r = calibrated
    out = quantize_graph(r.fused, r.table, BuildOptions(exclude={layer: "excluded by the user (--exclude)"}))
    x = np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32)
    so = ort.SessionOptions()
    so.log_severity_level = 3

    def run_ort(**kw):
        s = ort.InferenceSession(out.model.SerializeToString(), so, providers=["CPUExecutionProvider"], **kw)
        return s.run(None, {"x": x})[0]

    default, without = run_ort(), run_ort(disabled_optimizers=["WeightBiasQuantization"])
    np.testing.assert_allclose(default, without, rtol=1e-5, atol=1e-6)
    conv = next(n for n in out.model.graph.node if n.name == layer)
    dq = _producer(out.model, conv.input[0])
    assert dq.op_type == "DequantizeLinear" and (_inits(out.model)[dq.input[1]].size > 1) == (layer == "dw_conv")


def _same_with_and_without_weight_bias_quantization(model, feeds):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 3

    def run_ort(**kw):
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"],
                                    **kw).run(None, feeds)[0]

    np.testing.assert_allclose(run_ort(), run_ort(disabled_optimizers=["WeightBiasQuantization"]), rtol=1e-5, atol=1e-6)


def test_weights_false_leaves_every_weight_fp32_in_onnx_runtime(calibrated):
    """The activations-only diagnostic: ORT must not quantize the fp32 weights it finds between DQ and Q."""
    root, model, data, cfg, r = calibrated
    out = quantize_graph(r.fused, r.table, BuildOptions(weights=False))
    _same_with_and_without_weight_bias_quantization(
        out.model, {"x": np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32)})


def test_excluded_layer_on_a_one_channel_input_stays_fp32(tmp_path):
    """A [1] scale counts as a scalar to ORT, so a one-channel input cannot get a per-channel DQ:
    the excluded layer reads the tensor before quantization instead."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "wa", "ba"], ["t"], name="conv_a", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["t", "wb", "bb"], ["u"], name="conv_b"),
             helper.make_node("Conv", ["t", "wc", "bc"], ["v"], name="conv_c"),
             helper.make_node("Add", ["u", "v"], ["s"], name="add"),  # int8, for an int8 reader
             helper.make_node("Conv", ["s", "wd", "bd"], ["y"], name="conv_d")]
    inits = [weight(rng, "wa", 1, 3, 3, 3), weight(rng, "ba", 1), weight(rng, "wb", 4, 1, 1, 1),
             weight(rng, "bb", 4), weight(rng, "wc", 4, 1, 1, 1), weight(rng, "bc", 4),
             weight(rng, "wd", 4, 4, 1, 1), weight(rng, "bd", 4)]
    m = make_model(nodes, inits, [("x", ["N", 3, 8, 8])], [("y", ["N", 4, 8, 8])])
    path = save(m, tmp_path / "one.onnx")
    feeds = [{"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)} for _ in range(3)]
    r = calibrate(path, feeds,
                  CalibrateOptions(method="minmax", threads=1, show_progress=False), workdir=str(tmp_path / "w"))
    out = quantize_graph(r.fused, r.table, BuildOptions(exclude={"conv_b": "excluded by the user"}))
    conv_b = next(n for n in out.model.graph.node if n.name == "conv_b")
    assert conv_b.input[0] == "t"  # the fp32 value, not a DequantizeLinear of it
    _same_with_and_without_weight_bias_quantization(out.model, feeds[0])


def test_quantize_writes_model_report_and_manifest(calibrated, tmp_path):
    root, model, data, cfg, r = calibrated
    wd = tmp_path / "work"
    shutil.copytree(root / "work", wd)
    # the table records absolute paths of the session's workdir; point quantize at the copy explicitly
    res = quantize(str(wd), QuantizeOptions(table=str(wd / "calibration.json"), exclude=["fc"]))
    assert res.path == str(wd / "model.int8.onnx")
    onnx.checker.check_model(onnx.load(res.path))
    rep = json.load(open(wd / "quantize.json"))
    assert rep["excluded"] == {"fc": "excluded by the user (--exclude)"} and rep["method"] == "minmax"
    assert {d["name"]: d["status"] for d in rep["nodes"]}["fc"] == "fp32"
    assert rep["size_bytes"]["int8"] < rep["size_bytes"]["fp32"] * 1.5
    assert json.load(open(wd / "manifest.json"))["quantize"]["int8_path"] == res.path


def test_unknown_exclude_name_is_an_error(calibrated, tmp_path):
    root, model, data, cfg, r = calibrated
    with pytest.raises(QtoolError, match=r"--exclude: no node named 'no_such_node'"):
        quantize(str(tmp_path / "w"), QuantizeOptions(table=r.table_path, exclude=["no_such_node"]))
    assert not (tmp_path / "w" / "model.int8.onnx").exists()


def test_table_from_another_model_is_refused(calibrated, tmp_path):
    root, model, data, cfg, r = calibrated
    other = save(small_convnet(seed=5), tmp_path / "other.onnx")
    with pytest.raises(QtoolError, match=r"calibration\.json.*another model.*net\.onnx.*other\.onnx"):
        quantize(str(tmp_path / "w"), QuantizeOptions(model=other, table=r.table_path, progress=False, sensitivity=SensitivityOptions(enabled=False)))


def test_table_missing_tensor_is_refused(calibrated):
    root, model, data, cfg, r = calibrated
    t = load_table(r.table_path)
    for m in t.ranges:
        t.ranges[m].pop("a2")
    with pytest.raises(QtoolError, match=r"no range for tensor 'a2'.*another graph"):
        quantize_graph(r.fused, t)


def test_changed_fused_graph_is_refused_when_original_is_gone(calibrated, tmp_path):
    root, model, data, cfg, r = calibrated
    wd = tmp_path / "work"
    shutil.copytree(root / "work", wd)
    t = load_table(str(wd / "calibration.json"))
    t.model_path = str(tmp_path / "gone.onnx")
    t.save(str(wd / "calibration.json"))
    (wd / "fused.onnx").write_bytes(b"changed")
    with pytest.raises(QtoolError, match=r"fused\.onnx.*gone\.onnx"):
        quantize(str(wd), QuantizeOptions(table=str(wd / "calibration.json"), progress=False, sensitivity=SensitivityOptions(enabled=False)))


def test_old_opset_is_upgraded_with_a_note(tmp_path):
    m = small_convnet()
    m.opset_import[0].version = 11
    onnx.checker.check_model(m)
    r = _cal(m, tmp_path)
    out = quantize_graph(r.fused, r.table)
    assert out.model.opset_import[0].version >= 13
    assert any("opset upgraded from 11" in n for n in out.notes)
    onnx.checker.check_model(out.model)


def test_plan_marks_constant_add_and_non_float_input_fp32():
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1], name="conv"),
             helper.make_node("Add", ["c", "k"], ["y"], name="add_const")]
    m = make_model(nodes, [init("w", rng.standard_normal((2, 2, 1, 1))), init("k", rng.standard_normal((1, 2, 4, 4)))],
                   [("x", [1, 2, 4, 4])], [("y", [1, 2, 4, 4])])
    p = make_plan(m)
    assert p.decision("conv").status == "int8"
    assert p.decision("add_const").status == "fp32" and "constant" in p.decision("add_const").reason


# --- qparams: the one place that owns scale, zero point and rounding ----------------------------------------

@pytest.mark.parametrize("lo,hi", [(-1.0, 3.0), (0.5, 6.0), (-4.0, -0.25), (-0.001, 1000.0), (0.0, 1.0)])
def test_activation_qparams_represent_zero_exactly(lo, hi):
    p = Q.activation_qparams(lo, hi)
    assert 0 <= p.zero_point <= 255 and p.scale > 0
    assert p.lo <= min(lo, 0.0) + p.scale / 2 and p.hi >= max(hi, 0.0) - p.scale / 2
    assert Q.fake_quantize(np.zeros(3, np.float32), p).tolist() == [0.0, 0.0, 0.0]
    if lo >= 0:
        assert p.zero_point == 0
    if hi <= 0:
        assert p.zero_point == 255


def test_activation_qparams_degenerate_and_non_finite():
    assert Q.activation_qparams(0.0, 0.0) == Q.ActQParams(1.0, 0)
    with pytest.raises(ValueError):
        Q.activation_qparams(-np.inf, 1.0)


def test_quantize_matches_onnxruntime_quantizelinear_including_ties():
    p = Q.activation_qparams(-1.0, 3.0)
    rng = np.random.default_rng(0)
    ties = (np.arange(-20, 20) + 0.5).astype(np.float32) * np.float32(p.scale)
    x = np.concatenate([rng.uniform(-2, 4, 500).astype(np.float32), ties, np.float32([-5, 7, 0])])
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])]
    g = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [x.size])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.UINT8, [x.size])],
                          initializer=[init("s", p.scale), init("z", p.zero_point, np.uint8)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    np.testing.assert_array_equal(Q.quantize(x, p), run(m, {"x": x})[0])


def test_weight_scales_and_bias_quantization():
    w = np.zeros((3, 2, 1, 1), np.float32)
    w[0] = [[[0.5]], [[-1.27]]]
    w[2] = [[[2.54]], [[0.01]]]
    s = Q.weight_scales(w, 0)
    np.testing.assert_allclose(s, [0.01, 1.0, 0.02], rtol=1e-6)  # an all-zero channel gets scale 1
    q = Q.quantize_weight(w, s, 0)
    assert q.dtype == np.int8 and q[0].ravel().tolist() == [50, -127] and q[2].ravel().tolist() == [127, 0]
    bq, bs = Q.quantize_bias(np.array([1.0, -1e12, 1e12]), 0.5, s)
    assert bq.dtype == np.int32 and bq.tolist() == [200, -(2 ** 31), 2 ** 31 - 1]
    np.testing.assert_allclose(bs, 0.5 * s)


def test_gemm_untransposed_matmul_and_shared_weights(tmp_path):
    """Gemm with transB=0 and MatMul quantize W per output feature along axis 1; two Convs sharing one
    weight initializer each get a quantized copy."""
    rng = np.random.default_rng(12)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="c1"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2", "b2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="c2"),
             helper.make_node("Conv", ["c2", "w2", "b2"], ["c3"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="c3"),
             helper.make_node("GlobalAveragePool", ["c3"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "fw", "fb"], ["h"], name="gemm"),
             helper.make_node("MatMul", ["h", "mw"], ["y"], name="matmul")]
    inits = [weight(rng, "w", 4, 3, 3, 3), weight(rng, "b", 4), weight(rng, "w2", 4, 4, 3, 3, scale=0.3),
             weight(rng, "b2", 4), weight(rng, "fw", 4, 6), weight(rng, "fb", 6), weight(rng, "mw", 6, 5)]
    m = make_model(nodes, inits, [("x", ["N", 3, 16, 16])], [("y", ["N", 5])])
    r = _cal(m, tmp_path)
    out = quantize_graph(r.fused, r.table)
    assert {d.name: d.status for d in out.plan.decisions if d.name in ("gemm", "matmul", "c2", "c3")} == \
        dict.fromkeys(("c2", "c3", "gemm", "matmul"), "int8")
    mm = {n.name: n for n in out.model.graph.node}
    for name, axis in (("gemm", 1), ("matmul", 1), ("c2", 0), ("c3", 0)):
        dq = _producer(out.model, mm[name].input[1])
        assert dq.op_type == "DequantizeLinear" and next(a.i for a in dq.attribute if a.name == "axis") == axis
    assert mm["c2"].input[1] != mm["c3"].input[1]
    x = _inputs(tmp_path / "cfg.toml", tmp_path / "data")
    assert _sqnr(run(m, {"x": x})[0], run(out.model, {"x": x})[0]) > 20


def test_dead_channel_bias_fits_int32_and_onnxruntime_agrees(tmp_path):
    """A channel with weights ~1e-7 and a real bias: a max-scaled weight scale of ~1e-9 would put
    bias / (s_in * s_w) far past int32 (saturated by qtool, wrapped around by ONNX Runtime)."""
    import onnx
    from onnx import numpy_helper

    from helpers import init, make_model, run, save, write_config, write_images
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions
    from qtool.quantize.run import quantize

    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3
    w[2] = rng.standard_normal((3, 3, 3)) * 1e-7  # dead channel
    b = np.array([0.1, -0.2, 0.75, 0.05], np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    m = make_model(nodes, [init("w", w), init("b", b)], [("x", ["N", 3, 16, 16])], [("y", None)])
    model = save(m, tmp_path / "dead.onnx")
    write_images(str(tmp_path / "img"), 8, seed=1)
    wd = str(tmp_path / "work")
    calibrate(model, str(tmp_path / "img"),
              CalibrateOptions(config=write_config(str(tmp_path / "c.toml"), size=16), method="minmax", show_progress=False),
              workdir=wd)
    r = quantize(wd, say=lambda s: None)
    q = onnx.load(r.path)
    bias = next(numpy_helper.to_array(t) for t in q.graph.initializer if t.data_type == onnx.TensorProto.INT32)
    assert np.abs(bias.astype(np.int64)).max() < 2 ** 31 - 1
    x = np.random.default_rng(2).uniform(-1, 1, (2, 3, 16, 16)).astype(np.float32)
    ref, got = run(m, {"x": x})[0], run(q, {"x": x})[0]
    # the dead channel is just its bias, in int8 as in fp32
    np.testing.assert_allclose(got[:, 2], ref[:, 2], atol=0.02)


def test_method_auto_picks_the_best_measured_method(calibrated, tmp_path):
    """--method auto scores every range method on calibration samples and keeps the best."""
    from qtool.calibrate.methods import METHODS
    from qtool.quantize.run import quantize

    root = calibrated[0]
    work = tmp_path / "work"
    shutil.copytree(root / "work", work)  # the shared fixture's folder stays as it is
    r = quantize(str(work), QuantizeOptions(method="auto", progress=False, sensitivity=SensitivityOptions(enabled=False)), say=lambda s: None)
    scores = r.report["method_scores_db"]
    assert set(scores) == set(METHODS)
    best = max(scores, key=scores.get)  # (a clipping method must beat minmax by CLIP_GAIN_DB)
    assert r.report["method"] == (best if scores[best] >= scores["minmax"] + 0.5 else "minmax")


def test_exclusion_drops_the_quantizer_only_the_excluded_layer_read(calibrated):
    """pw_conv excluded: dw's output (its Relu fused into the clamp) was quantized only for pw_conv, so it
    is no longer quantized and the Relu runs again as an fp32 op; dw_conv itself stays int8."""
    root, model, data, cfg, r = calibrated
    x = _inputs(cfg, data)
    ex = {"pw_conv": "excluded by the user (--exclude)"}
    pruned = quantize_graph(r.fused, r.table, BuildOptions(exclude=ex))
    kept = quantize_graph(r.fused, r.table, BuildOptions(exclude=ex, prune_excluded=False))
    dw_out = next(n.output[0] for n in r.fused.graph.node if n.name == "dw_relu")
    assert dw_out in kept.plan.tensors and dw_out not in pruned.plan.tensors
    assert kept.plan.decision("dw_relu").status == "fused"
    assert pruned.plan.decision("dw_relu").status == "fp32" and pruned.plan.decision("dw_conv").status == "int8"
    relu = next(n for n in pruned.model.graph.node if n.name == "dw_relu")
    assert _producer(pruned.model, relu.input[0]).name == "dw_conv"  # fp32 conv output, no DQ in between
    assert _producer(pruned.model, relu.output[0]) is relu
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == dw_out for n in pruned.model.graph.node)
    # stem output still feeds the int8 residual Add: its quantizer stays
    stem_out = next(n.output[0] for n in r.fused.graph.node if n.name == "stem_relu")
    assert stem_out in pruned.plan.tensors
    ref = run(r.fused, {"x": x})[0]
    assert _sqnr(ref, run(pruned.model, {"x": x})[0]) > 20
    # the first conv excluded: nothing int8 reads the graph input, so it is not quantized
    first = quantize_graph(r.fused, r.table, BuildOptions(exclude={"stem_conv": "x"}))
    assert "x" not in first.plan.tensors


# --- targets: how the weights are encoded for the CPUs that run the model --------------------------------

def _weight_tensors(m):
    """(node, int weights as stored, zero points, scales, axis) of every Conv/Gemm/MatMul."""
    inits = _inits(m)
    for node in m.graph.node:
        if node.op_type in ("Conv", "Gemm", "MatMul"):
            dq = _producer(m, node.input[1])
            axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
            yield node, inits[dq.input[0]], inits[dq.input[2]], inits[dq.input[1]], axis


def test_targets_encode_the_same_layers_three_ways(calibrated):
    """portable: int8 weights with no same-sign pair (in ONNX Runtime's K order) past 128, so ORT's
    saturating int16 pairs are exact; vnni: plain int8; u8-weights: vnni's values stored as uint8 + 128.
    The model records its target; the runtime gives the same output under both arithmetics wherever
    the target promises it."""
    from qtool.arithmetic import ARITHMETICS, conv_rows, saturating_pairs
    from qtool.runtime import NativeSession
    root, model, data, cfg, r = calibrated
    outs = {t: quantize_graph(r.fused, r.table, BuildOptions(target=t)) for t in ("portable", "vnni", "u8-weights")}
    for t, out in outs.items():
        assert {p.key: p.value for p in out.model.metadata_props}["qtool.target"] == t
    n_paired = 0
    for node, wq, wz, ws, axis in _weight_tensors(outs["portable"].model):
        assert wq.dtype == np.int8 and not wz.any()
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        if node.op_type == "Conv" and group > 1 and wq.shape[1] == 1:
            assert outs["portable"].layers[node.name].encoding == "s8"  # depthwise: exact anyway
            continue
        rows = conv_rows(wq) if node.op_type == "Conv" else (wq if axis == 0 else wq.T)
        assert len(saturating_pairs(rows)[0]) == 0, node.name
        assert outs["portable"].layers[node.name].encoding == "pair-safe"
        n_paired += 1
    assert n_paired >= 3
    vnni = {n.name: (wq, ws) for n, wq, _, ws, _ in _weight_tensors(outs["vnni"].model)}
    assert any(len(saturating_pairs(conv_rows(w) if w.ndim == 4 else w)[0]) for w, _ in vnni.values())
    for node, wq, wz, ws, _ in _weight_tensors(outs["u8-weights"].model):
        w8, s8 = vnni[node.name]
        if wq.dtype == np.uint8:
            assert (wz == 128).all()
            np.testing.assert_array_equal(wq.astype(np.int16) - 128, w8)
        else:
            np.testing.assert_array_equal(wq, w8)
        np.testing.assert_array_equal(ws, s8)
    x = np.random.default_rng(0).standard_normal((3, 3, 16, 16)).astype(np.float32) * 30
    res = {}
    for t, out in outs.items():
        res[t] = [NativeSession(out.model, threads=1, arithmetic=a).run(None, {"x": x})[0] for a in ARITHMETICS]
    np.testing.assert_array_equal(*res["portable"])
    np.testing.assert_array_equal(*res["u8-weights"])
    np.testing.assert_array_equal(res["u8-weights"][0], res["vnni"][0])  # same values, exact sums


def test_pair_safe_rounding_stays_close_and_bounded():
    """Pair-safe weights: every pair within the limit, every weight in [-127, 127], each channel's
    error no worse than the plain int8 error of the same channel at the same scale plus the trim,
    and a channel that needs nothing keeps the plain scale."""
    from qtool.arithmetic import PAIR_LIMIT, pair_sums
    from qtool.arithmetic import can_saturate
    from qtool.quantize.encoding import pair_partners, pair_safe_scales, project
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 5, 3, 3)).astype(np.float32)
    w[0] = 0.01 * np.sign(w[0])  # a flat channel: every same-sign pair would sum to 254 at max/127
    w[1, :, :, :] *= 0.1
    w[1, 0, 0, 0], w[1, 1, 0, 0] = 3.0, -0.05  # one big weight, its partner of the other sign: nothing to do
    partners = pair_partners(w.shape, "Conv", 0)
    rows = w.reshape(6, -1)
    q, s = pair_safe_scales(rows, partners)
    assert np.abs(q).max() <= 127 and not can_saturate(q, np.where(partners >= 0, q[:, np.maximum(partners, 0)], 0)).any()
    ort_rows = q.reshape(w.shape).transpose(0, 2, 3, 1).reshape(6, -1)  # ONNX Runtime's K order
    assert pair_sums(ort_rows).max() <= PAIR_LIMIT
    s_plain = Q.weight_scales(w, 0)
    assert s[1] == s_plain[1] and s[0] > 1.9 * s_plain[0]
    err = ((q * s[:, None] - rows) ** 2).sum(1)
    plain = ((Q.quantize_weight(rows, s_plain, 0) * s_plain[:, None] - rows) ** 2).sum(1)
    assert err[1] == pytest.approx(plain[1])
    v = np.array([[100.2, 90.7, -3.0, 127.0]])
    np.testing.assert_array_equal(project(v, np.rint(v), np.array([1, 0, 3, 2])), [[69, 59, -3, 127]])


@pytest.mark.parametrize("shape,group", [((4, 6, 3, 3), 1), ((4, 3, 3, 3), 1), ((4, 5, 3), 1), ((4, 3, 2, 2, 2), 1),
                                         ((6, 2, 3, 3), 3), ((8, 5, 1, 1), 1)])
def test_pair_partners_follow_onnx_runtimes_k_order(shape, group):
    """Partners (in the rows qtool rounds) are neighbours in ORT's K order for any conv rank, odd
    channel counts (pairs crossing taps) and groups: checked against conv_rows on a weight whose
    values are their own row positions."""
    from qtool.arithmetic import conv_rows
    from qtool.quantize.encoding import pair_partners
    k = int(np.prod(shape[1:]))
    partners = pair_partners(shape, "Conv", 0, group)
    order = conv_rows(np.arange(k).reshape((1,) + shape[1:]))[0]  # row position at each K position
    for pos in range(k):
        mate = pos ^ 1
        assert partners[order[pos]] == (order[mate] if mate < k else -1)
    assert pair_partners((5, 1, 3), "Conv", 0, 5) is None  # depthwise 1-D: exact on ORT, no pairs


def test_the_default_method_is_chosen_by_measurement_and_an_explicit_one_is_kept(calibrated, tmp_path):
    """calibrate's default method is auto: quantize measures every method and keeps the best; a method
    named at calibrate (or at quantize) is used as it is, with no measurement."""
    from qtool.calibrate.methods import METHODS
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions
    from qtool.quantize.run import quantize

    root, model, data, cfg, _ = calibrated
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = calibrate(model, data,
                      CalibrateOptions(config=cfg, threads=1, show_progress=False), workdir=str(tmp_path / "auto"))
        assert r.table.method == "auto" and r.table.range_method == "minmax"
        q = quantize(str(tmp_path / "auto"), say=lambda s: None)
        scores = q.report["method_scores_db"]
        assert set(scores) == set(METHODS) and q.report["method"] == max(scores, key=scores.get)
        calibrate(model, data,
                  CalibrateOptions(config=cfg, method="percentile", threads=1, show_progress=False),
                  workdir=str(tmp_path / "named"))
        q = quantize(str(tmp_path / "named"), say=lambda s: None)
    assert q.report["method"] == "percentile" and q.report["method_scores_db"] is None


def test_data_movement_that_leads_only_to_fp32_ops_carries_no_int8():
    """wespeaker's fbank front end: the waveform was quantized for a Reshape whose readers all run fp32
    (there Abs and Log; here Abs and Sin, since a Log's input chain is rules/log_domain.py's to keep fp32),
    so the model only rounded its input (14.9 dB, nothing int8). A chain that reaches an int8 layer keeps
    its quantizer."""
    nodes = [helper.make_node("Reshape", ["x", "shp"], ["framed"], name="Reshape_0"),
             helper.make_node("Abs", ["framed"], ["mag"], name="Abs_1"),
             helper.make_node("Sin", ["mag"], ["y"], name="Sin_2"),
             helper.make_node("Reshape", ["x", "shp"], ["framed2"], name="Reshape_3"),
             helper.make_node("MatMul", ["framed2", "w"], ["z"], name="MatMul_4")]
    inits = [init("shp", [4, 4], np.int64), init("w", np.random.default_rng(0).standard_normal((4, 3)))]
    m = make_model(nodes, inits, [("x", [16])], [("y", [4, 4]), ("z", [4, 3])])
    p = make_plan(m)
    d = {x.name: x for x in p.decisions}
    assert d["Reshape_0"].status == "fp32" and "fp32 ops only" in d["Reshape_0"].reason
    assert d["Reshape_3"].status == "passthrough" and d["MatMul_4"].status == "int8"
    assert "x" in p.tensors and "framed" not in p.tensors  # x: for the MatMul's chain only
    m2 = make_model(nodes[:3], inits[:1], [("x", [16])], [("y", [4, 4])])
    assert make_plan(m2).tensors == [] and make_plan(m2, prune_excluded=False).tensors == []


def test_an_int8_matmul_whose_output_only_moves_to_fp32_ops_writes_float():
    """An attention's key projection, its bias folded away: MatMul -> Reshape -> Transpose -> a MatMul of two
    activations, fp32. Its output was quantized and the Reshape and Transpose passed int8 on (three pairs
    that only rounded, and a node each in ONNX Runtime); the MatMul now reads int8 and writes float, and
    a second MatMul reading the same output keeps it int8 where an int8 layer reads it."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "wk"], ["k"], name="key"),
             helper.make_node("Reshape", ["k", "shp"], ["kr"], name="split"),
             helper.make_node("Transpose", ["kr"], ["kt"], name="to_heads", perm=[1, 0]),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores")]
    inits = [init("wk", rng.standard_normal((8, 8))), init("shp", [4, 8], np.int64)]
    m = make_model(nodes, inits, [("x", [4, 8]), ("q", [4, 8])], [("s", [4, 4])])
    p = make_plan(m)
    d = {x.name: x for x in p.decisions}
    assert d["key"].status == "int8" and "left fp32" in d["key"].reason
    assert d["split"].status == "fp32" and d["to_heads"].status == "fp32"
    assert "k" not in p.tensors and "kr" not in p.tensors and "x" in p.tensors
    # the same chain feeding an int8 layer keeps its pairs
    nodes2 = nodes[:3] + [helper.make_node("MatMul", ["kt", "wo"], ["s"], name="dense")]
    m2 = make_model(nodes2, inits + [init("wo", rng.standard_normal((4, 4)))], [("x", [4, 8])], [("s", [8, 4])])
    d2 = {x.name: x for x in make_plan(m2).decisions}
    assert d2["split"].status == "passthrough" and d2["to_heads"].status == "passthrough"


def test_balancing_trials_are_said_as_trials(monkeypatch):
    """balance_and_choose balances under two methods and chooses again on each: what those trials print is
    marked as a trial, and the choice is said once (hx8 read a trial's "balanced ... 13.5 -> 20.5 dB" and
    "method auto: minmax" as what the model got, while the unbalanced mse model was kept)."""
    from dataclasses import dataclass
    from types import SimpleNamespace
    from qtool.quantize.method_choice import Measure
    from qtool.quantize.steps import equalization as qrun

    @dataclass
    class Ctx:
        fused: object
        table: object
        weight_cache: object
        method: str

    def balance(v, tune, say):
        v.fused = object()
        say("balanced the channels of 4 of 4 candidate tensors: output SQNR 13.5 -> 20.5 dB")

    def pick(v, auto, say, show_progress):
        say("method auto: minmax (minmax 19.8 dB)")
        return "minmax", {"minmax": Measure(19.8), "mse": Measure(7.8)}

    monkeypatch.setattr(qrun, "balance", balance)
    monkeypatch.setattr(qrun, "pick_method", pick)
    ctx = Ctx(object(), SimpleNamespace(range_method="minmax"), None, "mse")
    fused, said = ctx.fused, []
    qrun.balance_and_choose(ctx, None, None, {"mse": Measure(20.9), "minmax": Measure(13.5)}, said.append, False)
    assert ctx.fused is fused and ctx.method == "mse"  # the unbalanced mse model stays
    trials = [s for s in said if "balanced the channels" in s or s.startswith("method auto: minmax")
              or "method auto: minmax" in s]
    assert trials and all(s.startswith("  trial, balanced under ") for s in trials)
    assert said[-1] == "method auto: mse, channels not balanced (no balanced trial measured better)"


def test_a_model_the_guard_keeps_all_fp32_says_so(calibrated, tmp_path, monkeypatch):
    """The guard (or --exclude-sensitive) may keep every candidate fp32 (onnx-asr's wespeaker front end: its one int8
    layer alone left the output at 1.9 dB): the model written is fp32, and quantize said nothing of it."""
    import qtool.quantize.steps.guard as run_mod
    from qtool.quantize.sensitivity import quantizable_layers

    root = calibrated[0]
    work = tmp_path / "work"
    shutil.copytree(root / "work", work)
    monkeypatch.setattr(run_mod, "guard_layers", lambda ctx, ranking, samples, say: {
        d.name: "kept fp32 (test)" for d in quantizable_layers(ctx.fused)})
    said = []
    r = quantize(str(work), QuantizeOptions(progress=False, sensitivity=SensitivityOptions()), say=said.append)
    assert not r.output.plan.int8_nodes
    assert any(s.startswith("note: every op that could run in int8 is kept fp32") for s in said), said
