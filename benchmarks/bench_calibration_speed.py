#!/usr/bin/env python3
"""`qtool calibrate` against the fp32 pass alone, on the same images, in one run.

The fp32 pass is the floor of calibration: each image decoded (qtool's own load_image, the
preprocessing calibrate uses) and run once through the fp32 model in ONNX Runtime, on every core.
Both sides are whole processes timed from the outside (interpreter start and imports included: a
user waits for them too), at each number of images; the sides alternate in mirrored order (fp32,
qtool, qtool, fp32) so the machine's speed drift cancels. Printed per model and size: both times,
their ratio (and the ratio of their CPU seconds, which other load on the machine disturbs less),
calibrate's peak RSS, and calibrate's fixed cost (its time at the smallest size minus
the fp32 pass's there), with calibrate's own time per phase (`qtool calibrate -v --json`).

ResNet-50 is built from seeded weights by resnet50_builder.py (never a downloaded file); other
models are paths given with their preprocessing preset.

  python benchmarks/bench_calibration_speed.py --images DIR [--sizes 20,100,1000]
      [--model PATH:PRESET ...] [--no-resnet50] [--repeat 2] [--parts 40] [--out bench_out]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child_fp32(model: str, images: str, n: int, preset: str, batch: int) -> dict:
    """The fp32 pass alone: decode n images as calibrate does, run each batch once."""
    from qtool.data.config import config_from_any
    from qtool.data.images import ImageStream, list_images
    from qtool.ortsession import session
    import onnx
    s = session(model)
    cfg = config_from_any(preset)
    name = onnx.load(model, load_external_data=False).graph.input[0].name
    count = 0
    for _, x in ImageStream(list_images(images)[:n], cfg, batch=batch):
        s.run(None, {name: x})
        count += len(x)
    return {"images": count}


def child_parts(model: str, images: str, n: int, preset: str, batch: int) -> dict:
    """Where calibrate's time per image goes beside the fp32 pass's, in CPU milliseconds per image (one
    thread each, so other load on the machine disturbs it little): decoding; the fused graph in ONNX Runtime
    alone, and with the tensors calibrate observes as outputs bound to buffers (as collect.py runs it: the
    output copies ONNX Runtime makes, and the fusions it cannot do, e.g. a Conv into the residual Add that
    reads it); folding those outputs into the statistics (with the channel sums of the first samples, and
    without them). What calibrate observes is what a calibration of `n` images wrote."""
    import numpy as np
    import onnx
    from qtool.calibrate.bound_runner import BoundRunner
    from qtool.calibrate.observed import MEAN_SAMPLES, Observed, observe
    from qtool.calibrate.histogram import Histogram
    from qtool.calibrate.table import load_table
    from qtool.data.config import config_from_any
    from qtool.data.images import ImageStream, list_images
    from qtool.ortsession import session, with_outputs
    work = tempfile.mkdtemp(prefix="qtool-calparts-")
    qtool = os.path.join(os.path.dirname(sys.executable), "qtool")
    subprocess.run([qtool, "calibrate", "--model", model, "--data", images, "--config", preset, "--limit", str(n),
                    "-w", work, "-q"], check=True)
    fused = onnx.load(os.path.join(work, "fused.onnx"))
    table = load_table(os.path.join(work, "calibration.json"))
    inputs = {i.name for i in fused.graph.input}
    observed = [t for t in table.histograms if t not in inputs]
    means = [t for t in table.channel_means if t in observed]
    name = next(iter(inputs))
    cpu = time.process_time
    t0 = cpu()
    xs = [x[i:i + 1].copy() for _, x in ImageStream(list_images(images)[:n], config_from_any(preset), batch=batch)
          for i in range(len(x))]
    out = {"images": len(xs), "decode_ms": 1000 * (cpu() - t0) / len(xs), "tensors": len(observed),
           "mean_samples": MEAN_SAMPLES}
    plain = session(os.path.join(work, "fused.onnx"), 1, spin=False)
    bound = BoundRunner(session(with_outputs(fused, observed), 1, spin=False), observed)
    bound.run({name: np.concatenate(xs[:2])})  # (the first runs size the bound buffers)
    bound.run({name: xs[0]})
    plain.run(None, {name: xs[0]})

    def per_image(f):
        best = None
        for _ in range(2):
            t = cpu()
            for k, x in enumerate(xs):
                f(k, x)
            best = min(best or 1e9, 1000 * (cpu() - t) / len(xs))
        return best

    out["fused_run_ms"] = per_image(lambda k, x: plain.run(None, {name: x}))
    out["observed_run_ms"] = per_image(lambda k, x: bound.run({name: x}))
    outs = [list(bound.run({name: x})) for x in xs[:8]]
    for label, m, first in (("observe_with_means_ms", means, 0), ("observe_ms", [], MEAN_SAMPLES)):
        obs = Observed({t: Histogram() for t in observed})
        out[label] = per_image(lambda k, x: observe(obs, dict(zip(observed, outs[k % len(outs)])), observed, m, 1,
                                                       first + k))
    return out


def run_side(side: str, model: str, preset: str, images: str, n: int, batch: int, qtool: str) -> dict:
    """One process, timed from outside -> seconds, peak RSS (MB), and calibrate's own JSON."""
    work = tempfile.mkdtemp(prefix="qtool-calspeed-")
    js = os.path.join(work, "summary.json")
    if side == "fp32":
        cmd = [sys.executable, __file__, "--child", model, "--images", images, "--n", str(n), "--preset", preset,
               "--batch", str(batch)]
    else:
        cmd = [qtool, "calibrate", "--model", model, "--data", images, "--config", preset, "--limit", str(n),
               "--batch", str(batch), "-w", os.path.join(work, "w"), "-q", "-v", "--json", js]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)  # reaped here: its rusage is this one child's (peak RSS)
        secs = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode:
            err.seek(0)
            sys.exit(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{err.read()}")
    res = {"seconds": secs, "cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024}
    if side == "qtool":
        with open(js) as f:
            summary = json.load(f)
        res.update(images=summary["n_samples"], phases=summary.get("phases", {}))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", required=True)
    ap.add_argument("--sizes", default="20,100,1000")
    ap.add_argument("--model", action="append", default=[], help="PATH:PRESET of another model (repeatable)")
    ap.add_argument("--no-resnet50", action="store_true", help="skip the seeded ResNet-50")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each side per size, in mirrored order")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--parts", type=int, default=40, metavar="N",
                    help="then where the time per image goes, on N images (CPU ms, one thread each); 0: skip")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--parts-child", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--preset", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child_fp32(a.child, a.images, a.n, a.preset, a.batch)))
        return 0
    if a.parts_child:
        print(json.dumps(child_parts(a.parts_child, a.images, a.n, a.preset, a.batch)))
        return 0
    qtool = os.path.join(os.path.dirname(sys.executable), "qtool")
    sizes = [int(s) for s in a.sizes.split(",")]
    models = []
    if not a.no_resnet50:  # built in a process of its own: a child forked from a parent that held the
        # builder's GB would count them in its peak RSS until it execs
        path = os.path.join(tempfile.mkdtemp(prefix="qtool-r50-"), "resnet50.onnx")
        subprocess.run([sys.executable, os.path.join(HERE, "resnet50_builder.py"), "--out", path, "--seed", "0"],
                       check=True, capture_output=True)
        models.append(("ResNet-50 (seeded)", path, "imagenet-torchvision"))
    for spec in a.model:
        path, _, preset = spec.rpartition(":")
        models.append((os.path.basename(path), path, preset))
    os.makedirs(a.out, exist_ok=True)
    info = subprocess.run([qtool, "info"], capture_output=True, text=True).stdout.strip().splitlines()
    results = {"cpu": info[:3], "models": {}}
    for label, path, preset in models:
        rows = []
        for n in sizes:
            order = []
            for r in range(max(1, a.repeat)):
                order += ["fp32", "qtool"] if r % 2 == 0 else ["qtool", "fp32"]
            runs = {"fp32": [], "qtool": []}
            for side in order:
                runs[side].append(run_side(side, path, preset, a.images, n, a.batch, qtool))
            f = sum(r["seconds"] for r in runs["fp32"]) / len(runs["fp32"])
            q = sum(r["seconds"] for r in runs["qtool"]) / len(runs["qtool"])
            fc = sum(r["cpu_seconds"] for r in runs["fp32"]) / len(runs["fp32"])
            qc = sum(r["cpu_seconds"] for r in runs["qtool"]) / len(runs["qtool"])
            phases = {k: min(r["phases"].get(k, 0.0) for r in runs["qtool"]) for k in runs["qtool"][0]["phases"]}
            row = {"images": runs["qtool"][0]["images"], "fp32_seconds": f, "calibrate_seconds": q, "ratio": q / f,
                   "fp32_cpu_seconds": fc, "calibrate_cpu_seconds": qc, "cpu_ratio": qc / fc,
                   "calibrate_peak_rss_mb": max(r.get("peak_rss_mb", 0) for r in runs["qtool"]),
                   "fp32_peak_rss_mb": max(r.get("peak_rss_mb", 0) for r in runs["fp32"]),
                   "order": order, "runs": runs, "calibrate_phases_min": phases}
            rows.append(row)
            print(f"{label}, {row['images']} images: fp32 pass {f:.1f} s, calibrate {q:.1f} s, "
                  f"ratio {row['ratio']:.2f}x (CPU time {qc:.1f} / {fc:.1f} s: {row['cpu_ratio']:.2f}x), "
                  f"calibrate peak RSS {row['calibrate_peak_rss_mb']:.0f} MB (fp32 pass {row['fp32_peak_rss_mb']:.0f} MB)",
                  flush=True)
            print("    calibrate's phases (fastest run): "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()), flush=True)
        first = rows[0]
        fixed = first["calibrate_seconds"] - first["fp32_seconds"]
        ratios = ", ".join(f"{r['images']}: {r['ratio']:.2f}x" for r in rows)
        print(f"{label}: fixed cost (calibrate minus fp32 pass at {first['images']} images) {fixed:.1f} s; "
              f"ratios {ratios}; load average at the end {os.getloadavg()[0]:.1f}", flush=True)
        results["models"][label] = {"rows": rows, "fixed_cost_seconds": fixed}
        if a.parts:
            got = subprocess.run([sys.executable, __file__, "--parts-child", path, "--images", a.images, "--n",
                                  str(a.parts), "--preset", preset, "--batch", str(a.batch)],
                                 check=True, capture_output=True, text=True)
            p = json.loads(got.stdout.strip().splitlines()[-1])
            extra = p["observed_run_ms"] - p["fused_run_ms"]
            print(f"{label}: per image, CPU ms on one thread ({p['images']} images): decode {p['decode_ms']:.1f}; fused "
                  f"graph {p['fused_run_ms']:.1f}, with its {p['tensors']} observed tensors as outputs "
                  f"{p['observed_run_ms']:.1f} (+{extra:.1f}, +{100 * extra / p['fused_run_ms']:.0f} %); observing "
                  f"them {p['observe_ms']:.1f} (+{100 * p['observe_ms'] / p['fused_run_ms']:.0f} %), "
                  f"{p['observe_with_means_ms']:.1f} with the channel sums of the first {p['mean_samples']} samples", flush=True)
            results["models"][label]["per_image_cpu_ms"] = p
    with open(os.path.join(a.out, "calibration_speed.json"), "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
