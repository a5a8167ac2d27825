#!/usr/bin/env python3
"""A catalogue of models (`qtool batch`) on one process, on a local Ray cluster and on a two-node Ray
cluster on this machine (a head plus a second `ray start --address` node, bench_ray.py's): wall time, peak
memory per worker, Ray's start-up and the serial fraction, side by side; and whether every mode wrote
the same int8 models and eval figures.

Each run is a fresh `qtool batch` process, the modes in turn, mirrored on the next repeat. A worker is
what runs the jobs: in one process the batch itself, whose steps are its child processes; on Ray each
worker process that ran a job (`ray::_job`). Its peak is the most its process tree (the worker and the
step it runs) held at once, sampled from /proc every 0.1 s. The serial part of a run is what its driver
does alone: the process's start, reading and checking the catalogue, Ray's start and stop, the table
(batch.json's "phases": everything but "jobs"); the jobs are the parallel part. A model is one task, so
N nodes take at least the longest job:
    T(N) = serial + max(sum of the jobs / N, the longest job).

The zoo as the catalogue (bench_zoo.py writes it, its paths through $QTOOL_ZOO and $ZOO_DATA):
  python benchmarks/bench_zoo.py --shared ../shared --catalogue zoo.toml --mem-limit-gb 2
  QTOOL_ZOO=... ZOO_DATA=... python benchmarks/bench_ray_catalogue.py --catalogue zoo.toml [--models a,b] --out bench_out
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from bench_ray import AUTH, _ancestors, _peak_kb, _titled, print_table, run_modes

QTOOL = [sys.executable, "-m", "qtool"]
JOB_TITLE = "ray::_job"  # a Ray worker process while it runs a catalogue's job (qtool/batch/on_ray.py)


def _tree_kb() -> tuple:
    """({pid: resident kB}, {pid: parent pid}) of every process here."""
    rss, parent = {}, {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                parent[int(p)], rss[int(p)] = int(fields[1]), int(fields[21]) * os.sysconf("SC_PAGE_SIZE") // 1024
            except (OSError, ValueError, IndexError):
                continue
    return rss, parent


class TreePeaks(threading.Thread):
    """The peak of each worker's process tree while the run lasts (the driver's own VmHWM too). Workers:
    the driver itself without its own memory (one process: its steps), or the Ray processes that ran a job,
    started by the driver (a local cluster) or by the benchmark's nodes (`ours`)."""

    def __init__(self, driver: int, on_ray: bool, ours):
        super().__init__(daemon=True)
        self.driver, self.on_ray, self.ours, self.done = driver, on_ray, ours, False
        self.workers, self.driver_kb, self.seen = {}, 0, set()

    def run(self):
        while not self.done:
            self.driver_kb = max(self.driver_kb, _peak_kb(self.driver))
            rss, parent = _tree_kb()
            children = {}
            for pid, pp in parent.items():
                children.setdefault(pp, []).append(pid)
            if self.on_ray:
                mine = set(self.ours())
                self.seen |= {p for p in _titled(JOB_TITLE) if p in mine or self.driver in _ancestors(p)}
                roots = {p: rss.get(p, 0) for p in self.seen}
            else:
                roots = {self.driver: 0}  # (its steps: the driver's own memory is the driver's column)
            for root, own in roots.items():
                kb, todo = own, list(children.get(root, []))
                while todo:
                    p = todo.pop()
                    kb += rss.get(p, 0)
                    todo += children.get(p, [])
                self.workers[root] = max(self.workers.get(root, 0), kb)
            time.sleep(0.1)


def run_batch(catalogue: str, models: list, out: str, ray: str | None, ours=list) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = QTOOL + ["batch", catalogue, "--out", out, "-q"] + [a for m in models for a in ("--only", m)]
    cmd += ["--ray", ray] if ray else []
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **AUTH})
    peaks = TreePeaks(proc.pid, ray is not None, ours)
    peaks.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - t
    peaks.done = True
    peaks.join()
    try:
        with open(os.path.join(out, "batch.json"), encoding="utf-8") as f:
            doc = json.load(f)
    except OSError:
        raise SystemExit(f"{' '.join(cmd)} wrote no table (exit {proc.returncode}):\n{err}") from None
    jobs = [sum(s["seconds"] for s in r["steps"].values()) for r in doc["rows"]]
    phases = doc.get("phases", {})
    parallel = phases.get("jobs", 0.0)
    if proc.returncode not in (0, 1):  # (1: a model failed, its row says why; the table is compared all the same)
        print(f"  {' '.join(cmd)}: exit {proc.returncode}: {err.strip()[-500:]}", flush=True)
    return {"wall": wall, "rc": proc.returncode, "phases": phases, "parallel": parallel, "serial": wall - parallel,
            "ray_startup": phases.get("ray start", 0.0), "jobs_s": jobs,
            "driver_peak_mb": peaks.driver_kb / 1024,
            "worker_peak_mb": [kb / 1024 for kb in sorted(v for v in peaks.workers.values() if v)],
            "results": {r["name"]: _result(r) for r in doc["rows"]}}


def _result(row: dict) -> dict:
    """What must not depend on where the job ran: the status, the int8 model's bytes, eval's figures."""
    digest = None
    if row.get("int8") and os.path.isfile(row["int8"]):
        with open(row["int8"], "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    return {"status": row["status"], "int8_sha256": digest, "eval": row.get("eval")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--catalogue", required=True, help="a `qtool batch` catalogue (bench_zoo.py --catalogue writes the zoo's)")
    p.add_argument("--models", default="", help="comma-separated: only these models of it (qtool batch --only)")
    p.add_argument("--modes", default="one,local,two-node")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--port", type=int, default=6392, help="the two-node cluster's head port")
    p.add_argument("--out", default="bench_out")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="qtool-bench-ray-catalogue-")
    catalogue = os.path.abspath(a.catalogue)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    order, runs = run_modes(a.modes.split(","), a.repeat, a.port, tmp, lambda m, address, ours: run_batch(
        catalogue, models, os.path.join(tmp, f"out-{m}"), address, ours))
    results = [json.dumps(r["results"], sort_keys=True) for rs in runs.values() for r in rs]
    res = {"catalogue": catalogue, "models": models, "order": order, "runs": runs, "load_average": os.getloadavg(),
           "results_identical": len(set(results)) == 1}
    best = {m: min(rs, key=lambda r: r["wall"]) for m, rs in runs.items()}
    n = len(next(iter(best.values()))["results"])
    print(f"qtool batch, {n} models ({', '.join(models) or 'the whole catalogue'}), modes in order {', '.join(order)} "
          f"(load average {res['load_average'][0]:.1f} on {os.cpu_count()} cores):")
    print_table(best, "jobs s")
    print(f"  int8 models, statuses and eval figures identical across every run: {res['results_identical']}")
    res["projection"] = {}
    for m, r in best.items():
        work, longest = sum(r["jobs_s"]), max(r["jobs_s"], default=0.0)
        proj = {k: r["serial"] + max(work / k, longest) for k in (1, 8, 64)}
        res["projection"][m] = {"serial_fraction": r["serial"] / r["wall"], "jobs_sum_s": work, "longest_job_s": longest,
                                "seconds": proj}
        print(f"  {m}: serial fraction {r['serial'] / r['wall']:.2f}; jobs {work:.1f} s in all, the longest "
              f"{longest:.1f} s; N machines like this one: " + ", ".join(f"{k}: {t:.1f} s" for k, t in proj.items()))
    with open(os.path.join(a.out, "bench_ray_catalogue.json"), "w") as f:
        json.dump(res, f, indent=2)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
