"""What `eval` reports for outputs that are not a classifier's: a sequence of distributions (a CTC
recognizer) gets top-1 agreement per position, a probability map (a text detector) none at all."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import helper

from helpers import init, make_model, save, write_config, write_images
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions
from qtool.commands.eval import render
from qtool.evaluate import EvalOptions, OutputStats, evaluate, evaluate_workdir
from qtool.metrics import agreement_kind
from qtool.quantize.run import quantize


def _sequence_model(rng, t=16, classes=40):
    """[1, 3, 16, 16] -> a 1x16 feature strip -> [1, T, classes] softmax, as a CTC head writes."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("ReduceMean", ["r1"], ["m"], axes=[2], keepdims=1),  # [1, 8, 1, 16]
             helper.make_node("Conv", ["m", "w2", "b2"], ["c2"]),                   # [1, classes, 1, 16]
             helper.make_node("Squeeze", ["c2", "ax"], ["s"]),                      # [1, classes, 16]
             helper.make_node("Transpose", ["s"], ["tr"], perm=[0, 2, 1]),
             helper.make_node("Softmax", ["tr"], ["probs"], axis=-1)]
    inits = [init("w1", rng.standard_normal((8, 3, 3, 3)) * 0.5), init("b1", rng.standard_normal(8) * 0.1),
             init("w2", rng.standard_normal((classes, 8, 1, 1))), init("b2", rng.standard_normal(classes) * 0.1),
             init("ax", [2], np.int64)]
    return make_model(nodes, inits, [("x", [1, 3, 16, 16])], [("probs", [1, t, classes])], opset=13)


