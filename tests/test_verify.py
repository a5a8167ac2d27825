"""With --verify (verify=True; off by default), every step that changes the model is kept only where the model with it measures better than without
it on calibration samples the step was not fitted on, by what the output means (issue 45: output-aware
rounding, fitted on PP-OCRv4's recognizer's crops, read 1-13 points fewer held-out crops than nearest
rounding)."""
from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
import pytest

from helpers import calibrated_convnet, ctc_probabilities, save, small_convnet
from qtool.api import calibrate, quantize
from qtool.quantize import verify as V
from qtool.quantize.split import MIN_VERIFY_SAMPLES, PARTS, VERIFY_EVERY, SampleSplit
from qtool.quantize.steps import verify_choice
from qtool.quantize.options import QuantizeOptions, SensitivityOptions


def _misread(p, samples):
    """p with the symbol at step 0 of each of `samples` turned into blank: their texts change."""
    q = p.copy()
    for i in samples:
        q[i, 0] = 0.0
        q[i, 0, 0] = 1.0
    return q


def test_the_judge_reads_what_the_output_means():
    rng = np.random.default_rng(0)
    ctc = V.judge_for(ctc_probabilities(rng))
    assert ctc.kind == "texts (greedy CTC)" and ctc.blank == 0
    logits = rng.standard_normal((20, 10)).astype(np.float32)
    assert V.judge_for(logits).kind == "top-1"
    emb = rng.standard_normal((20, 64))
    assert V.judge_for((emb / np.linalg.norm(emb, axis=1, keepdims=True)).astype(np.float32)).kind == "cosine"
    assert V.judge_for(rng.standard_normal((20, 1, 16, 16)).astype(np.float32)).kind == "SQNR"


def test_the_judge_reads_a_large_output_without_a_float64_copy_of_it():
    """judge_for runs on the default path (the rounding check) and on --exclude-sensitive's check samples (PP-OCRv5's
    228 crops: 240 MB of probabilities): a whole float64 copy of them doubled that, and the row lengths squared it
    again. It now reads the output in its own precision, a bounded chunk at a time."""
    import tracemalloc
    ref = np.full((24, 40, 6625), 0.1 / 6624, np.float32)
    ref[:, :, 0] = 0.9
    ref[:, 5, [0, 7]] = ref[:, 5, [7, 0]]  # one letter each
    tracemalloc.start()
    try:
        kind = V.judge_for(ref).kind
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert kind == V.TEXTS
    assert peak < ref.nbytes, (peak, ref.nbytes)  # (a float64 copy alone is twice the output)


def test_texts_read_decide_before_any_continuous_figure():
    rng = np.random.default_rng(1)
    ref = ctc_probabilities(rng)
    judge = V.judge_for(ref)
    close = ref + 1e-4  # (nearer fp32 in KL at every position than `far` ...)
    far = ref * 0.9 + 0.1 / ref.shape[-1]
    worse = _misread(close, [0, 1, 2])  # (... but three texts misread)
    v = V.verdict("rounding", judge, ref, worse, far, "nearest")
    assert not v.kept and v.decided_by == "count" and (v.read_with, v.read_without) == (9, 12)
    v = V.verdict("rounding", judge, ref, far, worse, "nearest")
    assert v.kept and v.decided_by == "count"


def test_a_tie_in_texts_needs_a_gain_beyond_the_noise():
    rng = np.random.default_rng(2)
    ref = ctc_probabilities(rng)
    judge = V.judge_for(ref)
    mild, rough = ref * 0.98 + 0.02 / ref.shape[-1], ref * 0.8 + 0.2 / ref.shape[-1]
    assert V.verdict("s", judge, ref, mild, rough, "f").kept  # every sample nearer fp32
    assert not V.verdict("s", judge, ref, rough, mild, "f").kept
    assert not V.verdict("s", judge, ref, mild, mild, "f").kept  # no gain: the step falls back
    one = _misread(ref, [0])
    assert not V.verdict("s", judge, ref, ref, one, "f").decided_by == "count"  # (one crop is within the noise)


