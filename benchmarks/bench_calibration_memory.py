#!/usr/bin/env python3
"""Calibration memory and time: qtool's percentile calibration of ResNet-50 over N images,
against plain fp32 ONNX Runtime inference over the same images, in one run.

Each side runs in its own process so its peak resident memory is its own (VmHWM: ru_maxrss
would also count the parent's memory, which a child inherits until it execs);
both include reading and preprocessing the images the same way. With --repeat 2 (the default)
the sides run in the order ORT, qtool, qtool, ORT, and the time ratio is total qtool time over
total ORT time: this machine's speed drifts by tens of percent over minutes, and the mirrored
order cancels a steady drift that a single ORT-then-qtool pair would book to one side. The model is
ResNet-50 v1.5 with BatchNorm unfolded, written by benchmarks/resnet50_builder.py from
seeded weights (never a downloaded file).

  python benchmarks/bench_calibration_memory.py --images DIR [--n 1000] [--out bench_out]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu():
    """CPU seconds of this process, all threads: a second view of the cost that load from
    other processes on the machine disturbs less than wall time."""
    import resource
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _peak_rss_mb():
    """This process's peak resident memory since it started this program."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_ort(model, images, n, batch):

    from qtool.ortsession import session
    from qtool.data.config import load_config
    from qtool.data.images import ImageStream, list_images
    t = time.time()
    s = session(model)
    files = list_images(images)[:n]
    count = 0
    for _, x in ImageStream(files, load_config("imagenet-torchvision"), batch=batch):
        s.run(None, {"input": x})
        count += len(x)
    secs = time.time() - t
    return {"seconds": secs, "cpu_seconds": _cpu(), "images": count,
            "peak_rss_mb": _peak_rss_mb()}


def child_qtool(model, images, n, batch):
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions, Sampling
    work = tempfile.mkdtemp(prefix="qtool-calmem-")
    t = time.time()
    r = calibrate(model, images,
                  CalibrateOptions(config="imagenet-torchvision", method="percentile",
                                   sampling=Sampling(batch=batch, limit=n), show_progress=False),
                  workdir=work)
    secs = time.time() - t
    return {"seconds": secs, "cpu_seconds": _cpu(), "images": r.table.n_samples, "tensors": len(r.table.histograms),
            "peak_rss_mb": _peak_rss_mb()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", required=True)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--model", help="ResNet-50 ONNX (default: build one with resnet50_builder.py)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each side, in mirrored order (default 2)")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--child", choices=["ort", "qtool"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        fn = child_ort if a.child == "ort" else child_qtool
        print(json.dumps(fn(a.model, a.images, a.n, a.batch)))
        return 0
    os.makedirs(a.out, exist_ok=True)
    model = a.model
    if not model:
        sys.path.insert(0, HERE)
        from resnet50_builder import build_resnet50
        model = os.path.join(tempfile.mkdtemp(prefix="qtool-r50-"), "resnet50.onnx")
        build_resnet50(model, seed=0)
    runs = {"ort": [], "qtool": []}
    order = []
    for r in range(max(1, a.repeat)):
        order += ["ort", "qtool"] if r % 2 == 0 else ["qtool", "ort"]
    for side in order:
        out = subprocess.run([sys.executable, __file__, "--child", side, "--model", model, "--images", a.images,
                              "--n", str(a.n), "--batch", str(a.batch)], capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return 1
        runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def total(side, key):
        return sum(r[key] for r in runs[side])

    o, q = runs["ort"], runs["qtool"]

    def secs(rs):
        return ", ".join(f"{r['seconds']:.1f}" for r in rs)

    res = {"order": order, "runs": runs, "images": q[0]["images"], "tensors": q[0]["tensors"],
           "time_ratio": total("qtool", "seconds") / total("ort", "seconds"),
           "cpu_ratio": total("qtool", "cpu_seconds") / total("ort", "cpu_seconds"),
           "ort_peak_rss_mb": max(r["peak_rss_mb"] for r in o), "qtool_peak_rss_mb": max(r["peak_rss_mb"] for r in q)}
    print(f"ResNet-50 v1.5 (BatchNorm unfolded), {res['images']} images, batch {a.batch}, "
          f"runs in order {', '.join(order)}:")
    print(f"  ORT fp32 inference:           {secs(o)} s  "
          f"peak RSS {res['ort_peak_rss_mb']:7.0f} MB")
    print(f"  qtool percentile calibration: {secs(q)} s  "
          f"peak RSS {res['qtool_peak_rss_mb']:7.0f} MB ({res['tensors']} tensors observed)")
    print(f"  time ratio qtool / ORT fp32: {res['time_ratio']:.2f}x (goal <= 1.5x); peak RSS goal < 1536 MB")
    print(f"  CPU time (all threads): ORT {total('ort', 'cpu_seconds'):.1f} s, qtool {total('qtool', 'cpu_seconds'):.1f} s, "
          f"ratio {res['cpu_ratio']:.2f}x; load average at the end {os.getloadavg()[0]:.1f}")
    with open(os.path.join(a.out, "calibration_memory.json"), "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
