#!/usr/bin/env python3
"""Output SQNR of qtool's int8 model vs ONNX Runtime's quantizer, side by side in one run.

Uses exactly the inputs of `ort_anchor.py sqnr`: files of DIR (*.JPEG) sorted by name,
calibration = index % 10 == 0, first 32; evaluation = index % 50 == 5, first 16; each
image resized to H x W (bilinear), RGB, (x - mean) / std, NCHW float32 [1, C, H, W].
The calibration tensors are written as .npy files to a temporary folder and qtool
calibrates from that folder (the tensor data path), then quantizes with each range
method; ORT's quantize_static runs through the anchor's own functions (imported by
path), on the model as it is and, with --opset, on a by-hand opset-upgraded copy.
SQNR over all evaluation images of the first output, as the anchor computes it: on this CPU's ONNX
Runtime, and on qtool's runtime under the exact int8 arithmetic and under ONNX Runtime's arithmetic
on x86 without VNNI (emulated: the figure a user of such a CPU gets), for each --targets.

  benchmarks/bench_sqnr.py --model ../shared/models/ppocr-cls-mobilenetv3.onnx \
      --images ../shared/imagenet-samples --shape 1,3,48,192 --mean 127.5 --std 127.5 \
      --anchor ../shared/anchors/ort_anchor.py
  benchmarks/bench_sqnr.py --model ../shared/models/yolox-det.onnx --images ../shared/imagenet-samples \
      --shape 1,3,416,416 --anchor ../shared/anchors/ort_anchor.py --ort-opset 13
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
import warnings

import numpy as np
import onnx
import onnxruntime as ort
from PIL import Image
from qtool.quantize.options import QuantizeOptions, SensitivityOptions


def load_anchor(path):
    spec = importlib.util.spec_from_file_location("ort_anchor", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tensors(files, shape, mean, std):
    """The anchor's sqnr preprocessing (RGB, bilinear resize to W x H, (x - mean) / std, NCHW)."""
    _, c, h, w = shape
    for f in files:
        im = Image.open(f).convert("L" if c == 1 else "RGB").resize((w, h), Image.BILINEAR)
        x = (np.asarray(im, np.float32) - mean) / std
        yield np.ascontiguousarray((x[None] if c == 1 else x.transpose(2, 0, 1))[None], np.float32)


def write_tensors(files, folder, shape, mean, std) -> str:
    """`files` as .npy tensors (tensors()), one per image, in `folder` (made): what calibrate reads."""
    os.makedirs(folder)
    for k, x in enumerate(tensors(files, shape, mean, std)):
        np.save(os.path.join(folder, f"{k:04d}.npy"), x)
    return folder


