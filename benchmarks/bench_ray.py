#!/usr/bin/env python3
"""ResNet-50 calibration on one process, on a local Ray cluster and on a two-node Ray cluster on this
machine (a head plus a second `ray start --address` node): wall time, peak memory per worker, Ray's
start-up and the serial fraction, side by side; and whether every calibration table is the same.

Each run is a fresh `qtool calibrate` process (imports and all), the modes in turn, mirrored on the
next repeat, so a change in the machine's load falls on every mode alike. The serial part of a Ray run
is everything its driver does alone: read, fuse, the stem check, Ray's start (the cluster, the
workers), the first slice (run alone: it sizes every later slice), Ray's stop, the merge, the ranges
and the write; the parallel part is the shards. From them, Amdahl's law projects N nodes, each node
running the shards as fast as this machine ran them:
    T(N) = serial + shards / N.

  python benchmarks/bench_ray.py --images ../shared/imagenet-samples --n 100 --out bench_out
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
QTOOL = [sys.executable, "-m", "qtool"]
MARK = "QTOOL_BENCH_RAY_NODE"  # in the environment of the Ray processes this benchmark starts: how it finds them
PASS = "calibration pass: "


def _peak_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def _titled(prefix: str) -> list:
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if f.read().startswith(prefix.encode()):
                        pids.append(int(p))
            except OSError:
                continue
    return pids


def _ancestors(pid: int) -> set:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return seen


def _marked(value: str) -> list:
    """The processes whose environment holds MARK=value: the Ray nodes this benchmark started."""
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid():
            try:
                with open(f"/proc/{p}/environ", "rb") as f:
                    if f"{MARK}={value}".encode() in f.read().split(b"\0"):
                        pids.append(int(p))
            except OSError:
                continue
    return pids


class Peaks(threading.Thread):
    """Polls the peak resident memory (VmHWM) of the driver and of the run's Ray shard workers while it lasts:
    those the driver started (a local cluster) or the benchmark's nodes did (`ours`: their pids)."""

    def __init__(self, driver: int, ours):
        super().__init__(daemon=True)
        self.driver, self.ours, self.workers, self.done = driver, ours, {}, False
        self.driver_kb = 0

    def run(self):
        while not self.done:
            self.driver_kb = max(self.driver_kb, _peak_kb(self.driver))
            mine = set(self.ours())
            for pid in _titled("ray::ShardWorker"):
                if pid in mine or self.driver in _ancestors(pid):
                    self.workers[pid] = max(self.workers.get(pid, 0), _peak_kb(pid))
            time.sleep(0.1)


def calibrate(model: str, data: str, work: str, ray: str | None, ours=list) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    cmd = QTOOL + ["calibrate", "-m", model, "-d", data, "--config", "imagenet-torchvision", "-w", work, "-q",
                   "--json", os.path.join(work + ".json")] + (["--ray", ray] if ray else [])
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **AUTH})
    peaks = Peaks(proc.pid, ours)
    peaks.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t
    peaks.done = True
    peaks.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    with open(work + ".json") as f:
        summary = json.load(f)
    with open(os.path.join(work, "calibration.json"), "rb") as f:
        table = hashlib.sha256(f.read()).hexdigest()
    phases = summary["phases"]
    inner = {k[len(PASS):]: v for k, v in phases.items() if k.startswith(PASS)}
    parallel = inner.get("shards", phases.get("calibration pass", 0.0))
    return {"wall": wall, "seconds": summary["seconds"], "phases": phases, "table_sha256": table,
            "parallel": parallel, "serial": wall - parallel, "ray_startup": inner.get("ray start", 0.0),
            "driver_peak_mb": peaks.driver_kb / 1024,
            "worker_peak_mb": [kb / 1024 for kb in sorted(peaks.workers.values())]}


# Ray >= 2.59 turns token authentication on for a head started where a token exists (~/.ray/auth_token,
# which ray.init writes); a node joining it and a driver connecting to it then need RAY_AUTH_MODE=token too
AUTH = {"RAY_AUTH_MODE": "token"}


def start_two_nodes(port: int, temp: str) -> str:
    """A head and a second node, one CPU each (this machine's two cores), on `port`; their files in `temp`
    (not Ray's default folder, whose record of the current cluster `auto` reads)."""
    env = {**os.environ, **AUTH, MARK: str(port)}
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    common = ["--num-cpus", "1", "--disable-usage-stats", "--node-ip-address", "127.0.0.1"]
    subprocess.run([ray_bin, "start", "--head", "--port", str(port), "--include-dashboard", "false",
                    "--temp-dir", temp] + common, env=env, check=True, capture_output=True)
    subprocess.run([ray_bin, "start", "--address", f"127.0.0.1:{port}"] + common, env=env, check=True,
                   capture_output=True)
    return f"127.0.0.1:{port}"


