#!/usr/bin/env python3
"""The same int8 classifier on every CPU: each --target's model under each arithmetic, and its ORT speed.

Calibrates on the calibration split of an ImageNet-style folder (sorted index % 10 == 0), quantizes
once per target (`qtool quantize --target T` with the default options, no sensitivity; with --tuned also
with `--tune-ranges`), and judges on the other images:

- accuracy against the labels, top-1 agreement with fp32 (with a 95 % interval: a few hundred
  images resolve agreement to a few tenths of a point) and output SQNR, under
  * exact:           the int8 model as it is defined (ORT on a CPU with VNNI/AMX/ARM dot products, or
                     qtool's runtime anywhere; here qtool's runtime),
  * ort-x86-novnni:  what ONNX Runtime computes on x86 without VNNI, emulated bit for bit
                     (qtool/arithmetic.py): what a user of an AMD Zen 2/3 or older Intel CPU gets,
  * this ORT:        this machine's ONNX Runtime, whichever of the two it is;
- ONNX Runtime int8 latency of every target's model at batch 1 and 8, measured in interleaved rounds
  in one run (ratios against the vnni target's model).

A model whose weights can saturate under the emulated arithmetic runs its saturating layers in numpy
there: --emulate-limit caps the images for those (others are exact under both, and run natively).

  python benchmarks/bench_targets.py --model ../shared/models/efficientnet-lite0.onnx \\
      --images ../shared/imagenet-samples --config efficientnet-lite
"""
import argparse
import json
import os
import sys
import tempfile
import time
import warnings

import numpy as np
import onnxruntime as ort

import imagenet_split as split
from qtool.arithmetic import ARITHMETICS
from qtool.data.config import load_config
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions, Sampling
from qtool.metrics import sqnr_db, top1_agreement, wilson
from qtool.ort_arithmetic import ort_int8_arithmetic
from qtool.quantize.encoding import TARGETS
from qtool.quantize.run import quantize
from qtool.runtime import NativeSession
from qtool.quantize.options import QuantizeOptions, SensitivityOptions


def run_all(sess, feeds):
    name = sess.get_outputs()[0].name
    return np.concatenate([sess.run([name], f)[0] for f in feeds])


def ort_session(path, threads):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def judge(ref, out, y):
    n = len(out)
    agree = int((ref[:n].argmax(1) == out.argmax(1)).sum())
    lo, hi = wilson(agree, n)
    return {"images": n, "top1_agreement": agree / n, "agreement_95": [lo, hi],
            "top1": float((out.argmax(1) == y[:n]).mean()),
            "delta_pt": 100 * float((out.argmax(1) == y[:n]).mean() - (ref[:n].argmax(1) == y[:n]).mean()),
            "sqnr_db": sqnr_db(ref[:n], out)}