def _map_model(rng):
    """[1, 3, 16, 16] -> [1, 1, 16, 16] sigmoid map, as DBNet writes."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c2"], ["prob"])]
    inits = [init("w1", rng.standard_normal((8, 3, 3, 3)) * 0.5), init("b1", rng.standard_normal(8) * 0.1),
             init("w2", rng.standard_normal((1, 8, 3, 3)) * 0.5), init("b2", np.zeros(1))]
    return make_model(nodes, inits, [("x", [1, 3, 16, 16])], [("prob", [1, 1, 16, 16])], opset=13)


def test_agreement_kind_by_shape():
    assert agreement_kind((4, 1000)) == "class"
    assert agreement_kind((4, 40, 6625)) == "position"  # CTC: many classes per position
    assert agreement_kind((4, 3549, 6)) is None         # a detector's rows (judged by its top rows)
    assert agreement_kind((4, 1, 640, 480)) is None     # a probability map
    assert agreement_kind((4, 1)) is None               # one score


def test_position_agreement_counts_positions_and_whole_sequences():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 10, 7)).astype(np.float32)
    b = a.copy()
    b[0, 2] = -b[0, 2]  # flips position 2 of sample 0 (its argmax becomes another class)
    assert a[0, 2].argmax() != b[0, 2].argmax()
    st = OutputStats("y")
    st.add(a, b)
    r = st.result()
    assert r["agreement_over"] == "positions"
    assert r["top1_agreement"] == pytest.approx(29 / 30) and r["sequence_agreement"] == pytest.approx(2 / 3)


def _calibrated(tmp_path, model):
    path = save(model, tmp_path / "m.onnx")
    write_images(tmp_path / "cal", 6, seed=1, h=16, w=16)
    write_images(tmp_path / "ev", 5, seed=2, h=16, w=16)
    cfg = write_config(tmp_path / "cfg.toml", size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(path, str(tmp_path / "cal"),
                  CalibrateOptions(config=cfg, show_progress=False), workdir=str(tmp_path / "w"))
        q = quantize(str(tmp_path / "w"))
    return path, q.path, cfg


def test_eval_of_a_sequence_output_is_per_position(tmp_path):
    fp32, int8, cfg = _calibrated(tmp_path, _sequence_model(np.random.default_rng(3)))
    r = evaluate(fp32, int8, str(tmp_path / "ev"), EvalOptions(config=cfg, latency=False), show_progress=False)
    assert r["n_images"] == 5 and r["agreement_over"] == "positions"
    assert 0.5 < r["top1_agreement"] <= 1.0 and 0.0 <= r["sequence_agreement"] <= r["top1_agreement"]
    assert "top5_overlap" in r and r["top5_overlap"] is None  # kept only for a classifier
    assert "top-1 agreement per position" in render(r)


def test_eval_of_a_probability_map_has_no_top1(tmp_path):
    fp32, int8, cfg = _calibrated(tmp_path, _map_model(np.random.default_rng(4)))
    r = evaluate(fp32, int8, str(tmp_path / "ev"), EvalOptions(config=cfg, latency=False, runtime="both"),
                 show_progress=False)
    assert r["n_images"] == 5 and "top1_agreement" not in r and r["output_sqnr_db"] > 15
    assert "top1_agreement_vs_fp32" not in r["native"] and r["native"]["max_abs_diff_vs_ort_int8"] >= 0
    text = render(r)
    assert "no top-1 agreement" in text and "max |difference| from ORT int8" in text


def test_sequence_first_output_is_read_per_sample():
    """[T, N, C] (ddddocr's CRNN writes [54, 1, 8210]): N sequences of T positions, not T samples."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((10, 2, 7)).astype(np.float32)
    b = a.copy()
    b[3, 1] = -b[3, 1]  # one position of sample 1
    st = OutputStats("y")
    st.add(a, b, samples=2)
    r = st.result()
    assert r["top1_agreement"] == pytest.approx(19 / 20) and r["sequence_agreement"] == pytest.approx(1 / 2)


def test_ctc_texts_equal_where_only_a_blank_moved():
    from qtool.evaluate import ctc_agreement
    from qtool.metrics import ctc_collapse
    assert ctc_collapse(np.array([0, 3, 3, 0, 3, 5, 0]), blank=0) == (3, 3, 5)
    same = (np.array([0, 0, 3, 3, 0, 0, 5, 0]), np.array([0, 3, 3, 0, 0, 0, 5, 5]))  # the same text, "35"
    other = (np.array([0, 0, 3, 0, 0, 0, 5, 0]), np.array([0, 0, 3, 0, 0, 0, 4, 0]))  # "35" against "34"
    r = ctc_agreement([same, other])
    assert r == {"ctc_text_agreement": 0.5, "ctc_blank": 0}
    assert ctc_agreement([(np.array([1, 2, 3, 4]), np.array([1, 2, 3, 4]))]) == {}  # no blank: not CTC


def test_no_ctc_texts_for_a_per_step_classifier():
    """A background class at most steps and events many steps long (a seizure detector's 0.5 s decisions,
    hx8's brainmaze model) is no CTC output: collapsing the repeats would call an onset moved by 3 steps
    the same "text"."""
    from qtool.evaluate import ctc_agreement
    bg, ev = [2] * 12, [1] * 6
    ref = np.array(bg + ev + bg)
    moved = np.array(bg + [2, 2, 2] + ev[:3] + bg)
    assert ctc_agreement([(ref, moved), (ref, ref)]) == {}


def test_detector_heads_in_both_layouts():
    from qtool.metrics import detector_like
    assert detector_like((1, 3549, 6)) == "rows"       # YOLOX at 416: x, y, w, h, objectness, class
    assert detector_like((1, 22, 2100)) == "columns"   # YOLOv8 at 320: x, y, w, h, 18 classes; 2100 anchors
    assert detector_like((1, 84, 8400)) == "columns"
    assert detector_like((4, 40, 6625)) is None        # a CTC recognizer's 6625 classes are no anchor grid
    rng = np.random.default_rng(2)
    a = rng.random((1, 22, 2100)).astype(np.float32)
    st = OutputStats("y")
    st.add(a, a.copy())
    r = st.result()
    assert "top1_agreement" not in r and r["top_rows_agreement"]["top100"] == 1.0


def _two_output_model(rng):
    """[1, 3, 16, 16] -> a probability map and a [1, 8] pooled feature (SLANet writes two outputs)."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c2"], ["prob"]),
             helper.make_node("GlobalAveragePool", ["r1"], ["g"]),
             helper.make_node("Flatten", ["g"], ["feat"])]
    inits = [init("w1", rng.standard_normal((8, 3, 3, 3)) * 0.5), init("b1", rng.standard_normal(8) * 0.1),
             init("w2", rng.standard_normal((1, 8, 3, 3)) * 0.5), init("b2", np.zeros(1))]
    return make_model(nodes, inits, [("x", [1, 3, 16, 16])], [("prob", [1, 1, 16, 16]), ("feat", [1, 8])],
                      opset=13)


def test_eval_on_images_of_a_two_output_model_reports_each_output(tmp_path):
    """`qtool eval` on an image folder printed a two-output model's lines through the .npy path's renderer,
    which wants n_samples: KeyError, exit 70, after the whole evaluation had run."""
    fp32, int8, cfg = _calibrated(tmp_path, _two_output_model(np.random.default_rng(5)))
    r = evaluate(fp32, int8, str(tmp_path / "ev"), EvalOptions(config=cfg, latency=False), show_progress=False)
    assert r["n_images"] == 5 and set(r["outputs"]) == {"prob", "feat"}
    lines = render(r).splitlines()
    assert any(line.startswith("  prob [") and "SQNR" in line for line in lines)
    assert any(line.startswith("  feat [") and "SQNR" in line for line in lines)


def test_a_sequence_of_distributions_is_judged_per_position_and_box_coordinates_not_at_all():
    """SLANet writes [N, 501, 30] structure-token probabilities and [N, 501, 4] box coordinates: by shape
    alone the first passed for a detector's rows (top-scoring rows shared) and the second for a 4-class
    sequence (top-1 agreement over coordinates, CTC-decoded)."""
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((2, 501, 30))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    st = OutputStats("structure")
    st.add(probs, probs.copy(), samples=2)
    r = st.result()
    assert r["agreement_over"] == "positions" and r["top1_agreement"] == 1.0 and "top_rows_agreement" not in r
    boxes = rng.random((2, 501, 4))
    st = OutputStats("loc")
    st.add(boxes, boxes + 0.01, samples=2)
    r = st.result()
    assert "top1_agreement" not in r and "top_rows_agreement" not in r and r["max_abs_error"] == pytest.approx(0.01)
    yolo = np.concatenate([rng.random((1, 3549, 4)) * 416, rng.random((1, 3549, 2))], axis=2)  # still rows
    st = OutputStats("det")
    st.add(yolo, yolo.copy(), samples=1)
    assert "top_rows_agreement" in st.result() and "top1_agreement" not in st.result()


def _three_steps(model: str, tmp_path) -> dict:
    """calibrate on tmp_path/cal, quantize, eval on tmp_path/ev (folders of .npy): eval's result."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(model, str(tmp_path / "cal"), CalibrateOptions(show_progress=False), workdir=str(tmp_path / "work"))
        quantize(str(tmp_path / "work"))
        return evaluate_workdir(str(tmp_path / "work"), data=str(tmp_path / "ev"), show_progress=False,
                                say=lambda *a, **k: None)


def test_samples_of_different_lengths_evaluate_and_a_length_is_no_class_axis(tmp_path):
    """A resampler's waveforms differ in length from sample to sample: the check against ONNX Runtime
    joined them all into rows of the last batch's length (ValueError, exit 70, after the evaluation had
    run), and [1, T] read as T classes gave a top-1 agreement over sample positions."""
    rng = np.random.default_rng(8)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[0, 1, 0, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[0, 1, 0, 1]),
             helper.make_node("Flatten", ["c2"], ["y"], axis=1)]
    inits = [init("w1", rng.standard_normal((8, 1, 1, 3)) * 0.5), init("b1", rng.standard_normal(8) * 0.1),
             init("w2", rng.standard_normal((1, 8, 1, 3)) * 0.5), init("b2", np.zeros(1))]
    m = make_model(nodes, inits, [("x", [1, 1, 1, "n"])], [("y", [1, "n"])])
    model = str(tmp_path / "wave.onnx")
    save(m, model)
    for split, n in (("cal", 12), ("ev", 6)):
        (tmp_path / split).mkdir()
        for k in range(n):
            np.save(tmp_path / split / f"{k:02d}.npy", rng.standard_normal((1, 1, 1, 200 + 40 * (k % 3))).astype(np.float32))
    r = _three_steps(model, tmp_path)
    out = r["outputs"]["y"] if "outputs" in r else r
    assert "top1_agreement" not in out and out["shape"] == [1, "?"]
    assert r["runtime_check"]["checked"] == 6 and "error" not in r["runtime_check"]


