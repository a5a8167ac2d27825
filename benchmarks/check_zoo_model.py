#!/usr/bin/env python3
"""Check a zoo-built model against a reference export of the same weights.

Runs the same images through both ONNX models with ONNX Runtime and prints the
largest |logit difference|, the mean one, top-1 agreement and each model's
top-1 accuracy (labels from the ImageNet-samples file names). Exits 1 when the
models disagree beyond --tol or on any top-1.

  python benchmarks/check_zoo_model.py --model models/efficientnet-lite0.onnx \
      --reference ../shared/models/efficientnet-lite0.onnx --images ../shared/imagenet-samples [--n 50]

Images: the evaluation split of DIR (files sorted by name, index % 10 != 0), first N.
Preprocessing (EfficientNet-Lite): shorter side to 256 (bicubic), centre crop 224,
RGB, (x - 127) / 128, NCHW float32.
"""
import argparse
import glob
import os
import sys
import time

import numpy as np
import onnxruntime as ort

from qtool.data.config import load_config
from qtool.data.images import load_image


def preprocess(path, size=224):
    """EfficientNet-Lite preprocessing: qtool's efficientnet-lite preset (bit-identical to the ORT anchor's)."""
    cfg = load_config("efficientnet-lite")
    cfg.size, cfg.resize_to = (size, size), round(size * 256 / 224)
    return load_image(path, cfg)[0]


def session(path, optimize=True):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    if not optimize:  # run the graphs as written (no Pad/BatchNorm fusion by ORT)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the zoo-built ONNX model")
    ap.add_argument("--reference", required=True, help="a reference ONNX export of the same weights")
    ap.add_argument("--images", required=True, help="ImageNet-samples directory (<synset>_<name>.JPEG)")
    ap.add_argument("--n", type=int, default=50, help="number of evaluation-split images")
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--tol", type=float, default=1e-3, help="largest |logit difference| accepted")
    ap.add_argument("--no-optimize", action="store_true",
                    help="disable ONNX Runtime graph optimizations (compare the graphs as written)")
    a = ap.parse_args(argv)

    files = sorted(glob.glob(os.path.join(a.images, "*.JPEG")))
    if not files:
        sys.exit(f"no *.JPEG in {a.images}")
    label = {s: i for i, s in enumerate(sorted({os.path.basename(f).split("_")[0] for f in files}))}
    evals = [f for i, f in enumerate(files) if i % 10][: a.n]
    m, r = session(a.model, not a.no_optimize), session(a.reference, not a.no_optimize)
    mi, ri = m.get_inputs()[0].name, r.get_inputs()[0].name
    max_diff, sum_diff, agree, right_m, right_r, n = 0.0, 0.0, 0, 0, 0, 0
    t = time.time()
    for b in range(0, len(evals), a.batch):
        chunk = evals[b:b + a.batch]
        x = np.stack([preprocess(f) for f in chunk])
        ym = m.run(None, {mi: x})[0]
        yr = r.run(None, {ri: x})[0]
        d = np.abs(ym.astype(np.float64) - yr)
        max_diff, sum_diff = max(max_diff, float(d.max())), sum_diff + float(d.mean()) * len(chunk)
        tm, tr = ym.argmax(1), yr.argmax(1)
        y = np.array([label[os.path.basename(f).split("_")[0]] for f in chunk])
        agree += int((tm == tr).sum())
        right_m += int((tm == y).sum())
        right_r += int((tr == y).sum())
        n += len(chunk)
    print(f"images {n} ({time.time() - t:.1f} s, ORT graph optimizations {'off' if a.no_optimize else 'on'})")
    print(f"max |logit diff| {max_diff:.3g}   mean |logit diff| {sum_diff / n:.3g}")
    print(f"top-1 agreement {agree}/{n}")
    print(f"top-1 accuracy: model {right_m}/{n} = {right_m / n:.4f}, reference {right_r}/{n} = {right_r / n:.4f}")
    ok = max_diff <= a.tol and agree == n
    print("OK" if ok else f"MISMATCH (tol {a.tol})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
