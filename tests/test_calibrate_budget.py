"""The calibration compute budget (calibrate/budget.py): a heavy model uses fewer samples, spread
over the whole folder; a light one, an uncounted one or a zero budget uses them all."""
from __future__ import annotations

import json
import os

import numpy as np

from helpers import save, small_convnet, write_config, write_images
from qtool import graph as G
from qtool.calibrate.budget import Spend, planned_samples, within_budget
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions, Sampling


def _batches(n, k=4):
    for s in range(0, n, k):
        names = [f"s{i:03d}" for i in range(s, min(n, s + k))]
        yield names, {"x": np.zeros((len(names), 3), np.float32)}


def _used(n, gmac_each, budget, k=4, said=None):
    spend = Spend(budget, n)
    out = [nm for names, _ in within_budget(_batches(n, k), n, lambda f: gmac_each * 1e9 * len(f["x"]), budget,
                                            said.append if said is not None else None, spend=spend)
           for nm in names]
    return out, spend


def test_plan_counts_samples_from_the_budget_with_a_floor():
    assert planned_samples(100, 10.0, 500) == 50
    assert planned_samples(100, 100.0, 500) == 16  # never fewer than 16
    assert planned_samples(100, 1.0, 500) is None  # all fit
    assert planned_samples(100, None, 500) is None  # not counted: not capped
    assert planned_samples(100, 10.0, 0) is None  # no budget
    assert planned_samples(12, 1000.0, 500) is None  # few samples: all of them


def test_a_heavy_model_uses_batches_spread_over_the_whole_folder():
    said = []
    used, spend = _used(200, 100.0, 4000, said=said)  # 40 samples allowed of 200
    assert spend.planned == 40 and abs(len(used) - 40) <= 2 and spend.used == len(used)
    idx = [int(u[1:]) for u in used]
    assert idx[:4] == [0, 1, 2, 3]  # the first batch always
    assert max(idx) >= 180  # the end of the folder too, not only its head
    quarters = np.bincount(np.array(idx) * 4 // 200, minlength=4)
    assert quarters.min() >= 8, quarters  # each quarter of the folder gives its share
    assert len(said) == 1 and "200 samples x 100 GMAC" in said[0] and "using about 40" in said[0]


def test_light_uncounted_or_unbudgeted_models_use_every_sample():
    for gmac, budget in [(1.0, 4000), (100.0, 0)]:
        used, spend = _used(200, gmac, budget)
        assert len(used) == 200 and not spend.capped
    spend = Spend(4000, 200)
    used = list(within_budget(_batches(200), 200, lambda f: None, 4000, spend=spend))
    assert sum(len(n) for n, _ in used) == 200 and spend.gmac_per_sample is None


def test_calibrate_records_the_samples_the_budget_kept(tmp_path):
    model = save(small_convnet(size=16), tmp_path / "net.onnx")
    write_images(tmp_path / "d", 40)
    said = []
    fused = G.total_macs(onnx_load(model), {"x": [1, 3, 16, 16]})
    budget = fused * 20.5 / 1e9  # room for 20 of the 40 images
    r = calibrate(model, str(tmp_path / "d"),
                  CalibrateOptions(config=write_config(tmp_path / "cfg.toml"), method="minmax", threads=1,
                                   sampling=Sampling(batch=4, budget_gmac=budget), show_progress=False),
                  workdir=str(tmp_path / "w"), say=said.append)
    assert r.budget["planned"] == 20 and abs(r.table.n_samples - 20) <= 2 and r.budget["used"] == r.table.n_samples
    assert any("over the" in s and "budget" in s for s in said)
    files = json.load(open(tmp_path / "w" / "manifest.json"))["calibrate"]["files"]
    assert len(files) == r.table.n_samples and os.path.basename(files[-1]) > "img30"  # spread, not the head
    everything = calibrate(model, str(tmp_path / "d"),
                           CalibrateOptions(config=write_config(tmp_path / "cfg.toml"), method="minmax", threads=1,
                                            sampling=Sampling(batch=4, budget_gmac=0), show_progress=False),
                           workdir=str(tmp_path / "w2"), say=said.append)
    assert everything.table.n_samples == 40 and not everything.budget["planned"]


def onnx_load(path):
    import onnx
    return onnx.load(path)