def _text_and_scalar_model(rng):
    """x [N, 8] float and s [N] strings in; logits [N, 5], their sum (a scalar) and s normalized out:
    a model with a tokenizer's text beside its numbers."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["logits"]),
             helper.make_node("ReduceSum", ["logits"], ["total"], keepdims=0),
             helper.make_node("StringNormalizer", ["s"], ["t"], case_change_action="NONE")]
    inits = [init("w", rng.standard_normal((8, 5))), init("b", rng.standard_normal(5) * 0.1)]
    from onnx import TensorProto
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "m", [vi("x", TensorProto.FLOAT, [1, 8]), vi("s", TensorProto.STRING, [1])],
                          [vi("logits", TensorProto.FLOAT, [1, 5]), vi("total", TensorProto.FLOAT, []),
                           vi("t", TensorProto.STRING, [1])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def test_text_inputs_and_scalar_outputs(tmp_path):
    """Calibration fed a string input to ONNX Runtime's I/O binding (which takes none); eval read a
    scalar output's last dimension and turned strings into floats."""
    from qtool.api import calibrate as api_calibrate, evaluate as api_evaluate, quantize as api_quantize
    rng = np.random.default_rng(4)
    path = save(_text_and_scalar_model(rng), tmp_path / "m.onnx")
    words = ["monday", "tuesday", "apple", "x"]
    samples = [{"x": rng.standard_normal((1, 8)).astype(np.float32), "s": np.array([w], dtype=object)}
               for w in words * 2]
    api_calibrate(path, samples, workdir=str(tmp_path / "w"))
    api_quantize(str(tmp_path / "w"))
    r = api_evaluate(workdir=str(tmp_path / "w"), data=samples)
    assert r["outputs"]["t"] == {"shape": [1], "equal_fraction": 1.0}
    assert r["outputs"]["total"]["shape"] == [] and r["outputs"]["total"]["sqnr_db"] > 20
    assert r["output_sqnr_db"] == r["outputs"]["logits"]["sqnr_db"] > 20
    from qtool.commands.eval import render_outputs
    text = render_outputs(r)
    assert "t [1]: text, 100.0 % of strings equal" in text and "total []: SQNR" in text