def test_the_split_holds_samples_out_of_every_fitting_step():
    files = [f"f{k:02d}" for k in range(32)]
    s = SampleSplit.of(files, 64, verify=True)
    assert len(s.verify) >= MIN_VERIFY_SAMPLES
    assert not set(s.verify) & (set(s.tune) | set(s.auto))
    few = SampleSplit.of(files[:MIN_VERIFY_SAMPLES * VERIFY_EVERY - 1], 64, verify=True)
    assert few.verify == []
    many = SampleSplit.of([f"f{k:03d}" for k in range(200)], 64, verify=True)
    assert len(many.tune) == 32 and len(many.verify) == 32 and not set(many.verify) & set(many.tune)


def _calibrated(tmp_path, n=30):
    return calibrated_convnet(tmp_path, n)


def test_rounding_that_measures_worse_where_it_was_not_fitted_falls_back_to_nearest(tmp_path, monkeypatch):
    """A rounding that fits nothing (each weight pushed 3 steps off nearest): kept before, now measured
    on the held-out samples and replaced by nearest rounding, said in quantize.json."""
    from qtool.quantize import rounding

    def harmful(w, scale, axis, hessian, *a, **k):
        q = rounding.Q.quantize_weight(w, np.asarray(scale).reshape(-1), axis)
        off = np.random.default_rng(0).choice([-3, 3], q.shape)
        return np.clip(q.astype(np.int64) + off, -127, 127).astype(q.dtype)
    from qtool.quantize import weights
    from qtool.quantize.rounding_check import RoundingCheck
    from qtool.quantize.steps import rounding as rounding_step
    monkeypatch.setattr(weights, "round_weights", harmful)
    # (the layer by layer check that runs by default catches this rounding first: test_rounding_check.py;
    # here it is made blind, so the rounding reaches the held-out model)
    monkeypatch.setattr(rounding_step, "check_rounding", lambda ctx, samples, progress=None:
                        RoundingCheck(len(samples), why_not="made blind"))
    work = _calibrated(tmp_path)
    lines = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quantize(work, QuantizeOptions(strict=True, verify=True, sensitivity=SensitivityOptions(enabled=False)), verbose=False)
    rep = q.report
    assert rep["rounding"] == "nearest" and not rep["rounded_layers"]
    v = rep["verified"]["output-aware rounding"]
    assert not v["kept"] and v["samples"] >= MIN_VERIFY_SAMPLES and v["judge"] == "top-1"
    assert rep["samples_used"]["steps"]["verification"] == v["samples"]
    del lines


def test_too_few_samples_to_hold_out_say_so(tmp_path, capsys):
    work = _calibrated(tmp_path, n=8)
    from qtool.quantize.run import quantize as run_quantize
    said = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = run_quantize(work, QuantizeOptions(strict=True, verify=True, progress=False, sensitivity=SensitivityOptions(enabled=False)), say=said.append)
    assert q.report["verified"] == {}
    assert any("too few to hold" in s and "kept unverified" in s for s in said)


def test_every_step_falls_back_where_it_does_not_measure_better(tmp_path, monkeypatch):
    """Where no step measures better on the held-out samples, the model is the plain one: the calibrated
    table's unclipped method, channels as they were, nearest rounding, the target's encoding, inputs on
    their calibrated grid; each step says so in quantize.json."""
    real = V.verdict
    monkeypatch.setattr(V, "verdict", lambda *a, **k: dataclasses.replace(real(*a, **k), kept=False))
    from qtool.quantize import method_choice
    monkeypatch.setattr(method_choice, "choose", lambda *a, **k: "mse")  # (a clipping method chosen)
    rng = np.random.default_rng(4)
    path = save(small_convnet(seed=4), tmp_path / "model.onnx")
    data = tmp_path / "data"
    os.makedirs(data)
    for k in range(30):
        np.save(data / f"s{k:02d}.npy", rng.standard_normal((1, 3, 16, 16)).astype(np.float32))
    work = str(tmp_path / "work")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(path, str(data), method="auto", workdir=work, verbose=False, threads=1)
        q = quantize(work, QuantizeOptions(strict=True, verify=True), verbose=False)
    rep = q.report
    assert rep["verified"] and all(not v["kept"] for v in rep["verified"].values())
    assert "output-aware rounding" in rep["verified"] and rep["rounding"] == "nearest"
    from qtool.calibrate.table import load_table
    from qtool.workdir import Workdir
    table = load_table(Workdir(work).manifest()["calibrate"]["table_path"])
    assert any(k.startswith("method choice (mse)") for k in rep["verified"]) and rep["method"] == table.range_method
    assert rep["encoding_choice"] == {} and (rep["input_grid"] or {}).get("chosen", "as calibrated") == "as calibrated"