def stop_nodes(port: int) -> None:
    """Only the processes this benchmark started (never `ray stop`, which stops every cluster here)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _marked(str(port)):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        time.sleep(2)


def print_table(best: dict, parallel: str) -> None:
    """Each mode's best run side by side: wall, serial, the parallel part (named `parallel`), Ray's start,
    the driver's and each worker's peak memory."""
    print(f"  {'mode':10} {'wall s':>7} {'serial s':>9} {parallel:>9} {'ray start s':>12} "
          f"{'driver MB':>10} {'worker peak MB':>16}")
    for m, r in best.items():
        wp = ", ".join(f"{x:.0f}" for x in r["worker_peak_mb"]) or "-"
        print(f"  {m:10} {r['wall']:7.1f} {r['serial']:9.1f} {r['parallel']:9.1f} {r['ray_startup']:12.1f} "
              f"{r['driver_peak_mb']:10.0f} {wp:>16}")


def run_modes(modes: list, repeat: int, port: int, tmp: str, run) -> tuple:
    """(the order the modes ran in, {mode: [each repeat's run(mode, address, ours)]}): "one" (no Ray), "local"
    (a local cluster) or "two-node" (start_two_nodes on `port`, started once and stopped at the end; `ours()`:
    its processes), in turn, mirrored on every other repeat. A run is a dict with its "wall" seconds."""
    order = [m for r in range(repeat) for m in (modes if r % 2 == 0 else modes[::-1])]
    runs = {m: [] for m in modes}
    two = None
    try:
        for m in order:
            address = None if m == "one" else "local" if m == "local" else (two or start_two_nodes(port, os.path.join(tmp, "ray")))
            two = address if m == "two-node" else two
            runs[m].append(run(m, address, lambda: _marked(str(port))))
            print(f"  {m}: {runs[m][-1]['wall']:.1f} s", flush=True)
    finally:
        if "two-node" in modes:  # (also after a failed start: whatever of it runs)
            stop_nodes(port)
    return order, runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", required=True)
    p.add_argument("--n", type=int, default=1000, help="images (the first N of the sorted folder)")
    p.add_argument("--model", help="ResNet-50 ONNX (default: build one with resnet50_builder.py)")
    p.add_argument("--modes", default="one,local,two-node")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--port", type=int, default=6391, help="the two-node cluster's head port")
    p.add_argument("--out", default="bench_out")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="qtool-bench-ray-")
    model = a.model
    if not model:
        sys.path.insert(0, HERE)
        from resnet50_builder import build_resnet50
        model = build_resnet50(os.path.join(tmp, "resnet50.onnx"), seed=0)
    data = os.path.join(tmp, "images")
    os.makedirs(data)
    files = sorted(f for f in os.listdir(a.images) if f.lower().endswith((".jpeg", ".jpg", ".png")))[:a.n]
    for f in files:
        os.symlink(os.path.abspath(os.path.join(a.images, f)), os.path.join(data, f))
    order, runs = run_modes(a.modes.split(","), a.repeat, a.port, tmp,
                            lambda m, address, ours: calibrate(model, data, os.path.join(tmp, f"work-{m}"), address, ours))
    res = {"images": len(files), "order": order, "runs": runs, "load_average": os.getloadavg(),
           "tables_identical": len({r["table_sha256"] for rs in runs.values() for r in rs}) == 1}
    best = {m: min(rs, key=lambda r: r["wall"]) for m, rs in runs.items()}
    print(f"ResNet-50 calibration, {len(files)} images, modes in order {', '.join(order)} "
          f"(load average {res['load_average'][0]:.1f} on {os.cpu_count()} cores):")
    print_table(best, "shards s")
    print(f"  calibration tables identical across every run: {res['tables_identical']}")
    res["projection"] = {}
    for m in [m for m in best if m != "one"]:
        r = best[m]
        f = r["serial"] / r["wall"]
        proj = {n: r["serial"] + r["parallel"] / n for n in (1, 8, 64)}
        res["projection"][m] = {"serial_fraction": f, "seconds": proj}
        print(f"  {m}: serial fraction {f:.2f}; Amdahl, N machines like this one: "
              + ", ".join(f"{n}: {t:.1f} s" for n, t in proj.items()) + f" (one process: {best['one']['wall']:.1f} s)"
              if "one" in best else "")
    with open(os.path.join(a.out, "bench_ray.json"), "w") as f:
        json.dump(res, f, indent=2)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