def test_sequence_and_empty_outputs(tmp_path):
    """A sequence output (SplitToSequence's: a list of arrays from ONNX Runtime) made calibration's bound
    runner and eval fail ('list' has no nbytes; an inhomogeneous array); an empty output made eval's CTC
    guess and the runtime check reduce over nothing."""
    from onnx import TensorProto
    from qtool.api import calibrate as api_calibrate, evaluate as api_evaluate, quantize as api_quantize
    rng = np.random.default_rng(8)
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"]),
             helper.make_node("SplitToSequence", ["y", "split"], ["seq"], axis=1),
             helper.make_node("Slice", ["y", "start", "end", "axis"], ["empty"])]
    inits = [init("w", rng.standard_normal((6, 8))), init("w2", rng.standard_normal((8, 4))),
             init("split", [1, 3], np.int64), init("start", [2], np.int64), init("end", [2], np.int64),
             init("axis", [1], np.int64)]
    g = helper.make_graph(nodes, "s", [vi("x", TensorProto.FLOAT, ["N", 6])],
                          [vi("y", TensorProto.FLOAT, ["N", 4]), helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, None),
                           vi("empty", TensorProto.FLOAT, ["N", 0])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    path = save(m, tmp_path / "s.onnx")
    samples = [rng.standard_normal((2, 6)).astype(np.float32) for _ in range(6)]
    api_calibrate(path, samples, workdir=str(tmp_path / "w"))
    api_quantize(str(tmp_path / "w"))
    r = api_evaluate(workdir=str(tmp_path / "w"), data=samples)
    assert r["outputs"]["y"]["sqnr_db"] > 20 and r["outputs"]["seq"]["sqnr_db"] > 20
    assert r["outputs"]["empty"]["shape"][1] == 0


def test_one_position_states_get_no_top1_figure():
    """faster-whisper's VAD writes its LSTM state h, c [1, 1, 128]: eval scored them 'top-1 agreement per
    position 0.59' and 'texts equal after CTC decoding'. One position of log-probabilities (a decoder step)
    keeps its figure."""
    from qtool.metrics import output_kind
    rng = np.random.default_rng(0)
    state = np.tanh(rng.standard_normal((1, 1, 128)))
    assert output_kind(state)[0] is None
    z = rng.standard_normal((1, 1, 40))
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    assert output_kind(logp)[0] == "position"
    assert output_kind(rng.standard_normal((2, 7, 40)))[0] == "position"  # (several positions: as before)


def test_independent_gains_per_position_get_no_top1_figure():
    """NSNet2's output is a sigmoid gain for each of 161 frequency bins at each frame: eval read it as a class per
    frame ('sequences equal at every position 0.0000' for an int8 enhancer as good as fp32). Values in [0, 1] that
    do not sum to 1 are no distribution; a softmax's are, and logits too keep their figure."""
    from qtool.metrics import output_kind
    rng = np.random.default_rng(1)
    gains = 1 / (1 + np.exp(-rng.standard_normal((2, 50, 161))))
    assert output_kind(gains)[0] is None
    z = rng.standard_normal((2, 50, 161))
    assert output_kind(np.exp(z) / np.exp(z).sum(-1, keepdims=True))[0] == "position"
    assert output_kind(z)[0] == "position"


def test_integer_ids_are_compared_as_ids():
    """unidic's tagger writes only its ArgMax tags (int64): eval printed an SQNR over tag numbers and a
    'top-1' over the id vector; ids are equal or not, per value and per sample."""
    s = OutputStats("tags")
    fp = np.array([[3, 1, 4, 1], [5, 9, 2, 6]], np.int64)
    q = np.array([[3, 1, 4, 1], [5, 9, 7, 6]], np.int64)
    s.add(fp, q, 2)
    r = s.result()
    assert r["labels_equal"] == 7 / 8 and r["samples_equal"] == 0.5 and "sqnr_db" not in r
    text = "\n".join(__import__("qtool.commands.eval", fromlist=["_output_lines"])._output_lines({"outputs": {"tags": r}}))
    assert "87.5 % equal" in text and "50.0 %" in text


def test_a_tagger_is_judged_by_the_scores_before_its_argmax():
    from qtool import graph as G
    rng = np.random.default_rng(8)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["scores"]),
             helper.make_node("ArgMax", ["scores"], ["tags"], axis=-1, keepdims=0)]
    m = make_model(nodes, [init("w", rng.standard_normal((8, 5)))], [("x", ["N", 6, 8])], [])
    m.graph.output.append(helper.make_tensor_value_info("tags", 7, ["N", 6]))
    assert G.reference_output(m) == "scores"