def test_the_default_holds_no_sample_out():
    """Off (the default), the split is the one quantize used before verification existed: no sample held
    out, tuning and method choice on the samples they always took."""
    for n in (8, 30, 32, 200):
        files = [f"f{k:03d}" for k in range(n)]
        off, on = SampleSplit.of(files, 64), SampleSplit.of(files, 64, verify=True)
        assert off.verify == [] and off.auto == on.auto and set(on.tune) <= set(off.tune)
        assert set(off.files(PARTS)) == \
            set(off.auto) | set(off.tune) | set(off.sensitivity) | set(off.held_back)
    files = [f"f{k:02d}" for k in range(32)]
    assert len(SampleSplit.of(files, 64).tune) == 32 and len(SampleSplit.of(files, 64, verify=True).tune) == 22


def test_the_default_writes_the_model_verification_never_touches(tmp_path, monkeypatch):
    """quantize without --verify writes the same bytes as with every verification code path taken away
    (verify_step and verify_choice raise, the split holds nothing out), records no `verified` and measures
    no step on held-out samples; with --verify the report says what was verified."""
    work = _calibrated(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = quantize(work, QuantizeOptions(strict=True, output=str(tmp_path / "default.onnx")), verbose=False)
        with monkeypatch.context() as m:
            def never(*a, **k):
                raise AssertionError("verification ran without --verify")
            m.setattr(V, "verify_step", never)
            m.setattr(verify_choice, "verify_choice", never)
            real_of = SampleSplit.of.__func__
            m.setattr(SampleSplit, "of", classmethod(
                lambda cls, *a, **k: dataclasses.replace(real_of(cls, *a, **k), verify=[])))
            bare = quantize(work, QuantizeOptions(strict=True, output=str(tmp_path / "bare.onnx")), verbose=False)
        verified = quantize(work, QuantizeOptions(strict=True, output=str(tmp_path / "verified.onnx"), verify=True), verbose=False)
    assert open(default.path, "rb").read() == open(bare.path, "rb").read()
    rep = default.report
    assert "verified" not in rep and "verification" not in rep["samples_used"]["steps"]
    assert "verification" not in rep["optional_steps"]["seconds"]
    assert rep["rounding"] == "output-aware" and rep["samples_used"]["steps"].get("target cost") == 30
    assert verified.report["verified"] and "verification" in verified.report["samples_used"]["steps"]


def test_a_recognizer_on_crops_of_several_widths_is_judged_by_its_texts():
    """Crops of several widths come out as sequences of several lengths, joined zero-padded to the longest
    (samples.py): the padded rows are no distribution, yet the output is still a recognizer's, judged by its
    texts, each sample read over its own positions only."""
    from qtool.quantize.verify import judge_for
    rng = np.random.default_rng(3)
    lengths, T, C = [12, 20, 16, 20, 8, 20], 20, 30
    ref = np.zeros((len(lengths), T, C), np.float32)
    for k, n in enumerate(lengths):
        path = np.where(rng.random(n) < 0.7, 0, rng.integers(1, C, n))  # blank 0 most of the time
        ref[k, np.arange(n), path] = 0.9
        ref[k, :n] += 0.1 / C
        ref[k, :n] /= ref[k, :n].sum(-1, keepdims=True)
    judge = judge_for(ref)
    assert judge.kind == "texts (greedy CTC)" and judge.blank == 0
    y = ref.copy()
    near = set(ref[1, 2:5].argmax(-1).tolist())
    c = next(c for c in range(1, C) if c not in near)
    y[1, 3] = 0.0
    y[1, 3, c] = 1.0  # one position of sample 1 reads a letter fp32 does not: one more letter in its text
    assert judge.counted(ref, y).tolist() == [k != 1 for k in range(len(lengths))]
