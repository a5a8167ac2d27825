"""calibrate and quantize on a local Ray cluster of two worker processes (qtool/calibrate/sharded.py, qtool/quantize/sharded.py): the same
calibration table and int8 model as one process, also when a worker is killed mid-shard."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest

from helpers import calibrate_samples, calibrated_convnet, save, small_convnet, write_config, write_images

ray = pytest.importorskip("ray")  # (the test extra installs it: `make test` runs these)

import deep_chain  # noqa: E402
from qtool.calibrate.options import CalibrateOptions  # noqa: E402
from qtool.calibrate.run import calibrate  # noqa: E402
from qtool.calibrate import sharded  # noqa: E402
from qtool.quantize import sharded as experiments  # noqa: E402
from qtool.distributed.cluster import ClusterError, gather  # noqa: E402
from qtool.quantize.options import ExclusionOptions, QuantizeOptions, SensitivityOptions  # noqa: E402
from qtool.quantize.run import quantize  # noqa: E402

IMAGES = 150  # more than observed.MEAN_SAMPLES: one-slice shards below it, shards of whole batches above


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray_images")
    write_images(d / "imgs", IMAGES)
    return save(small_convnet(), d / "m.onnx"), str(d / "imgs"), write_config(d / "cfg.toml")


def _table(model, data, cfg, workdir, ray_address=None) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(model, data, CalibrateOptions(cfg, threads=2, show_progress=False, ray=ray_address), workdir,
                  say=lambda s: None)
    with open(os.path.join(workdir, "calibration.json"), "rb") as f:
        return f.read()


def test_commands_import_no_ray():
    code = ("import sys; import qtool.__main__, qtool.commands.calibrate, qtool.commands.quantize, "
            "qtool.commands.eval, qtool.calibrate.run, qtool.quantize.run; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_calibration_table_identical_to_one_process(cluster, images, tmp_path, monkeypatch):
    model, data, cfg = images
    one = _table(model, data, cfg, tmp_path / "one")
    handed = []
    run_shards = sharded._run_shards
    monkeypatch.setattr(sharded, "_run_shards", lambda workers, nodes, shards, run: handed.append(len(shards))
                        or run_shards(workers, nodes, shards, run))
    assert _table(model, data, cfg, tmp_path / "ray", "local") == one
    monkeypatch.setattr(sharded, "dispatch_order", lambda order: order[::-1])
    assert _table(model, data, cfg, tmp_path / "reversed", "local") == one
    # (the first slice alone, 32 one-slice shards of the batches below 128 samples, then whole batches)
    assert handed[0] > 32 + 2


def _worker_pids(title: str) -> list:
    pids = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if f.read().startswith(title.encode()):
                    pids.append(int(p))
        except (OSError, ValueError):
            continue
    return pids


def test_killed_worker_is_retried(cluster, images, tmp_path):
    model, data, cfg = images
    one = _table(model, data, cfg, tmp_path / "one")
    killed = []

    def kill_one_busy_worker():
        end = time.time() + 60
        while time.time() < end and not killed:
            busy = _worker_pids("ray::ShardWorker.observe")
            if busy:
                os.kill(busy[0], signal.SIGKILL)
                killed.append(busy[0])
            time.sleep(0.005)

    t = threading.Thread(target=kill_one_busy_worker)
    t.start()
    try:
        got = _table(model, data, cfg, tmp_path / "ray", "local")
    finally:
        killed.append(None)  # (stops the thread should the pass have ended first)
        t.join()
    assert killed[0] is not None, "no worker was busy to kill"
    assert got == one


def test_a_lost_worker_ends_with_one_line(cluster):
    @ray.remote(max_restarts=0, max_task_retries=0)
    class Doomed:
        def die(self):
            os._exit(1)

    with pytest.raises(ClusterError) as e:
        gather([Doomed.remote().die.remote()], "calibrate")
    assert "\n" not in str(e.value) and "lost a worker or node" in str(e.value)


def test_int8_identical_with_sensitivity_and_rounding(cluster, tmp_path, monkeypatch):
    """Output-aware rounding (the default: its layers' fits), range tuning, sensitivity and --exclude-sensitive
    (its models), whose experiments run on the workers: the sensitivity figures and the int8 model are the
    same as in one process."""
    model, _ = deep_chain.deep_chain(60, c=32, hw=48, residual_every=10)
    xs = deep_chain.sample_inputs(16, 32, 48)
    work = calibrate_samples(model, [{"x": x[None]} for x in xs], tmp_path, method="minmax")
    parts, fits, scored = [], [], []
    split, fit_parts, score_all = experiments.split, experiments.fit_parts, experiments.Scorer.score_all
    monkeypatch.setattr(experiments, "split", lambda run, n: parts.append(len(split(run, n))) or split(run, n))
    monkeypatch.setattr(experiments, "fit_parts", lambda h, layers, n: fits.append(fit_parts(h, layers, n))
                        or fits[-1])
    monkeypatch.setattr(experiments.Scorer, "score_all", lambda self, excls, threads: scored.append(len(excls))
                        or score_all(self, excls, threads))
    options = QuantizeOptions(progress=False, tune_ranges=True, sensitivity=SensitivityOptions(True),
                              exclusion=ExclusionOptions(True, target_agreement=1.0, max_excluded=2))
    results = {}
    for name, address in (("one", None), ("ray", "local")):
        wd = tmp_path / name
        wd.mkdir()
        for f in os.listdir(work):
            if os.path.isfile(os.path.join(work, f)):
                shutil.copy(os.path.join(work, f), wd / f)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = quantize(str(wd), dataclasses.replace(options, ray=address), say=lambda s: None)
        results[name] = (r.sensitivity["layers"], (wd / "model.int8.onnx").read_bytes())
    assert max(parts) > 1  # (the experiments were split over the workers)
    assert fits and all(len(p) == 2 and p[0] and p[1] for p in fits)  # (the rounding fits: on both workers)
    assert scored and max(scored) > 1  # (the exclusion search's models: built and run by the workers)
    assert results["ray"][0] == results["one"][0]
    assert results["ray"][1] == results["one"][1]


def test_covariances_identical_on_workers(cluster, monkeypatch):
    """Output-aware rounding's input covariances, each worker summing its share of the layers (the others'
    positions drawn all the same): every covariance the bits one process computes."""
    import numpy as np
    from qtool.quantize.rounding import layer_hessians
    model, _ = deep_chain.deep_chain(40, c=32, hw=48, residual_every=10)
    feeds = [{"x": x[None]} for x in deep_chain.sample_inputs(6, 32, 48)]
    here = layer_hessians(model, feeds)
    fell_back = []
    monkeypatch.setattr(experiments, "layer_hessians", lambda *a, **k: fell_back.append(1) or layer_hessians(*a, **k))
    with experiments.on_cluster(None) as there:
        got = there.hessians(model, feeds)
    assert not fell_back and list(got) == list(here) and len(here) > 2
    assert all(np.array_equal(got[k], here[k]) for k in here)


def _figures(r: dict) -> str:
    """eval's figures but the latency (timed on the driver: one machine's speed, never the same twice)."""
    from qtool.modelio import json_safe
    return json.dumps(json_safe({k: v for k, v in r.items() if k != "latency_ms"}), sort_keys=True)


def test_eval_figures_identical_to_one_process(cluster, images, tmp_path, monkeypatch):
    """eval's runs over the samples on two workers: images (the native runtime beside ORT, the exact check)
    and tensors give every figure one process gives."""
    from qtool.evaluate import EvalOptions, evaluate_workdir
    from qtool.evaluate import sharded as eval_sharded
    model, data, cfg = images
    _table(model, data, cfg, tmp_path / "img")
    small = calibrated_convnet(tmp_path / "npy", 40)
    handed = []
    outputs = eval_sharded.Workers.outputs
    monkeypatch.setattr(eval_sharded.Workers, "outputs",
                        lambda self, batches: handed.append(len(self.workers)) or outputs(self, batches))
    for work, ev in ((str(tmp_path / "img"), data), (small, os.path.join(os.path.dirname(small), "data"))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize(work, QuantizeOptions(progress=False), say=lambda s: None)
            got = [_figures(evaluate_workdir(work, ev, options=EvalOptions(threads=1, runtime="both", ray=address),
                                             show_progress=False, say=lambda s: None))
                   for address in (None, "local")]
        assert got[0] == got[1]
        assert json.loads(got[1])["runtime_check"]["checked"] > 0  # (the exact check's runs were the workers' too)
    assert handed == [2, 2]