def test_eval_runs_fewer_samples_at_once_where_activations_are_large(tmp_path):
    """afis's fingerprint network took 2.0 GB per ORT session at 8 samples a run (eval 3.9 GB in all);
    eval sizes its runs by the largest tensor of one sample."""
    from qtool.evaluate import eval_batch
    rng = np.random.default_rng(10)

    def conv_model(cout):
        return make_model([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
                          [init("w", rng.standard_normal((cout, 1, 3, 3)))], [("x", ["N", 1, 256, 256])],
                          [("y", ["N", cout, 256, 256])])
    d = tmp_path / "x"
    d.mkdir()
    for i in range(3):
        np.save(d / f"{i}.npy", rng.standard_normal((1, 1, 256, 256)).astype(np.float32))
    assert eval_batch(conv_model(256), str(d), "m.onnx", None, 8) == 1  # 67 MB a sample
    assert eval_batch(conv_model(2), str(d), "m.onnx", None, 8) == 8


def test_a_uint8_picture_out_is_judged_by_its_values_and_int64_ids_as_ids():
    """depth2normal's normal map comes out as uint8 NHWC: an off-by-one pixel is no wrong class (it read
    "ids, 42.9 % equal" at 51.9 dB PSNR). An ArgMax's int64 class map stays ids."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (2, 16, 16, 3)).astype(np.uint8)
    b = np.clip(a.astype(np.int16) + rng.integers(-1, 2, a.shape), 0, 255).astype(np.uint8)
    st = OutputStats("img")
    st.add(a, b, 2)
    r = st.result()
    assert "labels_equal" not in r and 35 < r["sqnr_db"] < 60 and r["max_abs_error"] == 1
    ids = OutputStats("classes")
    ids.add(a.astype(np.int64), b.astype(np.int64), 2)
    assert "labels_equal" in ids.result()


def test_vectors_get_a_cosine_and_unit_embeddings_no_top1():
    """Rows all of length 1 (a normalized face or sentence embedding) are an encoder's vectors: cosine per
    sample (mean, worst) among its figures and no top-1 agreement, which means nothing there (MiniLM's
    sentence vector read 0.6875 'top-1 agreement'); a confident softmax, whose rows are near length 1 too,
    keeps it, and its vectors' cosine."""
    rng = np.random.default_rng(3)
    e = rng.standard_normal((8, 128))
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    noisy = e + 0.01 * rng.standard_normal(e.shape)
    st = OutputStats("emb")
    st.add(e.astype(np.float32), noisy.astype(np.float32))
    r = st.result()
    want = (e * noisy).sum(1) / np.linalg.norm(noisy, axis=1)
    assert r["task"] == "encoder" and "length 1" in r["task_from"]
    assert r["encoder"]["cosine"]["mean"] == pytest.approx(want.mean(), abs=1e-6)
    assert r["encoder"]["cosine"]["worst"] == pytest.approx(want.min(), abs=1e-6) and "top1_agreement" not in r
    p = np.full((8, 100), 1e-4)
    p[:, 3] = 1 - 99e-4  # (rows of length 0.99)
    st = OutputStats("probs")
    st.add(p.astype(np.float32), p.astype(np.float32))
    assert st.result()["top1_agreement"] == 1.0 and not st.result()["cosine"]["unit_length"]


def test_a_decoder_with_conv_transpose_and_bilinear_resize_is_checked_by_the_runtime(tmp_path):
    """A U-Net-like decoder (ConvTranspose, a bilinear Resize: fp32 in the int8 model) runs on qtool's own
    runtime, so eval's check against ONNX Runtime's int8 runs (hx8: rembg's u2net and CycleCenterNet got
    'checked 0' and an error no one printed)."""
    rng = np.random.default_rng(9)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("ConvTranspose", ["r1", "wt"], ["u1"], strides=[2, 2], kernel_shape=[2, 2]),
             helper.make_node("Resize", ["u1", "", "sc"], ["u2"], mode="linear"),
             helper.make_node("Conv", ["u2", "w2", "b2"], ["y"], pads=[1, 1, 1, 1])]
    inits = [init("w1", rng.standard_normal((8, 3, 3, 3)) * 0.3), init("b1", rng.standard_normal(8) * 0.1),
             init("wt", rng.standard_normal((8, 4, 2, 2)) * 0.3), init("sc", [1, 1, 2, 2]),
             init("w2", rng.standard_normal((2, 4, 3, 3)) * 0.3), init("b2", np.zeros(2))]
    model = str(tmp_path / "unet.onnx")
    save(make_model(nodes, inits, [("x", [1, 3, 16, 16])], [("y", [1, 2, 32, 32])]), model)
    for split, n in (("cal", 8), ("ev", 4)):
        (tmp_path / split).mkdir()
        for k in range(n):
            np.save(tmp_path / split / f"{k}.npy", rng.standard_normal((1, 3, 16, 16)).astype(np.float32))
    r = _three_steps(model, tmp_path)
    assert r["runtime_check"]["checked"] == 4 and "error" not in r["runtime_check"]