def latency(sessions, x, repeats, rounds=5):
    """Median ms per image for each session on input x, in interleaved rounds (the host's drift is shared)."""
    name = {k: s.get_inputs()[0].name for k, s in sessions.items()}
    times = {k: [] for k in sessions}
    for s in sessions.values():
        s.run(None, {s.get_inputs()[0].name: x})
    for _ in range(rounds):
        for k, s in sessions.items():
            time.sleep(0.1)  # ORT's workers spin after a run; let them settle before the next engine
            for _ in range(repeats):
                t = time.perf_counter()
                s.run(None, {name[k]: x})
                times[k].append((time.perf_counter() - t) * 1000 / len(x))
    return {k: float(np.median(v)) for k, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--config", default="efficientnet-lite")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--emulate-limit", type=int, default=150,
                   help="images for a model that saturates under the emulated arithmetic (numpy layers)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--method", default="auto", help="calibrate --method (auto, the default: quantize measures)")
    p.add_argument("--rounding", choices=["output", "nearest"], default="output",
                   help="quantize --rounding (output is the default)")
    p.add_argument("--tuned", action="store_true",
                   help="also each target with tuned ranges (quantize --tune-ranges), as '<target>+tuned'")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--results", help="folder of the results files `make results` reads (default: benchmarks/results)")
    a = p.parse_args(argv)
    warnings.simplefilter("ignore")
    os.makedirs(a.out, exist_ok=True)
    here = ort_int8_arithmetic()
    print(f"this CPU's ONNX Runtime int8 arithmetic: {here}")
    cal, evals = split.split(a.images)
    work = tempfile.mkdtemp(prefix="qtool-targets-")
    t = time.time()
    calibrate(a.model, a.images,
              CalibrateOptions(config=a.config, method=a.method,
                               sampling=Sampling(every=split.EVERY), show_progress=False),
              workdir=work)
    print(f"calibrated on {len(cal)} images in {time.time() - t:.1f}s")
    cfg = load_config(a.config)
    xs = split.images(evals, cfg)
    y = split.class_indices(a.images, evals)
    ref_sess = ort_session(a.model, a.threads)
    name = ref_sess.get_inputs()[0].name
    feeds = split.feeds(xs, name)
    ref = run_all(ref_sess, feeds)
    print(f"fp32 top-1 on {len(evals)} images: {(ref.argmax(1) == y).mean():.4f}")
    res, paths = {}, {}
    runs = [(t, False) for t in a.targets.split(",")]
    if a.tuned:
        runs += [(t, True) for t in a.targets.split(",")]
    for base_target, tuned in runs:
        target = base_target + ("+tuned" if tuned else "")
        t = time.time()
        r = quantize(work, QuantizeOptions(output=os.path.join(work, f"{target}.onnx"), target=base_target, rounding=a.rounding == "output", tune_ranges=tuned, progress=False, sensitivity=SensitivityOptions(enabled=False)), say=lambda *_: None)
        paths[target] = r.path
        row = {"quantize_seconds": time.time() - t, "encodings": r.report["encodings"], "method": r.report["method"],
               "rounding": r.report["rounding"]}
        print(f"{target}: quantized in {row['quantize_seconds']:.1f}s, method {row['method']}, {row['rounding']} "
              f"rounding")
        for ar in ARITHMETICS:
            s = NativeSession(r.path, threads=a.threads, arithmetic=ar)
            numpy_layers = sum("ort-x86-novnni" in st.kernel for st in s.program.steps)
            n = len(xs) if not numpy_layers else min(len(xs), a.emulate_limit)
            t = time.time()
            row[ar] = judge(ref, run_all(s, split.feeds(xs[:n], name)), y)
            row[ar]["seconds"], row[ar]["numpy_layers"] = time.time() - t, numpy_layers
        row["this_ort"] = judge(ref, run_all(ort_session(r.path, a.threads), feeds), y)
        res[target] = row
        for ar in ARITHMETICS + ("this_ort",):
            j = row[ar]
            print(f"{target:17s} {ar:15s} {j['images']:4d} images: agreement {j['top1_agreement']:.4f} "
                  f"[{j['agreement_95'][0]:.4f}, {j['agreement_95'][1]:.4f}], top-1 {j['top1']:.4f} "
                  f"({j['delta_pt']:+.2f} pt), SQNR {j['sqnr_db']:.2f} dB")
    speed = {}
    if not a.no_speed:
        for b in (1, 8):
            sess = {t: ort_session(pth, a.threads) for t, pth in paths.items()}
            speed[b] = latency(sess, xs[:b], a.repeats)
            base = speed[b].get("vnni")
            print(f"ORT int8 latency, batch {b} (ms/image): " + ", ".join(
                f"{t} {ms:.2f}" + (f" ({ms / base:.2f}x vnni)" if base else "") for t, ms in speed[b].items()))
    out = {"ort_int8_arithmetic": here, "fp32_top1": float((ref.argmax(1) == y).mean()), "targets": res,
           "ort_latency_ms": speed}
    with open(os.path.join(a.out, "bench_targets.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {os.path.join(a.out, 'bench_targets.json')}")
    print(f"wrote {write_results(a, out)}")
    return 0


def write_results(a, out):
    """benchmarks/results/targets.json, which `make results` turns into a table."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import results_io

    def fig(j, first):
        lo, hi = j["agreement_95"]
        return (f"{'agreement ' if first else ''}{j['top1_agreement']:.4f} [{lo:.3f}, {hi:.3f}], "
                f"{'top-1 ' if first else ''}{j['delta_pt']:+.2f} pt, {j['sqnr_db']:.2f} dB")
    rows = []
    for k, (target, row) in enumerate(out["targets"].items()):
        exact, novnni = row["exact"], row["ort-x86-novnni"]
        same = (novnni["top1_agreement"], novnni["sqnr_db"]) == (exact["top1_agreement"], exact["sqnr_db"])
        sp = out["ort_latency_ms"]
        rows.append({"model": target + (" (default)" if target == "portable" else ""), "exact": fig(exact, k == 0),
                     "novnni": "the same" if same else fig(novnni, False) + f" on {novnni['images']} images",
                     "this_ort": fig(row["this_ort"], False),
                     "speed": " / ".join(f"{sp[b][target]:.2f}" for b in sorted(sp) if target in sp[b]) or None})
    cols = [("model", "target"), ("exact", "exact int8 (VNNI CPU or qtool's runtime)"),
            ("novnni", "ONNX Runtime on x86 without VNNI (emulated)"), ("this_ort", "this CPU's ONNX Runtime"),
            ("speed", "ORT int8 ms/image, batch 1 / 8")]
    return results_io.write("targets", "bench_targets.py", "make bench", cols, rows, results_io.provenance(),
                            a.results or None,
                            title=f"Targets: {os.path.basename(a.model)} under both arithmetics (make bench: "
                                  f"bench_targets.py)",
                            about=f"fp32 top-1 {out['fp32_top1']:.4f}; 95 % interval of the agreement in brackets; "
                                  f"this CPU's ONNX Runtime int8: {out['ort_int8_arithmetic']}. See [cpus.md](cpus.md).")


if __name__ == "__main__":
    sys.exit(main())
