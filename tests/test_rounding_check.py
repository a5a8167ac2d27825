"""Output-aware rounding, by default, is cross-fitted on the halves of the tuning samples and judged by what
the output means against nearest rounding (rounding_check.py): nearest replaces it where it measures worse
beyond the noise on the half it did not see; where kept, the model is the one the unchecked rounding writes."""
from __future__ import annotations

import warnings

import numpy as np

from helpers import calibrated_convnet
from qtool.quantize import rounding_check as RC
from qtool.quantize.options import QuantizeOptions, SensitivityOptions
from qtool.quantize.run import quantize
from qtool.quantize.steps import rounding as rounding_step

OPTIONS = QuantizeOptions(strict=True, progress=False, sensitivity=SensitivityOptions(enabled=False))


def _calibrated(tmp_path, n=24):
    return calibrated_convnet(tmp_path, n)


def _quantize(work, out):
    said = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quantize(work, QuantizeOptions(**{**OPTIONS.__dict__, "output": out}), say=said.append)
    with open(q.path, "rb") as f:
        return q.report, f.read(), said


def test_halves_judge_every_sample_once():
    parts = RC.halves(7)
    assert sorted(i for p in parts for i in p) == list(range(7)) and len(parts) == RC.HALVES


def test_a_rounding_worse_on_the_half_it_did_not_see_falls_back_to_nearest(tmp_path, monkeypatch):
    """A rounding that fits nothing (each weight pushed 3 steps off nearest, whatever the covariance): the
    models rounded on one half read the other half worse than nearest rounding does, so the default
    writes nearest rounding and says why in one line and in quantize.json."""
    from qtool.quantize import rounding, weights

    def harmful(w, scale, axis, hessian, *a, **k):
        q = rounding.Q.quantize_weight(w, np.asarray(scale).reshape(-1), axis)
        off = np.random.default_rng(0).choice([-3, 3], q.shape)
        return np.clip(q.astype(np.int64) + off, -127, 127).astype(q.dtype)
    monkeypatch.setattr(weights, "round_weights", harmful)
    rep, _, said = _quantize(_calibrated(tmp_path), str(tmp_path / "a.onnx"))
    c = rep["rounding_check"]
    assert c["decision"] == "nearest" and c["samples"] == rep["samples_used"]["steps"]["output-aware rounding"]
    assert c["verdict"]["samples"] == c["samples"] and c["verdict"]["judge"] == "top-1"
    assert rep["rounding"] == "nearest" and not rep["rounded_layers"]
    assert any(s.startswith("verified output-aware rounding on") and "nearest rounding instead (" in s
               for s in said)


def test_where_kept_the_model_is_the_unchecked_rounding_byte_for_byte(tmp_path, monkeypatch):
    work = _calibrated(tmp_path)
    rep, checked, said = _quantize(work, str(tmp_path / "checked.onnx"))
    assert rep["rounding_check"]["decision"] == "kept" and rep["rounding"] == "output-aware"
    assert any("kept (nearest" in s for s in said)
    # the same run with the check made blind: the rounding as it was before the check
    monkeypatch.setattr(rounding_step, "check_rounding",
                        lambda ctx, samples, progress=None: RC.RoundingCheck(len(samples), why_not="blind"))
    _, unchecked, _ = _quantize(work, str(tmp_path / "unchecked.onnx"))
    assert checked == unchecked


def test_the_check_keeps_quantize_deterministic(tmp_path):
    work = _calibrated(tmp_path)
    a = _quantize(work, str(tmp_path / "a.onnx"))
    b = _quantize(work, str(tmp_path / "b.onnx"))
    assert a[1] == b[1] and a[0]["rounding_check"] == b[0]["rounding_check"]


def test_too_few_tuning_samples_leave_the_rounding_unchecked_and_say_so(tmp_path):
    rep, _, said = _quantize(_calibrated(tmp_path, n=6), str(tmp_path / "a.onnx"))
    assert rep["rounding_check"]["decision"] == "unchecked" and rep["rounding"] == "output-aware"
    assert any(s.startswith("output-aware rounding not cross-checked") for s in said)