def test_eval_of_images_sizes_its_batches_by_memory(tmp_path, monkeypatch):
    """A folder of images is run in batches sized by one image's largest tensor, as a folder of tensors is
    (16 photos at once through a 640x480 text detector: eval at 3.3-6.9 GB; 1.1 GB in batches of 3), with
    the same figures."""
    from qtool.evaluate import batching
    from helpers import small_convnet
    fp32, int8, cfg = _calibrated(tmp_path, small_convnet(seed=4))  # (a free batch)
    seen = []
    real = OutputStats.add
    monkeypatch.setattr(OutputStats, "add", lambda self, a, b, samples=None: seen.append(len(a)) or real(self, a, b, samples))
    whole = evaluate(fp32, int8, str(tmp_path / "ev"), EvalOptions(config=cfg, latency=False), show_progress=False)
    assert max(seen) == 5
    seen.clear()
    monkeypatch.setattr(batching, "EVAL_MEMORY", 1)
    cut = evaluate(fp32, int8, str(tmp_path / "ev"), EvalOptions(config=cfg, latency=False), show_progress=False)
    assert max(seen) == 1 and cut["n_images"] == whole["n_images"] == 5
    assert cut["output_sqnr_db"] == pytest.approx(whole["output_sqnr_db"], rel=1e-4)
    assert cut["top1_agreement"] == whole["top1_agreement"]
    assert cut["runtime_check"]["checked"] == whole["runtime_check"]["checked"] == 5