def tensor_args(p, shape_required: bool = True) -> None:
    """The arguments of a benchmark that feeds a model images as tensors (tensors())."""
    p.add_argument("--model", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--shape", required=shape_required, help="1,C,H,W")
    p.add_argument("--mean", type=float, default=0.0)
    p.add_argument("--std", type=float, default=1.0)


def session(path, threads):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def sqnr_db(model_path, int8_path, name, ev, threads, extra=None):
    """The anchor's formula: 10 log10(sum ref^2 / sum (ref - out)^2) over all images, first output.
    `extra` (a dict) receives qtool eval's agreement figures for the same outputs."""
    from qtool.evaluate import OutputStats
    sf, sq = session(model_path, threads), session(int8_path, threads)
    ref = [sf.run(None, {name: x})[0].astype(np.float64) for x in ev]
    out = [sq.run(None, {name: x})[0].astype(np.float64) for x in ev]
    if extra is not None:
        st = OutputStats("out")
        for r, o in zip(ref, out):
            st.add(r, o)
        res = st.result()
        extra.update({k: v for k, v in res.items() if k in ("top1_agreement", "top_rows_agreement")})
    return 10 * np.log10(sum((r ** 2).sum() for r in ref) / sum(((r - o) ** 2).sum() for r, o in zip(ref, out)))


def native_sqnr(model_path, int8_path, name, ev, threads, arithmetic):
    """SQNR of qtool's runtime under `arithmetic` (qtool/arithmetic.py) against ORT fp32."""
    from qtool.runtime import NativeSession
    sf, sq = session(model_path, threads), NativeSession(int8_path, threads=threads, arithmetic=arithmetic)
    ref = [sf.run(None, {name: x})[0].astype(np.float64) for x in ev]
    out = [sq.run(None, {name: x})[0].astype(np.float64) for x in ev]
    return 10 * np.log10(sum((r ** 2).sum() for r in ref) / sum(((r - o) ** 2).sum() for r, o in zip(ref, out)))


def _agree(extra):
    if "top1_agreement" in extra:
        return f"top-1 agreement {extra['top1_agreement']:.3f}"
    if "top_rows_agreement" in extra:
        return "top rows shared " + " ".join(f"{k} {v:.2f}" for k, v in extra["top_rows_agreement"].items())
    return ""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tensor_args(p)
    p.add_argument("--anchor", required=True, help="path to ort_anchor.py")
    p.add_argument("--methods", default="auto,minmax,percentile,entropy,mse",
                   help="qtool range methods to measure (auto: quantize's default, the best measured on calibration "
                        "samples)")
    p.add_argument("--targets", default="portable", help="qtool --target values to measure (comma-separated)")
    p.add_argument("--ort-opset", type=int, default=0, help="also run ORT on a copy upgraded to this opset")
    p.add_argument("--no-ort", action="store_true", help="skip ORT's quantizer (qtool figures only)")
    p.add_argument("--eval", type=int, default=16,
                   help="evaluation images (16: every 50th; more: any not used for calibration)")
    p.add_argument("--rounding", choices=["output", "nearest"], default="output",
                   help="quantize --rounding (output, the default: by each layer's output error)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", help="keep qtool's working folder here")
    p.add_argument("--results", help="folder of the results files `make results` reads (default: benchmarks/results)")
    p.add_argument("--family", help="the README results table the default's row goes in (ocr, detectors, ...)")
    a = p.parse_args(argv)
    warnings.simplefilter("ignore")
    logging.getLogger().setLevel(logging.ERROR)  # ORT's quantizer logs a warning per bias it cannot find
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions
    from qtool.quantize.run import quantize

    shape = tuple(int(v) for v in a.shape.split(","))
    files = sorted(glob.glob(os.path.join(a.images, "*.JPEG")))
    cal_files = files[::10][:32]
    ev_files = files[5::50][:16] if a.eval <= 16 else [f for k, f in enumerate(files) if k % 10][:a.eval]
    ev = list(tensors(ev_files, shape, a.mean, a.std))
    name = session(a.model, a.threads).get_inputs()[0].name
    tmp = tempfile.mkdtemp(prefix="bench_sqnr-")
    npy = write_tensors(cal_files, os.path.join(tmp, "calib"), shape, a.mean, a.std)
    work = a.keep or os.path.join(tmp, "work")
    model = os.path.basename(a.model)
    print(f"{model}: {len(cal_files)} calibration tensors (.npy) in {npy}, {len(ev)} evaluation images, shape {shape}")

    t = time.time()
    cal = calibrate(a.model, npy, CalibrateOptions(threads=a.threads, show_progress=False), workdir=work)
    print(f"qtool calibrate: {time.time() - t:.1f}s, {cal.table.n_samples} samples, {len(cal.table.histograms)} tensors")
    fused_db = sqnr_db(a.model, cal.fused_path, name, ev, a.threads)
    print(f"qtool fused fp32 graph vs original: {fused_db:.1f} dB (graph cleanup must not change the function)")
    from qtool.arithmetic import ARITHMETICS
    from qtool.ort_arithmetic import ort_int8_arithmetic
    print(f"this CPU's ONNX Runtime int8 arithmetic: {ort_int8_arithmetic()}")
    rows, arith_rows = {}, {}
    targets = a.targets.split(",")
    for target in targets:
        for m in a.methods.split(","):
            t = time.time()
            r = quantize(work, QuantizeOptions(output=os.path.join(work, f"int8-{m}-{target}.onnx"), method=m, target=target, rounding=a.rounding == "output", progress=False, sensitivity=SensitivityOptions(enabled=False)))
            onnx.checker.check_model(r.path)
            ex = {}
            key = (m if m != "auto" else f"auto: {r.report['method']}") + ("" if target == targets[0] else f" ({target})")
            rows[key] = sqnr_db(a.model, r.path, name, ev, a.threads, ex)
            arith_rows[key] = {ar: native_sqnr(a.model, r.path, name, ev, a.threads, ar) for ar in ARITHMETICS}
            s = r.report["summary"]
            notes = [n for n in r.output.notes if "opset" in n]
            print(f"qtool {key:10s}: output SQNR {rows[key]:5.1f} dB on this ORT, "
                  + ", ".join(f"{v:5.1f} dB {ar}" for ar, v in arith_rows[key].items())
                  + f" | {time.time() - t:.1f}s | ops int8 {s.get('int8', 0)}, "
                  f"passthrough {s.get('passthrough', 0)}, fused {s.get('fused', 0)}, fp32 {s.get('fp32', 0)}"
                  + (f" | {notes[0]}" if notes else "") + (f" | {_agree(ex)}" if ex else ""))
    from qtool.quantize.context import QuantizeContext
    from qtool.quantize.method_choice import method_measures
    from qtool.quantize.samples import load_samples
    picks = [os.path.join(npy, f) for f in sorted(os.listdir(npy))[::4]]  # 8 calibration tensors
    t = time.time()
    named = [m for m in a.methods.split(",") if m != "auto"]
    measured = method_measures(QuantizeContext(cal.fused, cal.table, cal.table.range_method, targets[0]),
                               load_samples(cal.fused, cal.table, picks), named or None)
    scores = {m: v.db for m, v in measured.items()}
    auto = max(scores, key=scores.get)
    print(f"qtool auto: picks '{auto}' on {len(picks)} calibration tensors ({time.time() - t:.1f}s; "
          + ", ".join(f"{m} {v:.1f}" for m, v in scores.items()) + " dB there)")
    ort_rows = {}
    if not a.no_ort:
        anchor = load_anchor(a.anchor)
        variants = [("as is", a.model)]
        if a.ort_opset:
            from onnx import version_converter
            up = os.path.join(tmp, f"opset{a.ort_opset}.onnx")
            onnx.save(version_converter.convert_version(onnx.load(a.model), a.ort_opset), up)
            variants.append((f"opset {a.ort_opset}", up))
        for label, path in variants:
            try:
                q, secs = anchor.ort_quantize(path, tensors(cal_files, shape, a.mean, a.std), "MinMax", name)
                onnx.checker.check_model(q)
                ex = {}
                ort_rows[label] = sqnr_db(a.model, q, name, ev, a.threads, ex)
                print(f"ORT MinMax ({label}): output SQNR {ort_rows[label]:5.1f} dB | {secs:.1f}s"
                      + (f" | {_agree(ex)}" if ex else ""))
            except Exception as e:  # noqa: BLE001 - ORT writes invalid graphs for opset < 13
                msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
                ort_rows[label] = None
                print(f"ORT MinMax ({label}): failed: {type(e).__name__}: {msg}")
    print()
    ort_best = max((v for v in ort_rows.values() if v is not None), default=None)
    print(f"{model}: output SQNR, dB over {len(ev)} images (first output)")
    print(f"  {'qtool method':22s}{'qtool':>8s}{'ORT':>8s}{'diff':>8s}" + "".join(f"{ar:>16s}" for ar in ARITHMETICS))
    for m, v in rows.items():
        o = f"{ort_best:8.1f}{v - ort_best:+8.1f}" if ort_best is not None else f"{'n/a':>8s}{'':>8s}"
        print(f"  {m:22s}{v:8.1f}{o}" + "".join(f"{arith_rows[m][ar]:16.1f}" for ar in ARITHMETICS))
    if ort_best is not None and auto in rows:
        print(f"  {'auto (' + auto + ')':22s}{rows[auto]:8.1f}{ort_best:8.1f}{rows[auto] - ort_best:+8.1f}"
              f"   <- method picked on calibration tensors, scored on the evaluation images")
    for label, v in ort_rows.items():
        print(f"  ORT ({label}): {'failed' if v is None else f'{v:.1f} dB'}")
    print(f"wrote {write_results(a, model, len(ev), targets, rows, arith_rows, ort_rows)}")
    return 0


def write_results(a, model, n_eval, targets, rows, arith_rows, ort_rows):
    """benchmarks/results/sqnr-MODEL.json, which `make results` turns into tables."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import results_io
    from qtool.arithmetic import ARITHMETICS
    ort = "; ".join(f"{v:.1f}" + ("" if label == "as is" else f" ({label})") for label, v in ort_rows.items()
                    if v is not None) or None
    out = []
    for key in rows:
        method, _, target = key.partition(" (")
        target = target.rstrip(")") or targets[0]
        r = {"model": os.path.splitext(model)[0], "method": method, "target": target,
             "here_db": round(rows[key], 1), "arith": " / ".join(f"{arith_rows[key][ar]:.1f}" for ar in ARITHMETICS)}
        if method.startswith("auto") and target == targets[0]:
            r.update(ort_sqnr_db=ort, sqnr_db=round(arith_rows[key][ARITHMETICS[0]], 1),
                     metric=f"output SQNR, {n_eval} images")
            if a.family:
                r["family"] = a.family
        out.append(r)
    cols = [("model", "model"), ("method", "range method"), ("target", "target"),
            ("arith", "dB exact / ORT without VNNI"), ("here_db", "dB on this ORT"), ("ort_sqnr_db", "ORT quantize_static dB")]
    stem = os.path.splitext(model)[0]
    path = results_io.write(f"sqnr-{stem}", "bench_sqnr.py", "make bench", cols, out, results_io.provenance(),
                            a.results or None)
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    doc["title"] = f"Output SQNR: {stem} (make bench: bench_sqnr.py)"
    doc["about"] = (f"32 calibration and {n_eval} evaluation images, default options, under the exact arithmetic and "
                    "ONNX Runtime's without VNNI, beside ONNX Runtime's `quantize_static` (MinMax).")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
