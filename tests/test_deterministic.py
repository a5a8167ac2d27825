"""The same model and calibration samples give the same int8 model, byte for byte: no decision of quantize
depends on a clock, the machine's load, thread timing or the order of a set (issue 45: PP-OCRv4's
recognizer, whose MACs budget.py could not count, got its steps' samples from a timed fp32 pass: three
runs, three models)."""
from __future__ import annotations

import os
import shutil
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

from helpers import calibrate_samples, if_conv_model, init, make_model, save, sequence_encoder, small_convnet, weight
from qtool.api import quantize
from qtool.quantize import budget as B
from qtool.quantize import samples as S
from qtool.quantize.options import QuantizeOptions


def _fixed(rng):
    return small_convnet(seed=3), [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(12)]


def _sequence(rng):
    """A CRNN in miniature: x [N, 3, 4, W] (W free) -> Conv -> Relu -> mean over the height -> [W, N, C]
    -> LSTM -> MatMul -> Softmax over 7 classes per position."""
    h = 6
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("ReduceMean", ["r"], ["m"], name="pool_h", axes=[2], keepdims=0),
             helper.make_node("Transpose", ["m"], ["t"], name="to_seq", perm=[2, 0, 1]),
             helper.make_node("LSTM", ["t", "W", "R", "B"], ["ys"], name="lstm", hidden_size=h),
             helper.make_node("Squeeze", ["ys", "one"], ["s"], name="squeeze"),
             helper.make_node("MatMul", ["s", "wh"], ["logits"], name="head"),
             helper.make_node("Softmax", ["logits"], ["y"], name="softmax", axis=-1)]
    inits = [weight(rng, "w", 8, 3, 3, 3), weight(rng, "b", 8, scale=0.1), weight(rng, "W", 1, 4 * h, 8, scale=0.3),
             weight(rng, "R", 1, 4 * h, h, scale=0.3), weight(rng, "B", 1, 8 * h, scale=0.1),
             init("one", [1], np.int64), weight(rng, "wh", h, 7)]
    m = make_model(nodes, inits, [("x", ["N", 3, 4, "W"])], [("y", ["W", "N", 7])])
    return m, [{"x": rng.standard_normal((1, 3, 4, 24)).astype(np.float32)} for _ in range(12)]


def _multi_input(rng):
    """a, b [N, 3, 8, 8] -> a Conv each -> Add -> Relu."""
    nodes = [helper.make_node("Conv", ["a", "wa", "ba"], ["ca"], name="conv_a", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Conv", ["b", "wb", "bb"], ["cb"], name="conv_b", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Add", ["ca", "cb"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "wc"], ["out"], name="conv_c", kernel_shape=[1, 1])]
    inits = [weight(rng, "wa", 4, 3, 3, 3, scale=0.3), weight(rng, "ba", 4, scale=0.1),
             weight(rng, "wb", 4, 3, 3, 3, scale=0.3), weight(rng, "bb", 4, scale=0.1),
             weight(rng, "wc", 5, 4, 1, 1, scale=0.5)]
    m = make_model(nodes, inits, [("a", ["N", 3, 8, 8]), ("b", ["N", 3, 8, 8])], [("out", ["N", 5, 8, 8])])
    return m, [{k: rng.standard_normal((1, 3, 8, 8)).astype(np.float32) for k in "ab"} for _ in range(12)]


def _uncountable(rng):
    """An If whose branches hold convolutions: the branch a sample takes follows its data, so no work can
    be counted before running it."""
    return if_conv_model(rng), [{"x": rng.standard_normal((1, 1, 64)).astype(np.float32),
                                 "sr": np.array(16000, np.int64)} for _ in range(12)]


