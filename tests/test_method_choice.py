"""Range method choice (method_choice.py): a CTC recognizer's texts decide first, beyond their noise; where
the output is a distribution, the class each position keeps decides, SQNR breaks ties; elsewhere SQNR with
the clipping method earning its clip."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import ctc_probabilities, init, make_model
from onnx import helper

from qtool.metrics import position_agreement
from qtool.quantize.method_choice import (AGREEMENT_TIE, EXACT_DB, TEXTS_SIGNIFICANCE, Measure, best_option, choose,
                                          measurer)
from qtool.quantize.samples import SampleSet, distribution_output

CLIP = 0.5


def _m(scores: dict, agreement: dict | None = None, read: dict | None = None) -> dict:
    return {k: Measure(v, (agreement or {}).get(k), None if read is None else np.array(read[k], bool))
            for k, v in scores.items()}


def test_sqnr_decides_where_no_agreement_was_measured():
    scores = {"minmax": 20.0, "mse": 22.0, "entropy": 20.3}
    assert choose(_m(scores), "minmax", CLIP) == "mse"
    assert choose(_m({"minmax": 20.0, "mse": 20.3}), "minmax", CLIP) == "minmax"  # the clip not earned


def test_samples_the_grid_does_not_touch_cannot_earn_a_clip():
    """Above EXACT_DB the differences are float32 noise: the unclipped method stays."""
    assert choose(_m({"minmax": EXACT_DB + 27.4, "mse": EXACT_DB + 28.6}), "minmax", CLIP) == "minmax"
    assert choose(_m({"minmax": EXACT_DB - 30.0, "mse": EXACT_DB + 28.6}), "minmax", CLIP) == "mse"


def test_agreement_outranks_sqnr_and_ties_go_to_sqnr():
    scores = {"minmax": 8.0, "mse": 12.0, "entropy": 11.0}
    assert choose(_m(scores, {"minmax": 0.990, "mse": 0.980, "entropy": 0.985}), "minmax", CLIP) == "minmax"
    tied = {"minmax": 0.990, "mse": 0.990 - AGREEMENT_TIE / 2, "entropy": 0.9}
    assert choose(_m(scores, tied), "minmax", CLIP) == "mse"
    # the plain method out of the running: the best SQNR of those left
    assert choose(_m(scores, {"minmax": 0.90, "mse": 0.99, "entropy": 0.99}), "minmax", CLIP) == "mse"


def test_a_recognizer_is_ranked_by_its_texts_beyond_their_noise():
    """A CTC recognizer's texts outrank per-position agreement: PP-OCRv2's LSTM agreed at 0.990 per position
    while 91 of 255 crops read otherwise. A method that reads fewer texts beyond TEXTS_SIGNIFICANCE standard
    deviations of the sign test is out, whatever its agreement; one within that noise stays in the running
    (at one standard deviation, 5 of 8 against 8 dropped PP-OCRv5's minmax and read 12 fewer held-out crops)."""
    scores = {"minmax": 20.0, "mse": 9.0}
    agree = {"minmax": 0.9980, "mse": 0.9995}  # mse ahead per position, beyond AGREEMENT_TIE
    reads = {"minmax": [1, 1, 1, 1, 1, 0, 0, 0], "mse": [0] * 8}  # minmax 5 texts ahead, 5 - 0: 2.2 deviations
    assert TEXTS_SIGNIFICANCE == 2.0
    assert choose(_m(scores, agree, reads), "minmax", CLIP) == "minmax"
    assert choose(_m(scores, agree), "minmax", CLIP) == "mse"  # the same, judged per position
    close = {"minmax": [1, 1, 1, 1, 1, 0, 0, 0], "mse": [0, 1, 0, 0, 0, 0, 0, 0]}  # 4 - 0: 2.0, within noise
    assert choose(_m(scores, agree, close), "minmax", CLIP) == "mse"
    # the same rule ranks any choice's options (balancing, the input grid)
    opts = list(_m(scores, agree, reads).values())
    assert best_option(opts) == 0 and best_option(list(_m(scores, agree).values())) == 1


def test_a_recognizers_measure_counts_its_texts():
    """measurer() counts the texts greedy CTC reads where the output is a Softmax over classes whose top-1
    paths look like CTC (blank-dominated), and none for other distributions."""
    blank, t, c = 0, 12, 5
    ref = np.full((4, t, c), 0.02, np.float32)
    ref[:, :, blank] = 0.92
    ref[:, 3, :] = [0.02, 0.92, 0.02, 0.02, 0.02]  # each sample reads one letter
    y = ref.copy()
    y[0, 3] = [0.92, 0.02, 0.02, 0.02, 0.02]  # sample 0 loses its letter
    m = measurer(_softmax_model(-1, shape=(1, t, c)), _samples(ref))(y)
    assert m.texts == 3 and m.read.tolist() == [False, True, True, True]
    assert m.agreement is not None and m.agreement < 1.0
    cls = measurer(_softmax_model(-1), _samples(np.eye(5, dtype=np.float32)[None].repeat(2, 0)[:, :4]))
    assert cls(np.eye(5, dtype=np.float32)[None].repeat(2, 0)[:, :4]).read is None


def _softmax_model(axis, opset=13, shape=(1, 4, 5)):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["l"], name="mm"),
             helper.make_node("Softmax", ["l"], ["p"], name="sm", axis=axis)]
    return make_model(nodes, [init("w", np.ones((8, shape[-1])))], [("x", [1, shape[1], 8])], [("p", list(shape))],
                      opset=opset)


