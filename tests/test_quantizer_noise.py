"""quantize/quantizer_noise.py: the quantizer that a few wide channels swamp is found first."""
import glob
import os

import numpy as np
import pytest

from helpers import save, write_config, write_images
from test_sensitivity import damaged_chain
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions
from qtool.qparams import ActQParams
from qtool.quantize.context import QuantizeContext
from qtool.quantize.quantizer_noise import _measure, quantizer_noise
from qtool.quantize.inputs import load_inputs
from qtool.workdir import Workdir
from qtool.quantize.samples import load_samples


@pytest.fixture
def swamped(tmp_path):
    """(context, calibration samples) of a chain whose c3 has one output channel 300x the others."""
    model = save(damaged_chain(damaged="c3"), str(tmp_path / "m.onnx"))
    data = str(tmp_path / "images")
    write_images(data, 12, seed=3)
    wd = str(tmp_path / "work")
    calibrate(model, data,
              CalibrateOptions(config=write_config(str(tmp_path / "cfg.toml"), size=16), method="minmax", show_progress=False),
              workdir=wd)
    inp = load_inputs(Workdir(wd))
    fused, table = inp.fused, inp.table
    ctx = QuantizeContext(fused, table, "minmax")
    samples = load_samples(fused, table, sorted(glob.glob(os.path.join(data, "*"))))
    return ctx, samples


def test_the_swamped_tensor_is_the_noisiest(swamped):
    # c3's output channel 0 is 300x the others: c3's (Relu-fused) output, which c4 reads, has one
    # range for all and the other channels get a handful of its steps
    ctx, samples = swamped
    noise = quantizer_noise(ctx, samples)
    assert noise[0].tensor == "c3_r" and noise[0].readers == ["c4"], [(q.tensor, q.sqnr_db) for q in noise]
    assert noise[0].sqnr_db + 10 < noise[1].sqnr_db
    assert "x" in {q.tensor for q in noise}  # the model input's quantizer is measured too


def test_values_below_a_flat_readers_range_are_no_noise():
    p = ActQParams(scale=0.01, zero_point=100)  # range [-1.0, 1.55]
    y = np.array([-5.0, -3.0, 0.5, 1.0], np.float32)
    flat, plain = ({}, {}), ({}, {})
    _measure("t", y, p, True, *flat)
    _measure("t", y, p, False, *plain)
    assert flat[1]["t"].sum() < 1e-9  # clipped where the reader is flat anyway: nothing lost
    assert plain[1]["t"].sum() > 16  # (-5 -> -1 and -3 -> -1: 4^2 + 2^2)


def test_small_runs_and_a_slow_model_give_the_same_ranking(swamped, monkeypatch):
    """Memory and time bounds change how the tensors are fetched and how many samples, not the ranking:
    one tensor per fp32 run (a tiny byte budget), and one sample where the model is slow."""
    from qtool.quantize import quantizer_noise as QN
    ctx, samples = swamped
    whole = quantizer_noise(ctx, samples)
    runs = []
    real = QN.session
    monkeypatch.setattr(QN, "session", lambda *a, **k: runs.append(1) or real(*a, **k))
    monkeypatch.setattr(QN, "BYTES_PER_PASS", 1)
    small = quantizer_noise(ctx, samples)
    fetched = len([q for q in whole if q.tensor != "x"])
    assert len(runs) == 1 + (fetched - QN.FIRST_PASS)  # the first run's FIRST_PASS, then one tensor each
    assert [(q.tensor, round(q.sqnr_db, 6)) for q in small] == [(q.tensor, round(q.sqnr_db, 6)) for q in whole]
    from qtool.quantize import budget as B
    monkeypatch.setattr(B, "NOMINAL_MACS_PER_SECOND", 1.0)  # a pass counted as slow: one sample only
    one = quantizer_noise(ctx, samples)
    assert one[0].tensor == "c3_r" and len(one) == len(whole)
    assert [round(q.sqnr_db, 6) for q in one] != [round(q.sqnr_db, 6) for q in whole]  # (fewer samples)


def test_the_plan_and_qparams_come_without_the_weights(swamped):
    ctx, _ = swamped
    full, light = ctx.build(), ctx.build(weights=False)
    assert light.plan.tensors == full.plan.tensors and light.plan.int8_nodes == full.plan.int8_nodes
    assert {t: (q.scale, q.zero_point) for t, q in light.qparams.items()} == \
        {t: (q.scale, q.zero_point) for t, q in full.qparams.items()}
    assert not light.layers and full.layers  # (no weight quantized)
