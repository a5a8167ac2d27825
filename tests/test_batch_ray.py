"""`qtool batch` on a local Ray cluster of 2 worker processes (started here): one task per model, the same
table as the local run (every figure that does not depend on timing, a corrupt model's row included), the
same int8 bytes; a model asking more memory than any node has is a row, not a wait without end."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import ray

from qtool.batch.run import BatchOptions
from qtool.commands.batch import run_catalogue as run_batch
from qtool.distributed.cluster import LOCAL
from test_batch import FIGURES, MODEL, catalogue, models, three  # noqa: F401 - (models: the fixture)
from test_cli import qtool


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def figures(rows):
    return [{k: r[k] for k in FIGURES + ("reason",)} for r in rows]


def test_ray_table_equals_the_local_one(models, tmp_path, cluster):
    cat = three(models)
    local = run_batch(str(cat), BatchOptions(str(tmp_path / "local")))
    assert qtool("batch", cat, "--out", tmp_path / "ray", "--ray", "-q") == 1  # (the corrupt model's row)
    with open(tmp_path / "ray" / "batch.json", encoding="utf-8") as f:
        on_ray = json.load(f)["rows"]
    assert figures(on_ray) == figures(local)
    assert [r["status"] for r in on_ray] == ["ok", "failed", "ok"]
    for a, b in zip(local, on_ray):
        if a["int8"]:
            assert open(a["int8"], "rb").read() == open(b["int8"], "rb").read()
    with open(tmp_path / "ray" / "batch.json", encoding="utf-8") as f:
        doc = json.load(f)
    assert doc["ran"] == "ray local"
    assert list(doc["phases"]) == ["plan", "ray start", "jobs", "ray stop"]  # (the driver's time: bench_ray.py reads it)


def test_a_model_larger_than_every_node_is_a_row(models, tmp_path, cluster):
    cat = catalogue(tmp_path, MODEL.format(path=models / "net0.onnx", extra="memory_mb = 100000000")
                    .replace('"calib"', f'"{models / "calib"}"').replace('"eval"', f'"{models / "eval"}"'))
    (row,) = run_batch(str(cat), BatchOptions(str(tmp_path / "out"), ray=LOCAL))
    assert row["status"] == "failed" and row["reason"].startswith("not run: memory_mb 1e+08 is above the largest node")


def _steps_of(folder):
    """(pid, parent pid) of each qtool step running with a working folder under `folder`."""
    found = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{d}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if "qtool" in argv and any(a.startswith(str(folder)) for a in argv):
            found.append((int(d), ppid))
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_a_worker_killed_mid_job_is_retried_and_the_table_is_the_same(models, tmp_path, cluster):
    cat = three(models)
    local = run_batch(str(cat), BatchOptions(str(tmp_path / "local")))
    out = tmp_path / "ray"
    result = {}
    t = threading.Thread(target=lambda: result.update(rows=run_batch(str(cat), BatchOptions(str(out), ray=LOCAL))))
    t.start()
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and t.is_alive() and time.monotonic() < deadline:
        running = _steps_of(out / "net0")
        if running:
            step, worker = running[0]
            os.kill(worker, signal.SIGKILL)  # the Ray worker running net0's job, as its step starts
            killed = step
            time.sleep(0.3)  # (a step takes a second or more to import qtool: it would still be running)
            orphan = _alive(step)
        time.sleep(0.02)
    t.join()
    assert killed is not None, "no step of net0 was seen running"
    assert not orphan, "the step went on after its worker died"
    assert figures(result["rows"]) == figures(local)
