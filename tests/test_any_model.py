"""Any model, any input: tensor calibration data (.npy, .npz, Python iterables), several and
non-float inputs, dynamic shapes, old opsets, unknown ops, and one clear error per bad input."""
from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from helpers import calibrate_options, init, make_model, run, save, small_convnet, weight, write_images
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions
from qtool.errors import QtoolError
from qtool.quantize.run import quantize


def _sqnr(ref, out):
    ref, out = ref.astype(np.float64), out.astype(np.float64)
    return 10 * np.log10((ref ** 2).sum() / max(((ref - out) ** 2).sum(), 1e-30))


def _cal_q(model_path, data, work, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = calibrate(model_path, data, calibrate_options(method="minmax", show_progress=False, threads=1, **kw), str(work))
        q = quantize(str(work))
    onnx.checker.check_model(q.path)
    return r, q


def _two_input_model(seed=0):
    """a, b [N,3,8,8] -> Conv each -> Add -> Relu -> out [N,4,8,8]."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Conv", ["a", "wa", "ba"], ["ca"], name="conv_a", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Conv", ["b", "wb", "bb"], ["cb"], name="conv_b", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Add", ["ca", "cb"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["out"], name="relu")]
    inits = [weight(rng, "wa", 4, 3, 3, 3, scale=0.3), weight(rng, "ba", 4, scale=0.1),
             weight(rng, "wb", 4, 3, 3, 3, scale=0.3), weight(rng, "bb", 4, scale=0.1)]
    return make_model(nodes, inits, [("a", ["N", 3, 8, 8]), ("b", ["N", 3, 8, 8])], [("out", ["N", 4, 8, 8])])


def _int_input_model(seed=0):
    """x float [N,3,8,8] and ids int64 [N]: Conv(x) + Cast(ids) broadcast over [N,1,1,1]."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Cast", ["ids"], ["idf"], name="cast", to=TensorProto.FLOAT),
             helper.make_node("Reshape", ["idf", "shape4"], ["id4"], name="reshape_ids"),
             helper.make_node("Add", ["c", "id4"], ["s"], name="add"),
             helper.make_node("Conv", ["s", "w2"], ["out"], name="conv2", kernel_shape=[1, 1])]
    inits = [weight(rng, "w", 4, 3, 3, 3, scale=0.3), weight(rng, "b", 4, scale=0.1),
             weight(rng, "w2", 2, 4, 1, 1, scale=0.5), init("shape4", [-1, 1, 1, 1], np.int64)]
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8]),
                                       helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 2, 8, 8])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _dynamic_model(seed=0, opset=13):
    """x [N,3,H,W] -> Conv -> Relu -> Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> y [N,5]."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", kernel_shape=[3, 3], pads=[1] * 4,
                              strides=[2, 2]),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1)]
    inits = [weight(rng, "w1", 8, 3, 3, 3, scale=0.3), weight(rng, "b1", 8, scale=0.1),
             weight(rng, "w2", 8, 8, 3, 3, scale=0.15), weight(rng, "b2", 8, scale=0.1),
             weight(rng, "fw", 5, 8, scale=0.5), weight(rng, "fb", 5, scale=0.1)]
    return make_model(nodes, inits, [("x", ["N", 3, "H", "W"])], [("y", ["N", 5])], opset=opset)


def _samples(rng, n, shapes):
    return [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(n)]


# -- tensor data --------------------------------------------------------------------------------------

def test_two_input_model_from_npz(tmp_path):
    rng = np.random.default_rng(1)
    data = tmp_path / "npz"
    data.mkdir()
    samples = _samples(rng, 6, {"a": (1, 3, 8, 8), "b": (3, 8, 8)})  # with and without the batch axis
    for k, s in enumerate(samples):
        np.savez(data / f"s{k}.npz", **s)
    model = save(_two_input_model(), tmp_path / "two.onnx")
    r, q = _cal_q(model, str(data), tmp_path / "work")
    assert r.table.n_samples == 6
    assert {"a", "b"} <= set(r.table.histograms)  # both float inputs calibrated
    s = q.report["summary"]
    assert s.get("int8", 0) >= 2  # both convs (the Add writes the fp32 output: no int8 work to do there)
    feeds = {"a": samples[0]["a"], "b": samples[0]["b"][None]}
    assert _sqnr(run(onnx.load(model), feeds)[0], run(onnx.load(q.path), feeds)[0]) > 25


def test_int64_input_passes_through(tmp_path):
    rng = np.random.default_rng(2)
    data = [{"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32), "ids": rng.integers(0, 4, 2)}
            for _ in range(4)]
    model = save(_int_input_model(), tmp_path / "ids.onnx")
    r, q = _cal_q(model, data, tmp_path / "work")  # a Python iterable of input dicts
    m = onnx.load(q.path)
    ids = next(i for i in m.graph.input if i.name == "ids")
    assert ids.type.tensor_type.elem_type == TensorProto.INT64
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == "ids" for n in m.graph.node)
    assert "ids" not in r.table.histograms and "x" in r.table.histograms
    cast = next(n for n in m.graph.node if n.op_type == "Cast")
    assert cast.input[0] == "ids"  # read untouched
    feeds = data[0]
    assert _sqnr(run(onnx.load(model), feeds)[0], run(m, feeds)[0]) > 20


def test_dynamic_batch_and_spatial_stay_dynamic(tmp_path):
    rng = np.random.default_rng(3)
    data = tmp_path / "npy"
    data.mkdir()
    for k, hw in enumerate([(16, 16), (12, 20), (16, 16), (24, 8)]):
        np.save(data / f"t{k}.npy", rng.standard_normal((3,) + hw).astype(np.float32))
    model = save(_dynamic_model(), tmp_path / "dyn.onnx")
    r, q = _cal_q(model, str(data), tmp_path / "work")
    assert r.table.n_samples == 4
    assert q.report["rounding"] == "output-aware"  # the experiments take the samples of every size
    m = onnx.load(q.path)
    dims = m.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["N", "", "H", "W"] and dims[1].dim_value == 3
    assert onnx.load(r.fused_path).graph.input[0].type.tensor_type.shape.dim[2].dim_param == "H"
    x = rng.standard_normal((3, 3, 10, 14)).astype(np.float32)  # a size never seen in calibration
    assert _sqnr(run(onnx.load(model), {"x": x})[0], run(m, {"x": x})[0]) > 20


def test_opset_11_is_upgraded_and_reported(tmp_path):
    rng = np.random.default_rng(4)
    model = save(_dynamic_model(opset=11), tmp_path / "old.onnx")
    r, q = _cal_q(model, _samples(rng, 3, {"x": (1, 3, 12, 12)}), tmp_path / "work")
    m = onnx.load(q.path)
    assert max(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) == 13
    assert any("opset upgraded from 11 to 13" in n for n in q.report["notes"])
    x = rng.standard_normal((1, 3, 12, 12)).astype(np.float32)
    assert _sqnr(run(onnx.load(model), {"x": x})[0], run(m, {"x": x})[0]) > 20


def test_opset_kept_when_new_enough(tmp_path):
    rng = np.random.default_rng(5)
    model = save(_dynamic_model(opset=17), tmp_path / "new.onnx")
    r, q = _cal_q(model, _samples(rng, 2, {"x": (1, 3, 12, 12)}), tmp_path / "work")
    assert max(o.version for o in onnx.load(q.path).opset_import if o.domain in ("", "ai.onnx")) == 17
    assert not any("opset" in n for n in q.report["notes"])


def test_quantizable_and_unknown_ops_mixed(tmp_path):
    """Erf has no rule: it stays fp32, named with the reason, and the rest is int8."""
    rng = np.random.default_rng(6)
    model = save(small_convnet(middle="Erf"), tmp_path / "mixed.onnx")
    r, q = _cal_q(model, _samples(rng, 4, {"x": (2, 3, 16, 16)}), tmp_path / "work")
    nodes = {d["name"]: d for d in q.report["nodes"]}
    assert nodes["middle"]["status"] == "fp32" and nodes["middle"]["reason"] == "no int8 rule for this op"
    assert sum(d["status"] == "int8" for d in q.report["nodes"]) >= 4
    m = onnx.load(q.path)
    assert nodes["res_relu"]["status"] == "fp32" and "producer is not int8" in nodes["res_relu"]["reason"]
    erf = next(n for n in m.graph.node if n.op_type == "Erf")
    assert erf.output[0] == "mid"  # Erf runs in fp32 on the dequantized residual sum
    x = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)
    assert _sqnr(run(onnx.load(model), {"x": x})[0], run(m, {"x": x})[0]) > 15


# -- bad input: one clear error naming the file, nothing written ---------------------------------------

def _expect_error(tmp_path, model, data, *needles):
    work = tmp_path / "work_bad"
    with pytest.raises(QtoolError) as e:
        calibrate(model, data, CalibrateOptions(threads=1, show_progress=False), workdir=str(work))
    msg = str(e.value)
    for n in needles:
        assert n in msg, msg
    assert "\n" not in msg
    assert not work.exists()
    return msg


def test_npy_wrong_shape(tmp_path):
    model = save(small_convnet(size=16), tmp_path / "net.onnx")
    data = tmp_path / "npy"
    data.mkdir()
    np.save(data / "a.npy", np.zeros((1, 3, 16, 16), np.float32))
    np.save(data / "b.npy", np.zeros((1, 3, 15, 16), np.float32))
    _expect_error(tmp_path, model, str(data), "b.npy", "[1, 3, 15, 16]", "float32[?, 3, 16, 16]")


def test_npy_wrong_dtype(tmp_path):
    model = save(small_convnet(size=16), tmp_path / "net.onnx")
    data = tmp_path / "npy"
    data.mkdir()
    np.save(data / "a.npy", np.zeros((3, 16, 16), np.float64))
    _expect_error(tmp_path, model, str(data), "a.npy", "float64", "float32")


def test_npz_missing_input(tmp_path):
    model = save(_two_input_model(), tmp_path / "two.onnx")
    data = tmp_path / "npz"
    data.mkdir()
    np.savez(data / "ok.npz", a=np.zeros((1, 3, 8, 8), np.float32), b=np.zeros((1, 3, 8, 8), np.float32))
    np.savez(data / "only_a.npz", a=np.zeros((1, 3, 8, 8), np.float32))
    _expect_error(tmp_path, model, str(data), "only_a.npz", "'b'")


def test_npy_for_two_inputs(tmp_path):
    model = save(_two_input_model(), tmp_path / "two.onnx")
    data = tmp_path / "npy"
    data.mkdir()
    np.save(data / "a.npy", np.zeros((1, 3, 8, 8), np.float32))
    _expect_error(tmp_path, model, str(data), ".npz", "2 inputs")


def test_corrupt_npy_and_npz(tmp_path):
    model = save(small_convnet(size=16), tmp_path / "net.onnx")
    for ext in ("npy", "npz"):
        data = tmp_path / ext
        data.mkdir()
        (data / f"bad.{ext}").write_bytes(b"not an array at all")
        _expect_error(tmp_path, model, str(data), f"bad.{ext}", f"not a readable .{ext} file")


def test_pickled_npy_is_refused(tmp_path):
    model = save(small_convnet(size=16), tmp_path / "net.onnx")
    data = tmp_path / "npy"
    data.mkdir()
    np.save(data / "obj.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    _expect_error(tmp_path, model, str(data), "obj.npy", "object")


def test_images_and_tensors_mixed(tmp_path):
    model = save(small_convnet(size=16), tmp_path / "net.onnx")
    data = tmp_path / "mixed"
    write_images(data, 2)
    np.save(data / "t.npy", np.zeros((3, 16, 16), np.float32))
    _expect_error(tmp_path, model, str(data), str(data), "t.npy", "mixes")


def test_iterable_bad_sample(tmp_path):
    model = save(small_convnet(size=16), tmp_path / "net.onnx")
    good = {"x": np.zeros((1, 3, 16, 16), np.float32)}
    _expect_error(tmp_path, model, [good, {"x": np.zeros((1, 3, 16, 16), np.int32)}], "sample 1", "int32")
    _expect_error(tmp_path, model, [good, {"y": good["x"]}], "sample 1", "'x'")


def test_config_with_tensors_is_refused(tmp_path):
    from qtool.errors import UsageError
    model = save(small_convnet(size=16), tmp_path / "net.onnx")
    with pytest.raises(UsageError, match="tensors"):
        calibrate(model, [{"x": np.zeros((1, 3, 16, 16), np.float32)}],
                  CalibrateOptions(config="ppocr-cls", show_progress=False), workdir=str(tmp_path / "w"))


def test_image_folder_still_works(calibrated):
    root, model, data, cfg, r = calibrated
    assert r.table.n_samples == 6 and r.table.input_name == "x"
    assert os.path.exists(r.table_path)


# -- eval without labels -----------------------------------------------------------------------------

def _detector_model(seed=0):
    """x [1,3,8,8] -> Conv(6 channels) -> Reshape [1,6,64] -> Transpose -> rows [1,64,6]; Sigmoid on scores."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Split", ["c", "parts"], ["box", "score"], name="split", axis=1),
             helper.make_node("Sigmoid", ["score"], ["p"], name="sig"),
             helper.make_node("Concat", ["box", "p"], ["cat"], name="cat", axis=1),
             helper.make_node("Reshape", ["cat", "shape"], ["r"], name="reshape"),
             helper.make_node("Transpose", ["r"], ["rows"], name="transpose", perm=[0, 2, 1])]
    inits = [weight(rng, "w", 6, 3, 3, 3, scale=0.5), weight(rng, "b", 6, scale=0.1),
             init("parts", [4, 2], np.int64), init("shape", [1, 6, 64], np.int64)]
    return make_model(nodes, inits, [("x", [1, 3, 8, 8])], [("rows", [1, 64, 6])])