def test_eval_of_images_whose_first_is_unreadable(tmp_path):
    """The image that sizes eval's batches is the first readable one: an unreadable first image is skipped
    and counted once, as before, not a crash."""
    from helpers import small_convnet
    fp32, int8, cfg = _calibrated(tmp_path, small_convnet(seed=5))
    (tmp_path / "ev" / "000_broken.png").write_bytes(b"\x89PNG not really")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = evaluate(fp32, int8, str(tmp_path / "ev"), EvalOptions(config=cfg, latency=False), show_progress=False)
    assert r["n_images"] == 5 and len(r["skipped"]) == 1
    assert sum("000_broken.png" in str(w.message) for w in seen) == 1


def test_a_recurrent_layers_last_state_gets_no_top1(tmp_path):
    """An LSTM's last hidden state as an output ([1, 2, 16] after a Transpose: two directions, a streaming
    model's carried state) is vectors, not a position's classes: no per-position top-1 (hx8: thai2rom's
    encoder state read 'top-1 agreement per position'), its cosine instead."""
    from onnx import TensorProto, numpy_helper
    from qtool.evaluate import recurrent_states
    rng = np.random.default_rng(10)
    w = lambda n, *sh: numpy_helper.from_array((rng.standard_normal(sh) * 0.3).astype(np.float32), n)
    nodes = [helper.make_node("MatMul", ["x", "wm"], ["m"]),
             helper.make_node("LSTM", ["m", "W", "R", "B"], ["y", "yh"], hidden_size=16, direction="bidirectional"),
             helper.make_node("Transpose", ["yh"], ["state"], perm=[1, 0, 2])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 1, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 2, 1, 16]),
                           helper.make_tensor_value_info("state", TensorProto.FLOAT, [1, 2, 16])],
                          [w("wm", 8, 8), w("W", 2, 64, 8), w("R", 2, 64, 16), w("B", 2, 128)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    assert recurrent_states(m) == {"state"}
    model = str(tmp_path / "lstm.onnx")
    save(m, model)
    for split, n in (("cal", 8), ("ev", 4)):
        (tmp_path / split).mkdir()
        for k in range(n):
            np.save(tmp_path / split / f"{k}.npy", rng.standard_normal((6, 1, 8)).astype(np.float32))
    r = _three_steps(model, tmp_path)
    state = r["outputs"]["state"]
    assert "top1_agreement" not in state and state["cosine"]["mean"] > 0.9


def test_an_output_gets_the_figures_of_each_kind_that_recognises_it():
    """The kinds are found through one registry (kinds.KINDS), each recognising fp32's first batch: a
    classifier's scores are classes and vectors, an embedding (vectors of length 1) an encoder's, a gain mask
    (values in [0, 1] at each position, no distribution) vectors only, a detector's rows rows and vectors."""
    from qtool.evaluate.kinds import EQUAL, KINDS, First, numeric_kinds
    from qtool.evaluate.kinds.classifier import Classes
    from qtool.evaluate.kinds.detector import Rows
    from qtool.evaluate.kinds.embeddings import Vectors
    from qtool.evaluate.kinds.encoder import Encoder
    for kind in KINDS:
        assert callable(kind.recognises) and isinstance(kind.per_class, bool), kind
    assert all(callable(k.recognises) for k in EQUAL)
    rng = np.random.default_rng(11)
    emb = rng.standard_normal((4, 32))
    emb /= np.linalg.norm(emb, axis=-1, keepdims=True)
    rows = np.concatenate([rng.random((1, 3549, 4)) * 416, rng.random((1, 3549, 2))], axis=2)
    cases = {"scores": (rng.standard_normal((4, 10)), {Vectors, Classes}), "embedding": (emb, {Encoder}),
             "mask": (rng.random((1, 20, 161)), {Vectors}), "rows": (rows, {Vectors, Rows})}
    for name, (a, want) in cases.items():
        assert {type(k) for k in numeric_kinds(First.of(a, False, (1, 10, 100)))} == want, name
    st = OutputStats("embedding")
    st.add(emb, emb + 0.001)
    r = st.result()
    assert r["encoder"]["cosine"]["mean"] > 0.99 and "top1_agreement" not in r and "cosine" not in r
