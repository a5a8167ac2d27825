"""ONNX Runtime's x86-without-VNNI arithmetic (qtool/arithmetic.py), emulated by the runtime:

- bit for bit against what ORT 1.32 computed on an AMD EPYC Zen 3 (../shared/ort-x86-avx2): eleven
  single-layer cases and a whole int8 EfficientNet-Lite0's logits, on any CPU;
- against this machine's ORT, whichever arithmetic it turns out to use (the probe says which);
- the pair rule itself (128 is safe, 129 is not) against brute force.
"""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from qtool.arithmetic import (EXACT, ORT_X86_NOVNNI, PAIR_LIMIT, conv_rows, pair_sums, saturating_pairs,
                              saturation_correction)

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "ort-x86-avx2")
CASES = sorted(glob.glob(os.path.join(SHARED, "cases", "*.onnx")))
needs_shared = pytest.mark.skipif(not CASES, reason="../shared/ort-x86-avx2 is absent")


def _brute(a, rows):
    """Pairs along K, each summed then clipped to int16, as vpmaddubsw does (a: raw uint8)."""
    m, k = a.shape
    out = np.zeros((m, rows.shape[0]), np.int64)
    for n in range(rows.shape[0]):
        for j in range(0, k, 2):
            p = a[:, j].astype(np.int64) * rows[n, j]
            if j + 1 < k:
                p = p + a[:, j + 1].astype(np.int64) * rows[n, j + 1]
            out[:, n] += np.clip(p, -32768, 32767)
    return out


@pytest.mark.parametrize("k", [1, 2, 7, 9, 16, 33])
def test_saturation_correction_matches_brute_force(k):
    rng = np.random.default_rng(k)
    rows = rng.choice(np.array([127, 126, 100, 64, 2, 0, -64, -90, -127], np.int64), size=(5, k))
    a = rng.choice(np.array([255, 254, 200, 128, 3, 0], np.uint8), size=(40, k))
    exact = a.astype(np.int64) @ rows.T
    np.testing.assert_array_equal(exact + saturation_correction(a, rows, saturating_pairs(rows)), _brute(a, rows))


def test_pair_limit_is_where_saturation_starts():
    a = np.full((1, 2), 255, np.uint8)
    for s, want in ((128, False), (129, True)):
        for rows in (np.array([[64, s - 64]]), np.array([[-64, -(s - 64)]])):
            n, _ = saturating_pairs(rows)
            assert bool(len(n)) is want
            # and the brute force agrees: only a pair past the limit changes the sum
            assert bool(_brute(a, rows)[0, 0] != 255 * rows.sum()) is want
    assert PAIR_LIMIT == 128
    assert not len(saturating_pairs(np.array([[127, -127, 127, -128]]))[0])  # opposite signs never saturate
    np.testing.assert_array_equal(pair_sums(np.array([[100, 50, -3, 7, 9]])), [[150, 0, 0]])  # (9 pairs with padding)


def test_conv_rows_order_is_taps_then_channels():
    w = np.arange(2 * 3 * 2 * 2).reshape(2, 3, 2, 2)  # [Cout, Cin, KH, KW]
    r = conv_rows(w)
    assert r[0, :3].tolist() == [w[0, 0, 0, 0], w[0, 1, 0, 0], w[0, 2, 0, 0]]  # cin fastest
    assert r[1, 3] == w[1, 0, 0, 1]


@needs_shared
@pytest.mark.parametrize("path", CASES, ids=lambda p: os.path.basename(p)[:-5])
def test_emulation_matches_recorded_ort_bit_for_bit(path):
    from qtool.runtime import NativeSession
    z = np.load(path[:-5] + ".npz")
    s = NativeSession(path, threads=1, arithmetic=ORT_X86_NOVNNI)
    y = s.run(None, {s.get_inputs()[0].name: z["x"]})[0]
    np.testing.assert_array_equal(y, z["ort"])
    ex = NativeSession(path, threads=1, arithmetic=EXACT)
    y_exact = ex.run(None, {ex.get_inputs()[0].name: z["x"]})[0]
    if "dw3x3" in path:
        np.testing.assert_array_equal(y_exact, z["ort"])  # depthwise sums in int32 on that CPU too
    else:
        assert (y_exact != z["ort"]).mean() > 0.05  # the cases do exercise the saturation


@needs_shared
def test_emulation_reproduces_whole_model_logits():
    from qtool.runtime import NativeSession
    z = np.load(os.path.join(SHARED, "efficientnet-lite0.int8.npz"))
    x = ((z["x_u8"].astype(np.float32) - z["x_zero_point"]) * z["x_scale"]).astype(np.float32)
    s = NativeSession(os.path.join(SHARED, "efficientnet-lite0.int8.onnx"), threads=2, arithmetic=ORT_X86_NOVNNI)
    name = s.get_inputs()[0].name
    y = np.concatenate([s.run(None, {name: x[i:i + 1]})[0] for i in range(len(x))])
    np.testing.assert_array_equal(y, z["ort_logits"])


