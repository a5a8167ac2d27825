#!/usr/bin/env python3
"""qtool vs ONNX Runtime's quantizer on an ImageNet classifier, side by side in one run.

Calibrates on the calibration split (sorted index % 10 == 0) and evaluates on the rest,
as ../shared/imagenet-samples/README.md defines. qtool is run once through `calibrate`
and then quantized with every calibration method (one pass answers for all of them);
ORT's quantize_static (the anchor script's own function) runs on the same images.

  python benchmarks/bench_accuracy.py --model M.onnx --images DIR --anchor ../shared/anchors/ort_anchor.py
"""
import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort

import imagenet_split as split
from qtool.data.config import load_config
from qtool.calibrate.methods import METHODS
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions, Sampling
from qtool.quantize.run import quantize
from qtool.quantize.options import QuantizeOptions, SensitivityOptions


def sess(path, threads=2):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def logits(path, xs, name):
    s = sess(path)
    return np.concatenate([s.run(None, f)[0] for f in split.feeds(xs, name)])


def score(lf, lq, y):
    return {"top1_fp32": float((lf.argmax(1) == y).mean()), "top1_int8": float((lq.argmax(1) == y).mean()),
            "top1_delta_pt": float(100 * ((lq.argmax(1) == y).mean() - (lf.argmax(1) == y).mean())),
            "top1_agreement": float((lf.argmax(1) == lq.argmax(1)).mean())}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--anchor", help="path to ort_anchor.py (ORT's quantizer side by side)")
    p.add_argument("--config", default="efficientnet-lite")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--limit", type=int, default=0, help="evaluate on at most this many images")
    p.add_argument("--results", help="folder of the results files `make results` reads (default: benchmarks/results)")
    p.add_argument("--family", default="classifiers", help="the README results table this model's row goes in")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    calib, evals = split.split(a.images)
    if a.limit:
        evals = evals[: a.limit]
    cfg = load_config(a.config)
    xs = split.images(evals, cfg)
    y = split.class_indices(a.images, evals)
    name = sess(a.model).get_inputs()[0].name
    lf = logits(a.model, xs, name)
    rows, results = [], {"n_eval": len(evals), "n_calib": len(calib)}

    work = tempfile.mkdtemp(prefix="qtool-bench-")
    t = time.time()
    # every=10 is the calibration split itself (sorted index % 10 == 0), as `qtool calibrate --every 10`
    cal = calibrate(a.model, a.images,
                    CalibrateOptions(config=a.config, method="minmax",
                                     sampling=Sampling(every=split.EVERY), show_progress=False),
                    workdir=work)
    t_cal = time.time() - t
    for method in METHODS:
        t = time.time()
        r = quantize(work, QuantizeOptions(method=method, output=os.path.join(work, f"{method}.onnx"), progress=False, sensitivity=SensitivityOptions(enabled=False)))
        t_q = time.time() - t
        s = score(lf, logits(r.path, xs, name), y)
        s.update(method=method, seconds=t_cal + t_q, size_ratio=os.path.getsize(r.path) / os.path.getsize(a.model))
        results[f"qtool_{method}"] = s
        rows.append((f"qtool {method}", s))
    if a.anchor:
        spec = importlib.util.spec_from_file_location("ort_anchor", a.anchor)
        anchor = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(anchor)
        size = cfg.size[0]
        q, secs = anchor.ort_quantize(a.model, (anchor.preprocess(f, size) for f in calib), "MinMax", name)
        s = score(lf, logits(q, xs, name), y)
        s.update(method="ORT MinMax", seconds=secs, size_ratio=os.path.getsize(q) / os.path.getsize(a.model))
        results["ort_minmax"] = s
        rows.append(("ORT quantize_static MinMax", s))
    print(f"\n{os.path.basename(a.model)}: calibrated on {len(calib)} images, evaluated on {len(evals)}")
    print(f"{'':30}{'top-1 fp32':>11}{'top-1 int8':>11}{'delta pt':>10}{'agreement':>11}{'seconds':>9}{'size':>7}")
    for label_, s in rows:
        print(f"{label_:30}{s['top1_fp32']:>11.4f}{s['top1_int8']:>11.4f}{s['top1_delta_pt']:>+10.2f}"
              f"{s['top1_agreement']:>11.4f}{s['seconds']:>9.1f}{100 * s['size_ratio']:>6.1f}%")
    best = max(METHODS, key=lambda m: (results[f"qtool_{m}"]["top1_agreement"], results[f"qtool_{m}"]["top1_delta_pt"]))
    print(f"best qtool method by agreement: {best}")
    if "ort_minmax" in results:
        q, o = results[f"qtool_{best}"], results["ort_minmax"]
        print(f"qtool {best} vs ORT: agreement {q['top1_agreement']:.4f} vs {o['top1_agreement']:.4f}, "
              f"delta {q['top1_delta_pt']:+.2f} vs {o['top1_delta_pt']:+.2f} pt")
    results["best_method"] = best
    with open(os.path.join(a.out, "accuracy.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {write_results(a, results, best, len(evals))}")
    return 0


RESULT_COLS = [("model", "model"), ("metric", "figure"), ("fp32", "fp32"), ("int8", "qtool int8"), ("ort", "ORT int8"),
               ("method", "qtool method"), ("agreement", "top-1 agreement qtool"),
               ("ort_agreement", "top-1 agreement ORT"), ("size_pct", "size %"), ("seconds", "qtool s"),
               ("ort_seconds", "ORT s")]


def write_results(a, results, best, n_eval):
    """benchmarks/results/accuracy-MODEL.json, which `make results` turns into tables."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import results_io
    q, o = results[f"qtool_{best}"], results.get("ort_minmax")
    stem = os.path.splitext(os.path.basename(a.model))[0]
    row = {"model": stem, "family": a.family, "metric": f"top-1, {n_eval} images", "fp32": round(q["top1_fp32"], 4),
           "int8": f"{q['top1_int8']:.4f} ({q['top1_delta_pt']:+.2f} pt)", "method": best,
           "agreement": round(q["top1_agreement"], 4), "size_pct": round(100 * q["size_ratio"], 1),
           "seconds": round(q["seconds"], 1)}
    if o:
        row.update(ort=f"{o['top1_int8']:.4f} ({o['top1_delta_pt']:+.2f} pt)", ort_agreement=round(o["top1_agreement"], 4),
                   ort_seconds=round(o["seconds"], 1))
    return results_io.write(f"accuracy-{stem}", "bench_accuracy.py", "make bench", RESULT_COLS, [row],
                            results_io.provenance(), a.results or None,
                            title=f"{stem}: top-1 on the held-out split (make bench: bench_accuracy.py)",
                            about="Calibrated on every 10th image of `--images`, judged on the others; qtool's best "
                                  "range method by agreement beside ONNX Runtime's `quantize_static` (QDQ, u8/s8 per "
                                  "channel, MinMax).")


if __name__ == "__main__":
    sys.exit(main())
