"""Channel balancing judged on calibration samples held out of the per-channel ranges it scales by
(calibrate/run.py held_out_rule, collect.py fit ranges, quantize/equalize.py fit_table and balance)."""
from __future__ import annotations

import copy
import os
import warnings

import numpy as np
import onnx

from helpers import run
from qtool.api import calibrate, quantize
from qtool.calibrate.run import held_out_rule
from qtool.calibrate.table import CalibrationTable, load_table
from qtool.quantize.equalize import fit_table
from test_real_models import _unbalanced_mobilenet_block, _write, save


def test_held_out_samples_are_a_few_spread_over_the_data():
    for n, count in ((10, 0), (16, 4), (32, 8), (100, 16), (5000, 16)):
        held = [i for i in range(n) if held_out_rule(n)(i)]
        assert len(held) == count
        if held:
            assert held[-1] >= n - n // count - 1  # (spread to the end, not the first few)
    assert sum(held_out_rule(None)(i) for i in range(1000)) == 16  # (a stream of unknown length)


def test_fit_table_moves_each_methods_range_to_the_fitted_extremes():
    t = CalibrationTable("m", "", "", "auto", 32, ranges={"minmax": {"a": [-2.0, 8.0], "b": [0.0, 1.0]},
                                                          "mse": {"a": [-0.5, 5.0], "b": [0.0, 0.5]}},
                         channel_ranges={"a": [[-2.0, -1.0], [8.0, 2.0]]},
                         channel_ranges_fit={"a": [[-1.0, -1.0], [4.0, 2.0]]}, held_out=["s03"])
    f = fit_table(t)
    assert f.ranges["minmax"]["a"] == [-1.0, 4.0] and f.ranges["mse"]["a"] == [-0.5, 4.0]
    assert f.ranges["minmax"]["b"] == [0.0, 1.0]  # (no per-channel ranges: as calibrated)
    assert f.channel_ranges["a"] == [[-1.0, -1.0], [4.0, 2.0]]
    assert t.ranges["minmax"]["a"] == [-2.0, 8.0] and t.channel_ranges["a"] == [[-2.0, -1.0], [8.0, 2.0]]
    t.channel_ranges_fit = {}
    assert fit_table(t) is None


def _samples(rng, n, loud_held_out: float, wide: float = 40.0):
    """Inputs to the unbalanced block whose held-out samples (calibrate's rule) drive its seven narrow
    channels `loud_held_out` times harder, the wide one as the others do (a direction w1[7] cannot see)."""
    m = _unbalanced_mobilenet_block(rng, wide)
    w7 = onnx.numpy_helper.to_array(next(i for i in m.graph.initializer if i.name == "w1"))[7, :, 0, 0]
    quiet = np.linalg.svd(w7[None])[2][1:]  # 3 directions orthogonal to w7
    held = held_out_rule(n)
    out = []
    for i in range(n):
        x = rng.standard_normal((1, 4, 10, 10))
        if held(i):
            x += loud_held_out * np.einsum("k,kc->c", rng.standard_normal(3), quiet)[None, :, None, None] \
                * np.abs(rng.standard_normal((1, 1, 10, 10)))
        out.append({"x": x.astype(np.float32)})
    return m, out


def _calibrate_and_quantize(m, samples, tmp_path):
    os.makedirs(tmp_path, exist_ok=True)
    path = save(m, tmp_path / "model.onnx")
    data = _write(tmp_path / "data", samples)
    work = str(tmp_path / "work")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(path, data, method="auto", workdir=work, verbose=False, threads=1)
        q = quantize(work, strict=True, verbose=False, rounding="nearest", sensitivity=False)
    return load_table(os.path.join(work, "calibration.json")), q


def test_calibration_keeps_channel_ranges_without_the_held_out_samples(tmp_path):
    m, samples = _samples(np.random.default_rng(3), 32, loud_held_out=6.0)
    table, _ = _calibrate_and_quantize(m, samples, tmp_path)
    held = [i for i in range(32) if held_out_rule(32)(i)]
    assert [os.path.basename(f) for f in table.held_out] == [f"s{i:02d}.npy" for i in held]
    fp32 = onnx.load(str(tmp_path / "work" / "fused.onnx"))
    del fp32.graph.output[:]
    fp32.graph.output.extend([onnx.helper.make_empty_tensor_value_info("z")])
    z = [run(fp32, s)[0] for s in samples]
    kept = np.concatenate([z[i] for i in range(32) if i not in held])
    np.testing.assert_allclose(table.channel_ranges_fit["z"][1], kept.max(axis=(0, 2, 3)), rtol=1e-5)
    np.testing.assert_allclose(table.channel_ranges["z"][1], np.concatenate(z).max(axis=(0, 2, 3)), rtol=1e-5)
    assert max(table.channel_ranges["z"][1][:7]) > 2 * max(table.channel_ranges_fit["z"][1][:7])


def test_balancing_is_kept_only_where_samples_held_out_of_its_ranges_gain(tmp_path):
    """Balanced by ranges that the held-out samples go far past, those samples clip: judged on them,
    balancing is not kept; judged on the samples that set the ranges, the same balancing is."""
    from qtool.quantize.context import QuantizeContext
    from qtool.quantize.equalize import balance
    from qtool.quantize.samples import load_samples

    m, samples = _samples(np.random.default_rng(3), 32, loud_held_out=0.0, wide=8.0)
    table, _ = _calibrate_and_quantize(m, samples, tmp_path)
    fused = onnx.load(str(tmp_path / "work" / "fused.onnx"))
    files = sorted(str(p) for p in (tmp_path / "data").iterdir())
    seen = load_samples(fused, table, [f for f in files if f not in table.held_out][:8])
    unseen = load_samples(fused, table, table.held_out)

    def balanced(fit_share: float, judged_on) -> bool:
        t = copy.copy(table)  # (as if the held-out samples' narrow channels reached 1/fit_share of the rest's)
        t.channel_ranges_fit = {k: [[a * (fit_share if c < 7 else 1) for c, a in enumerate(v)] for v in r]
                                for k, r in table.channel_ranges.items()}
        ctx = QuantizeContext(fused, t, "minmax")
        return bool(balance(ctx, seen, say=lambda text: None, unseen=judged_on)) and ctx.fused is not fused
    assert balanced(1.0, unseen) and balanced(1.0, None)
    assert balanced(0.25, None) and not balanced(0.25, unseen)