def test_probe_names_this_machines_arithmetic_and_it_predicts_ort():
    """Whatever this CPU is, ORT's int8 output on a layer with saturating pairs equals the
    runtime under the arithmetic the probe reports (and the probe can tell the two apart)."""
    import onnxruntime as ort
    from helpers import qdq_conv_model
    from qtool.ort_arithmetic import ort_int8_arithmetic
    from qtool.runtime import NativeSession

    arith = ort_int8_arithmetic()
    assert arith in (EXACT, ORT_X86_NOVNNI), arith
    rng = np.random.default_rng(5)
    w = rng.choice(np.array([127, 120, -127, -100, 9], np.int8), size=(16, 12, 3, 3))
    model, x = qdq_conv_model(w, rng)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    got = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = {a: NativeSession(model, threads=1, arithmetic=a).run(None, {"x": x})[0] for a in (EXACT, ORT_X86_NOVNNI)}
    assert not np.array_equal(want[EXACT], want[ORT_X86_NOVNNI])
    np.testing.assert_array_equal(got, want[arith])


def test_the_runtime_check_allows_float_noise_where_layers_run_in_float():
    """A model with layers kept fp32: float rounding moves a few values across a quantization step
    downstream, so ORT and the exact result differ at ~30 dB without either being wrong; saturating
    pairs cost far more (9-14 dB). An all-int8 model must match to float noise (50 dB)."""
    from qtool.evaluate import CHECK_MIN_DB, CHECK_MIN_DB_WITH_FLOAT_OPS, ExactCheck, check_warning
    rng = np.random.default_rng(0)
    exact = rng.standard_normal((8, 10))

    def checked(float_ops, noise_db):
        c = ExactCheck.__new__(ExactCheck)
        c.n, c.error, c.target, c.session, c.float_ops = 8, "", "portable", object(), float_ops
        noise = rng.standard_normal(exact.shape) * np.sqrt(np.mean(exact ** 2) / 10 ** (noise_db / 10))
        c.rows, c.samples = {"exact": [exact], "ort": [exact + noise]}, len(exact)
        return c.result()
    assert CHECK_MIN_DB_WITH_FLOAT_OPS < 30 < CHECK_MIN_DB
    r = checked(5, 30.0)
    assert r["exact"] and r["min_sqnr_db"] == CHECK_MIN_DB_WITH_FLOAT_OPS and check_warning(r) is None
    assert not checked(0, 30.0)["exact"]  # all int8: 30 dB is not float noise
    r = checked(5, 10.0)  # saturation-sized differences are flagged either way
    assert not r["exact"] and "not the exact int8 result" in check_warning(r)


def test_eval_says_when_the_runtime_check_could_not_run_and_counts_samples_not_rows():
    """A model qtool's runtime cannot run gets one line saying the int8 figures were not checked (it said
    nothing: 'not checked' read as 'checked, exact'); a batch counts its samples, not its feed's axis 0
    (a tagger's [chars, 1] counted 49 for one sentence, so the check stopped after 1 of 16)."""
    from qtool.evaluate import ExactCheck, check_warning
    line = check_warning({"checked": 0, "error": "QtoolError: node 'lstm' uses op LSTM, which qtool's runtime cannot run"})
    assert line.startswith("note: not checked") and "LSTM" in line
    assert check_warning({"checked": 0, "error": "no samples"}) is None and check_warning(None) is None

    class Runs:
        def run(self, names, feeds):
            return [feeds["x"] * 2]
    c = ExactCheck.__new__(ExactCheck)
    c.n, c.error, c.target, c.session, c.float_ops = 3, "", "portable", Runs(), 0
    c.rows, c.samples, c.gmacs, c.int8_path, c._model, c._macs = {"exact": [], "ort": []}, 0, 0.0, None, None, {}
    for _ in range(4):
        x = np.ones((49, 1), np.float32)
        c.add({"x": x}, [x * 2], samples=1)
    assert c.samples == 3 and c.result()["checked"] == 3


def test_exact_check_takes_samples_by_counted_work_not_time(tmp_path, monkeypatch):
    """How many samples the exact check takes is a count of the model's work, never a clock: a MatMul of
    64 x 1000 products per sample under a budget of 2.5 samples' work takes 3 samples however slow the run;
    a model whose work cannot be counted takes CHECK_SAMPLES_UNCOUNTED."""
    import time

    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from qtool.evaluate import exact
    from qtool.evaluate.exact import ExactCheck

    w = numpy_helper.from_array(np.ones((64, 1000), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1000])], [w])
    path = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(g), path)

    class Slow:
        program = type("Program", (), {"steps": []})()

        def run(self, names, feeds):
            time.sleep(0.01)  # (a loaded machine: under the old 20 s clock the count moved with this)
            return [feeds["x"] @ np.ones((64, 1000), np.float32)]

    monkeypatch.setattr(exact, "CHECK_GMACS", 2.5 * 64 * 1000 / 1e9)
    x = np.ones((1, 64), np.float32)
    c = ExactCheck(path, threads=1, n=32, native=Slow())
    for _ in range(10):
        c.add({"x": x}, [x @ np.ones((64, 1000), np.float32)])
    assert c.samples == 3 and c.result()["checked"] == 3

    # a MatMul whose weight is an input of unknown shape: its work cannot be counted
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, None)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    onnx.save(helper.make_model(g), str(tmp_path / "u.onnx"))
    c = ExactCheck(str(tmp_path / "u.onnx"), threads=1, n=32, native=Slow())
    for _ in range(20):
        c.add({"x": x}, [x @ np.ones((64, 1000), np.float32)])
    assert c.samples == exact.CHECK_SAMPLES_UNCOUNTED
