"""qtool's own quantizer output (calibrate -> quantize on the shared small conv net) runs on the
native runtime fully in int8 and matches ONNX Runtime on the same file, whatever CPU this is:
the default (portable) target's weights give the same sums under every arithmetic."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")

from qtool.arithmetic import ARITHMETICS  # noqa: E402
from qtool.runtime import NativeSession  # noqa: E402
from qtool.quantize.options import QuantizeOptions, SensitivityOptions


def test_qtool_int8_model_matches_ort(calibrated, tmp_path):
    from qtool.quantize.run import quantize
    root, model, data, cfg, _ = calibrated
    out = tmp_path / "net.int8.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize(str(root / "work"), QuantizeOptions(output=str(out), progress=False, sensitivity=SensitivityOptions(enabled=False)), say=lambda *a, **k: None)
    s = NativeSession(str(out))
    assert s.fallback_nodes() == [], s.report()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    ref = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    name = s.get_inputs()[0].name
    shape = [2 if not isinstance(d, int) else d for d in s.get_inputs()[0].shape]
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    a, b = s.run(None, {name: x})[0], ref.run(None, {name: x})[0]
    assert a.shape == b.shape
    assert np.abs(a - b).max() <= 1e-5 * max(1.0, float(np.abs(b).max())), (a, b)
    x8 = (x * 40).astype(np.float32)  # large inputs: every activation quantizer saturates somewhere
    exact, novnni = (NativeSession(str(out), arithmetic=a).run(None, {name: x8})[0] for a in ARITHMETICS)
    np.testing.assert_array_equal(exact, novnni)
