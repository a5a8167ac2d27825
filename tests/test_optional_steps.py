"""An optional step of quantize never ends the job: a fault injected into each in turn leaves a
valid int8 model, one warning naming the step, and a record in quantize.json; --strict turns the
same fault into one line and exit 70. Errors in the user's input stay errors."""
from __future__ import annotations

import dataclasses
import json
import shutil
import warnings

import numpy as np
import onnx
import pytest

from helpers import run
from qtool import cli
from qtool.quantize.optional import OptionalSteps, StepError
from qtool.quantize.options import ExclusionOptions, QuantizeOptions
from qtool.quantize.pipeline import FALLBACKS, LAYER_FALLBACKS
from qtool.quantize.steps import (budget, dynamic_inputs, encoding_choice, equalization, exclusion, guard, input_grid,
                                  method_choice, ort_graph, quantizer_noise, range_tuning, rounding, sensitivity,
                                  target_cost)


def _boom(*args, **kwargs):
    raise RuntimeError("injected fault")


EXCLUDING = QuantizeOptions(exclusion=ExclusionOptions(enabled=True, max_excluded=1))
# step -> (its file, the function it calls there, quantize options that turn the step on)
INJECT = {
    "equalization": (equalization, "balance", QuantizeOptions()),
    "calibration samples": (budget, "afford", QuantizeOptions()),
    "method choice": (method_choice, "pick_method", QuantizeOptions(method="auto")),
    "dynamic inputs": (dynamic_inputs, "measure", QuantizeOptions()),
    "encoding choice": (encoding_choice, "choose_encodings", QuantizeOptions()),
    # (the suite's images are normalised to [-1, 1]: a lattice)
    "input grid": (input_grid, "choose_input_grid", QuantizeOptions()),
    "output-aware rounding": (rounding, "tune_rounding", QuantizeOptions()),
    "range tuning": (range_tuning, "tune_activation_ranges", QuantizeOptions(tune_ranges=True)),
    "sensitivity": (sensitivity, "run_sensitivity", QuantizeOptions()),
    "guard": (guard, "guard_layers", QuantizeOptions()),
    "quantizer noise": (quantizer_noise, "quantizer_noise", EXCLUDING),
    "exclusion": (exclusion, "run_exclusion", EXCLUDING),
    "target cost": (target_cost, "target_cost", QuantizeOptions()),
    "ORT graph check": (ort_graph, "float_layers", QuantizeOptions()),
}


def test_every_optional_step_has_a_fault_injected_here():
    # (subgraphs: in test_real_models, on a model with an If; verification: in test_verify, with --verify on 24 samples or more;
    # migration: in test_migration, on a block whose input is quantized at run time)
    assert set(INJECT) | {"subgraphs", "verification", "migration"} == set(FALLBACKS)


@pytest.fixture
def work(calibrated, tmp_path, monkeypatch):
    monkeypatch.delenv("QTOOL_STRICT", raising=False)  # (the suite runs strict; these tests choose)
    shutil.copytree(calibrated[0] / "work", tmp_path / "work")
    return tmp_path / "work"


def _quantize(work, options=None):
    from qtool.api import quantize
    return quantize(str(work), options, verbose=False)


@pytest.mark.parametrize("step", sorted(INJECT))
def test_a_failing_step_falls_back_and_warns_once(work, monkeypatch, step, calibrated):
    module, fn, options = INJECT[step]
    monkeypatch.setattr(module, fn, _boom)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = _quantize(work, options)
    said = [str(w.message) for w in caught if "injected fault" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"{step} failed (RuntimeError: injected fault)")
    m = onnx.load(q.path)
    onnx.checker.check_model(m)
    assert any(n.op_type == "QuantizeLinear" for n in m.graph.node)  # still an int8 model
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    assert np.isfinite(run(m, {m.graph.input[0].name: x})[0]).all()
    report = json.loads((work / "quantize.json").read_text())
    assert [f["step"] for f in report["optional_steps"]["fallbacks"]] == [step]


@pytest.mark.parametrize("step", ["output-aware rounding", "sensitivity", "target cost"])
def test_strict_makes_the_fault_one_line_and_exit_70(work, monkeypatch, capsys, step):
    module, fn, options = INJECT[step]
    monkeypatch.setattr(module, fn, _boom)
    with pytest.raises(StepError):
        _quantize(work, dataclasses.replace(options, strict=True))
    with pytest.raises(SystemExit) as e:
        cli.main(["quantize", "-w", str(work), "--strict", "-q"])
    assert e.value.code == 70
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{step} failed" in err[0] and "--strict" in err[0]


def test_one_layer_that_cannot_be_rounded_keeps_nearest_rounding(work, monkeypatch):
    """A fault in one layer's rounding costs that layer only: it rounds to nearest, the others by output error."""
    from qtool.quantize import weights
    real = weights.round_weights
    victim = []

    def flaky(w, scale, axis, hessian, *a, **k):  # (the descent fails; nearest rounding does not)
        if hessian is not None and not victim:
            victim.append(w.shape)
        if hessian is not None and w.shape == victim[0]:
            raise ValueError("injected layer fault")
        return real(w, scale, axis, hessian, *a, **k)
    monkeypatch.setattr(weights, "round_weights", flaky)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = _quantize(work)
    said = [str(w.message) for w in caught if "injected layer fault" in str(w.message)]
    assert len(said) == 1 and "at layer" in said[0] and "rounded to nearest" in said[0]
    fallback = q.report["optional_steps"]["fallbacks"]
    assert len(fallback) == 1 and fallback[0]["layer"] in q.report["unrounded_layers"]
    assert fallback[0]["layer"] not in q.report["rounded_layers"] and q.report["rounded_layers"]


def test_a_bad_labels_file_stays_an_error(work):
    from qtool.errors import QtoolError
    with pytest.raises(QtoolError, match="no such labels file"):
        _quantize(work, QuantizeOptions(exclusion=ExclusionOptions(enabled=True, labels=str(work / "absent.txt"),
                                                                   max_drop=1.0)))


def test_the_runner_times_each_step_and_keeps_interrupts():
    steps = OptionalSteps(FALLBACKS, LAYER_FALLBACKS)
    assert steps.run("target cost", lambda: 3) == 3
    assert "target cost" in steps.to_dict()["seconds"]

    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        steps.run("sensitivity", interrupted)
    with pytest.raises(ValueError):
        steps.run("no such step", lambda: 1)