def test_eval_without_labels_per_output_and_detector_rows(tmp_path):
    from qtool.evaluate import EvalOptions, evaluate_tensors
    rng = np.random.default_rng(7)
    model = save(_detector_model(), tmp_path / "det.onnx")
    r, q = _cal_q(model, _samples(rng, 6, {"x": (1, 3, 8, 8)}), tmp_path / "work")
    ev = tmp_path / "ev"
    ev.mkdir()
    for k in range(4):
        np.save(ev / f"{k}.npy", rng.standard_normal((1, 3, 8, 8)).astype(np.float32))
    res = evaluate_tensors(model, q.path, str(ev), EvalOptions(threads=1, latency=False))
    o = res["outputs"]["rows"]
    assert res["n_samples"] == 4 and o["shape"] == [1, 64, 6]
    assert o["sqnr_db"] > 20 and 0 < o["max_abs_error"] < 1
    agree = o["top_rows_agreement"]
    assert set(agree) == {"top1", "top10", "top64"} and agree["top64"] == 1.0 and agree["top10"] >= 0.7


def test_eval_command_on_npy_folder(tmp_path, monkeypatch):
    from qtool.cli import main
    rng = np.random.default_rng(8)
    model = save(_dynamic_model(), tmp_path / "dyn.onnx")
    cal, ev = tmp_path / "cal", tmp_path / "ev"
    for d, n in ((cal, 4), (ev, 3)):
        d.mkdir()
        for k in range(n):
            np.save(d / f"{k}.npy", rng.standard_normal((3, 12, 12)).astype(np.float32))
    monkeypatch.chdir(tmp_path)
    for argv in (["calibrate", "-m", model, "-d", str(cal), "-q"], ["quantize", "-q"],  # sensitivity re-reads .npy
                 ["eval", "--data", str(ev), "--json", "e.json", "-q"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0, argv
    import json
    res = json.load(open(tmp_path / "e.json"))
    assert res["n_samples"] == 3 and res["outputs"]["y"]["sqnr_db"] > 15 and "top1_agreement" in res["outputs"]["y"]


# -- inspect ----------------------------------------------------------------------------------------

def test_inspect_reports_plan_opset_inputs_params_macs(tmp_path):
    from qtool.inspect import inspect_model, render
    model = save(_int_input_model(), tmp_path / "ids.onnx")
    r = inspect_model(model, ["x=2,3,8,8", "ids=2"])
    assert r.opset == 13 and "kept" in r.opset_note
    roles = {i["name"]: i["role"] for i in r.inputs}
    assert roles["x"].startswith("float32: calibrated") and roles["ids"] == "int64: passed through untouched"
    assert r.params == 4 * 3 * 9 + 4 + 2 * 4
    assert r.macs == 2 * 4 * 8 * 8 * 27 + 2 * 2 * 8 * 8 * 4  # conv 3x3 (27 products per output) + 1x1 conv
    status = {n["name"]: n["status"] for n in r.nodes}
    assert status["conv"] == "int8" and status["cast"] == "fp32"
    text = render(r)
    assert "GMAC" in text and "int64" in text


def test_inspect_dynamic_shape_and_old_opset(tmp_path):
    from qtool.inspect import inspect_model, render
    model = save(_dynamic_model(opset=11), tmp_path / "old.onnx")
    r = inspect_model(model)
    assert r.macs is None and "upgraded to 13" in r.opset_note
    assert "pass --shape" in render(r)
    assert inspect_model(model, ["1,3,16,16"]).macs > 0


def test_inspect_cli(tmp_path, capsys):
    from qtool.cli import main
    model = save(small_convnet(middle="Erf"), tmp_path / "m.onnx")
    with pytest.raises(SystemExit) as e:
        main(["inspect", model, "--json", str(tmp_path / "i.json")])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Erf" in out and "no int8 rule for this op" in out and "M parameters" in out
    with pytest.raises(SystemExit) as e:
        main(["inspect", model, "--shape", "nope=1,2"])
    assert e.value.code == 2


# -- the shared Paddle and YOLOX exports (skipped where ../shared is absent) ---------------------------

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared")


def _shared_images(n, shape, mean, std, start):
    from PIL import Image
    folder = os.path.join(SHARED, "imagenet-samples")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".JPEG"))[start::50][:n]
    _, c, h, w = shape
    for f in files:
        im = Image.open(os.path.join(folder, f)).convert("RGB").resize((w, h), Image.BILINEAR)
        yield ((np.asarray(im, np.float32) - mean) / std).transpose(2, 0, 1)[None].copy()