def _lost_batch(rng):
    """x [N, T, 8] -> MatMul -> a Reshape to [N * T / 2, 16] by a shape computed from the data (half the
    sum of a mask input, as attention masks give lengths): shape inference leaves the MatMul after it
    unknown (MiniLM's attention, which count_macs could not count). Multi-input."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="proj"),
             helper.make_node("ReduceSum", ["mask"], ["len"], name="length", keepdims=1),
             helper.make_node("Reshape", ["len", "one"], ["len1"], name="flat"),
             helper.make_node("Div", ["len1", "two"], ["half"], name="half"),
             helper.make_node("Concat", ["half", "sixteen"], ["shape"], name="shape", axis=0),
             helper.make_node("Reshape", ["h", "shape"], ["pairs"], name="pair"),
             helper.make_node("Relu", ["pairs"], ["rp"], name="relu"),
             helper.make_node("MatMul", ["rp", "w2"], ["y"], name="head")]
    inits = [weight(rng, "w1", 8, 8, scale=0.4), weight(rng, "w2", 16, 5, scale=0.4),
             init("two", [2], np.int64), init("sixteen", [16], np.int64), init("one", [1], np.int64)]
    m = make_model(nodes, inits, [("x", ["N", "T", 8]), ("mask", ["N", "T"])], [("y", ["R", 5])])
    m.graph.input[1].type.tensor_type.elem_type = TensorProto.INT64
    return m, [{"x": rng.standard_normal((1, 6, 8)).astype(np.float32), "mask": np.ones((1, 6), np.int64)}
               for _ in range(12)]


def _many_lengths(rng):
    """Sentences of many lengths (x [1, T, 16], T from 5 to 12): every step runs each length as its own batches."""
    return sequence_encoder(seed=3), [{"x": rng.standard_normal((1, t, 16)).astype(np.float32)}
                                      for t in (5, 7, 9, 5, 12, 7, 9, 5, 12, 6, 7, 9)]


KINDS = {"fixed": _fixed, "sequence": _sequence, "multi_input": _multi_input, "uncountable": _uncountable,
         "lost_batch": _lost_batch, "many_lengths": _many_lengths}


def _calibrated(tmp_path, kind):
    return calibrate_samples(*KINDS[kind](np.random.default_rng(5)), tmp_path)


def _quantize_bytes(work: str, copy: str) -> tuple:
    """quantize in a fresh copy of the calibrated working directory -> (the int8 model's bytes, the report)."""
    shutil.copytree(work, copy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quantize(copy, QuantizeOptions(strict=True), verbose=False)
    with open(q.path, "rb") as f:
        return f.read(), q.report


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_two_runs_write_the_same_bytes(tmp_path, kind):
    work = _calibrated(tmp_path, kind)
    one, rep = _quantize_bytes(work, str(tmp_path / "one"))
    two, _ = _quantize_bytes(work, str(tmp_path / "two"))
    assert one == two
    used = rep["samples_used"]
    assert used["basis"] in ("counted", "fixed") and used["steps"]
    assert all(isinstance(n, int) for n in used["steps"].values())


def test_the_work_is_counted_where_inference_loses_a_shape():
    m, samples = _lost_batch(np.random.default_rng(5))
    shapes = {k: v.shape for k, v in samples[0].items()}
    assert B.counted_work(m, shapes) is None  # (shape inference alone cannot)
    # proj 6 x 8 outputs of 8 products, head 3 x 5 of 16, the Relu 3 x 16, ReduceSum, Div and Concat 1 + 1 + 2
    assert B.counted_work(m, shapes, samples[0]) == 6 * 8 * 8 + 3 * 5 * 16 + 3 * 16 + 4


def test_lstm_and_gru_count_their_gates():
    m, samples = _sequence(np.random.default_rng(5))
    lstm = next(n for n in m.graph.node if n.op_type == "LSTM")
    known = {"t": [24, 1, 8], "W": [1, 24, 8], "R": [1, 24, 6]}
    assert B.node_work(lstm, known) == 24 * 1 * 24 * (8 + 6)


class _Clock:
    """time.perf_counter for samples.py whose every call is `step` seconds after the last."""

    def __init__(self, step):
        self.t, self.step = 0.0, step

    def perf_counter(self):
        self.t += self.step
        return self.t


@pytest.mark.parametrize("kind", ["uncountable", "lost_batch"])
def test_the_model_does_not_follow_the_clock(tmp_path, monkeypatch, kind):
    """The fp32 pass timed at a microsecond and at 1000 s per call (an idle machine and a loaded one):
    the same model. Before, a model whose MACs could not be counted took its budget from that timing."""
    work = _calibrated(tmp_path, kind)
    monkeypatch.setattr(S, "time", _Clock(1e-6))
    fast, rep = _quantize_bytes(work, str(tmp_path / "fast"))
    monkeypatch.setattr(S, "time", _Clock(1000.0))
    slow, _ = _quantize_bytes(work, str(tmp_path / "slow"))
    assert fast == slow
    assert rep["samples_used"]["basis"] == ("fixed" if kind == "uncountable" else "counted")


def test_calibration_table_is_the_same_under_any_hash_seed(tmp_path):
    """calibrate wrote channel_ranges in the order of a set (the hash seed's), so two runs on the same
    model and images wrote different tables, and the int8 models that record the table's sha256 differed."""
    import subprocess
    import sys
    import numpy as np
    from onnx import helper as H
    from helpers import conv_bn, make_model, save, weight, write_config, write_images
    rng, c, nodes, inits, x = np.random.default_rng(2), 8, [], [], "x"
    for k in range(5):  # stem, then depthwise + pointwise pairs: several tensors whose channel ranges are kept
        kw = {} if k == 0 else dict(group=c, k=3) if k % 2 else dict(k=1)
        n, i = conv_bn(rng, x, f"t{k}", 3 if k == 0 else c, c, f"b{k}", **kw)
        nodes, inits, x = nodes + n, inits + i, f"t{k}"
    nodes += [H.make_node("GlobalAveragePool", [x], ["gap"]), H.make_node("Flatten", ["gap"], ["flat"], axis=1),
              H.make_node("Gemm", ["flat", "fc_w"], ["y"], transB=1)]
    save(make_model(nodes, inits + [weight(rng, "fc_w", 4, c)], [("x", ["N", 3, 16, 16])], [("y", ["N", 4])]),
         tmp_path / "net.onnx")
    write_config(tmp_path / "cfg.toml")
    write_images(tmp_path / "data", 6, seed=4)
    tables = []
    for seed in ("1", "2", "3"):
        w = tmp_path / f"w{seed}"
        subprocess.run([sys.executable, "-m", "qtool", "calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml",
                        "-w", str(w), "-q"], cwd=tmp_path, check=True,
                       env={**__import__("os").environ, "PYTHONHASHSEED": seed})
        tables.append((w / "calibration.json").read_bytes())
    import json
    assert len(json.loads(tables[0])["channel_ranges"]) >= 2
    assert tables[0] == tables[1] == tables[2]