def _samples(ref, **kw):
    return SampleSet(["a"] * len(ref), {}, ref, output="p", **kw)


def test_a_softmax_over_the_last_axis_is_a_distribution_output():
    ref = np.zeros((2, 4, 5), np.float32)
    assert distribution_output(_softmax_model(-1), _samples(ref))
    assert distribution_output(_softmax_model(2), _samples(ref))
    assert not distribution_output(_softmax_model(1), _samples(ref))  # over the positions: not classes
    assert not distribution_output(_softmax_model(2), _samples(ref, axis=1))  # sequence-first, moved
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"], name="mm")]
    plain = make_model(nodes, [init("w", np.ones((8, 5)))], [("x", [1, 4, 8])], [("p", [1, 4, 5])])
    assert not distribution_output(plain, _samples(ref))


def _paddle_softmax(op="Softmax"):
    """Paddle2ONNX's recognizer head: a Softmax over [N * T, C] between a Flatten and a Reshape back to [N, T, C]."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["l"], name="mm"),
             helper.make_node("Flatten", ["l"], ["f"], name="fl", axis=2),
             helper.make_node(op, ["f"], ["s"], name="sm", axis=-1),
             helper.make_node("Reshape", ["s", "shape"], ["p"], name="rs")]
    return make_model(nodes, [init("w", np.ones((8, 5))), init("shape", np.array([1, 4, 5], np.int64))],
                      [("x", [1, 4, 8])], [("p", [1, 4, 5])])


def test_a_softmax_regrouped_on_its_way_out_is_a_distribution_output():
    """RapidOCR's PP-OCRv4 recognizer ends Flatten -> Softmax -> Reshape: its method choice was judged by SQNR
    alone, never by its texts. Behind ops that only regroup rows, the values say whether the output's last
    axis holds the Softmax's rows; a shorter sample's zero padding is no row."""
    rng = np.random.default_rng(0)
    e = np.exp(rng.standard_normal((3, 4, 5)))
    p = (e / e.sum(-1, keepdims=True)).astype(np.float32)
    p[2, 3] = 0  # (padding)
    assert distribution_output(_paddle_softmax(), _samples(p)) == "Softmax"
    assert distribution_output(_paddle_softmax("LogSoftmax"), _samples(np.log(np.where(p > 0, p, 1)))) == "LogSoftmax"
    # rows that are no distributions (the Reshape regrouped them across the class axis)
    assert distribution_output(_paddle_softmax(), _samples(np.full((3, 4, 5), 0.3, np.float32))) is None


def test_padding_is_no_position():
    """A shorter sample's padding rows (zeros) are left out of the per-position agreement: counted, each was a tie
    flipped with probability 1/2 and their int8 noise set the spread; every method of PP-OCRv4 measured 0.944."""
    rng = np.random.default_rng(1)
    ref = np.abs(rng.standard_normal((4, 10, 6))).astype(np.float32)
    out = ref + rng.standard_normal(ref.shape).astype(np.float32) * 0.05
    padded_ref, padded_out = np.concatenate([ref, np.zeros((4, 5, 6), np.float32)], 1), out.copy()
    padded_out = np.concatenate([out, rng.standard_normal((4, 5, 6)).astype(np.float32)], 1)  # int8 noise there
    assert position_agreement(padded_ref, padded_out) == pytest.approx(position_agreement(ref, out))
    assert position_agreement(np.zeros((2, 3, 4)), np.ones((2, 3, 4))) == 1.0


def test_position_agreement_counts_each_position():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((6, 40, 10))
    assert position_agreement(ref, ref) == 1.0
    noisy = ref + rng.standard_normal(ref.shape) * 0.5
    worse = ref + rng.standard_normal(ref.shape) * 2.0
    assert 0.5 < position_agreement(ref, worse) < position_agreement(ref, noisy) < 1.0


def test_a_clip_needs_more_than_a_few_samples(monkeypatch):
    """Chosen on 1-3 samples (tables of many sizes, one of the most common), a clipping method was measured
    on the very samples that set its clip: wired-table-rec's segmenter chose mse on one (39.2 dB against
    27.8) and read worse than minmax on 16 other tables. Below MIN_CHOICE_SAMPLES the unclipped method stays."""
    from types import SimpleNamespace
    from qtool.quantize import method_choice as run
    monkeypatch.setattr(run, "method_measures", lambda ctx, samples, candidates, progress=None:
                        {"minmax": Measure(27.8), "mse": Measure(39.2)})
    ctx = SimpleNamespace(table=SimpleNamespace(range_method="minmax", ranges={"minmax": {}, "mse": {}}))
    said = []
    assert run.MIN_CHOICE_SAMPLES == 2
    for n, want in ((1, "minmax"), (2, "mse"), (8, "mse")):
        s = SampleSet([f"s{i}" for i in range(n)], {"x": np.zeros((n, 2), np.float32)}, np.zeros((n, 2), np.float32))
        assert run.pick_method(ctx, s, said.append, show_progress=False)[0] == want
    assert any("too few" in line for line in said)



def test_a_recognizers_choices_read_the_tuning_samples_too():
    """A text is read or not, one count per sample: 8 samples could not tell PP-OCRv5's two balancing choices apart
    (7 of 8 each) that its 286 calibration crops did (62 texts changed against 12; 213 against 239 of 255 held-out
    crops read). A recognizer's choices measure on the tuning samples too; a classifier's on method choice's few."""
    from types import SimpleNamespace
    from qtool.quantize.state import QuantizeRun
    rng = np.random.default_rng(0)
    names = [f"s{i}" for i in range(12)]
    split = SimpleNamespace(auto=names[:4], tune=names[2:10])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["l"], name="mm"), helper.make_node("Softmax", ["l"], ["p"], name="sm")]
    classifier = make_model(nodes, [init("w", np.ones((8, 5)))], [("x", [1, 8])], [("p", [1, 5])])
    e = np.exp(rng.standard_normal((12, 5)))
    for ref, model, want in ((ctc_probabilities(rng, 12, c=5), _softmax_model(-1, shape=(1, 20, 5)), names[:10]),
                             ((e / e.sum(1, keepdims=True)).astype(np.float32), classifier, names[:4])):
        run = SimpleNamespace(samples=SampleSet(names, {}, ref, output="p"), split=split,
                              ctx=SimpleNamespace(fused=model), afforded=None)
        assert QuantizeRun.choice_samples.func(run).names == want