@pytest.mark.parametrize("name,shape,mean,std,min_db", [
    ("ppocr-cls-mobilenetv3.onnx", (1, 3, 48, 192), 127.5, 127.5, 16.0),
    ("yolox-det.onnx", (1, 3, 416, 416), 0.0, 1.0, 20.0),
])
def test_shared_models_from_npy(tmp_path, name, shape, mean, std, min_db):
    path = os.path.join(SHARED, "models", name)
    if not os.path.exists(path):
        pytest.skip(f"{path} not present")
    data = tmp_path / "npy"
    data.mkdir()
    n = 8 if shape[2] < 100 else 3  # the detector is slow-ish: a smoke test, the benchmark measures
    for k, x in enumerate(_shared_images(n, shape, mean, std, start=0)):
        np.save(data / f"{k}.npy", x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = calibrate(path, str(data),
                      CalibrateOptions(method="mse", threads=2, show_progress=False), workdir=str(tmp_path / "w"))
        q = quantize(str(tmp_path / "w"))
    onnx.checker.check_model(q.path)
    assert any("opset upgraded from 11 to 13" in n for n in q.report["notes"])
    # Judged over several unseen images: one image's SQNR moves by several dB with the last bit of the
    # fp32 calibration run, which differs between CPUs (image 5 alone: 11.8 dB on Zen 4, above 12 on Zen 3; these 8 together: 18.5 dB on Zen 4).
    inp = onnx.load(path).graph.input[0].name
    fp32, int8 = onnx.load(path), onnx.load(q.path)
    xs = list(_shared_images(n, shape, mean, std, start=5))
    ref = np.concatenate([run(fp32, {inp: x})[0] for x in xs])
    out = np.concatenate([run(int8, {inp: x})[0] for x in xs])
    assert _sqnr(ref, out) > min_db


def test_conv_transpose_is_int8_and_onnx_runtime_runs_it_in_float(tmp_path):
    """ConvTranspose is int8 with weights that ORT never pairs (encoding.pair_partners: None, plain int8
    over the full range); that rests on this ONNX Runtime's optimizer leaving a Q/DQ ConvTranspose as
    DequantizeLinear -> float ConvTranspose -> QuantizeLinear. Should a later version fuse it (an int8
    kernel, which may sum in int16 pairs), this fails and its weights want the target's encoding."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from qtool.quantize.encoding import pair_partners
    rng = np.random.default_rng(8)
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("ConvTranspose", ["c", "w1"], ["y"], strides=[2, 2], kernel_shape=[2, 2])]
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w0"),
             numpy_helper.from_array(rng.standard_normal((4, 2, 2, 2)).astype(np.float32), "w1")]
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 16, 16])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    model = save(m, tmp_path / "ct.onnx")
    r, q = _cal_q(model, _samples(rng, 3, {"x": (1, 3, 8, 8)}), tmp_path / "work")
    nodes = {d["op_type"]: d for d in q.report["nodes"]}
    assert nodes["ConvTranspose"]["status"] == "int8" and nodes["Conv"]["status"] == "int8"
    assert pair_partners((4, 2, 2, 2), "ConvTranspose", 1) is None
    # the same ConvTranspose between Q/DQ pairs, as an int8 rule would write it: what ORT makes of it
    wq = np.clip(np.round(numpy_helper.to_array(inits[1]) / 0.02), -127, 127).astype(np.int8)
    qdq = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
           helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
           helper.make_node("DequantizeLinear", ["wq", "ws"], ["wd"]),
           helper.make_node("ConvTranspose", ["xd", "wd"], ["t"], strides=[2, 2], kernel_shape=[2, 2]),
           helper.make_node("QuantizeLinear", ["t", "s", "z"], ["tq"]),
           helper.make_node("DequantizeLinear", ["tq", "s", "z"], ["y"])]
    g = helper.make_graph(qdq, "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 16, 16])],
                          [numpy_helper.from_array(np.float32(0.05), "s"), numpy_helper.from_array(np.uint8(128), "z"),
                           numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(np.float32(0.02), "ws")])
    mq = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    mq.ir_version = 8
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "ort_optimized.onnx")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.log_severity_level = 3
    ort.InferenceSession(mq.SerializeToString(), so, providers=["CPUExecutionProvider"])
    assert "ConvTranspose" in {n.op_type for n in onnx.load(str(tmp_path / "ort_optimized.onnx")).graph.node}