def test_a_recognizers_choices_take_what_method_choices_budget_affords():
    """The tuning samples a recognizer's choices add are measured under each range method, as method choice's
    are: a recognizer heavy enough to get fewer of them than it has measures on as many as that budget affords
    (its auto samples always), the added ones spread over the tuning samples, none twice."""
    from types import SimpleNamespace
    from qtool.quantize.budget import STEP_SECONDS, Budget
    from qtool.quantize.split import choice_files
    from qtool.quantize.state import QuantizeRun
    names = [f"s{i}" for i in range(12)]
    assert choice_files(names[:2], names[1:10]) == names[:10]
    assert choice_files(names[:2], names[1:10], 5) == ["s0", "s1", "s2", "s4", "s7"]
    assert choice_files(names[:4], names[2:10], 1) == names[:4]  # (never fewer than method choice's own)
    rng = np.random.default_rng(0)
    table = SimpleNamespace(range_method="minmax", ranges={"minmax": {}, "percentile": {}, "entropy": {}, "mse": {}})
    for seconds, want in ((STEP_SECONDS / 4 / 6, 6), (1e-6, 10), (100.0, 4)):
        run = SimpleNamespace(samples=SampleSet(names, {}, ctc_probabilities(rng, 12, c=5), output="p"),
                              split=SimpleNamespace(auto=names[:4], tune=names[2:10]),
                              ctx=SimpleNamespace(fused=_softmax_model(-1, shape=(1, 20, 5))),
                              inputs=SimpleNamespace(table=table),
                              afforded=SimpleNamespace(budget=Budget(seconds, 1)))
        got = QuantizeRun.choice_samples.func(run).names
        assert len(got) == want and got[:4] == names[:4] and len(set(got)) == want


def test_position_agreement_of_padded_rows_takes_no_copy_and_the_same_figure():
    # the padding rows are left out by index: the figure is the one of the real rows alone, each chunk of
    # rows as the whole (the chunking must not move a figure the method choice compares to the last bit)
    from qtool import metrics
    rng = np.random.default_rng(3)
    ref = rng.dirichlet(np.ones(50), size=(6, 40)).astype(np.float32)
    out = (ref + rng.normal(0, 0.02, ref.shape)).astype(np.float32)
    ref[:, 30:] = 0  # each sample's last 10 positions padding
    real_ref, real_out = ref[:, :30].reshape(-1, 50), out[:, :30].reshape(-1, 50)
    whole = metrics.predicted_agreement(real_ref, real_out)
    assert metrics.position_agreement(ref, out) == whole
    rows = np.flatnonzero(np.abs(ref.reshape(-1, 50)).sum(1) > 0)
    assert metrics._top2(ref.reshape(-1, 50), chunk=64, rows=rows)[0].tolist() == real_ref.argmax(1).tolist()
    assert metrics.nonzero_rows(ref.reshape(-1, 50), chunk=64).sum() == 6 * 30
