#!/usr/bin/env python3
"""qtool's native int8 runtime against ONNX Runtime on the same int8 file: fidelity and speed.

  python benchmarks/bench_runtime.py --model M.int8.onnx [--fp32 M.onnx] [--images DIR] [--limit N]
                                     [--threads 2] [--batch 1 --batch 8] [--shape 1,128] [--ort-model M2.onnx]
                                     [--profile] [--no-speed]

Fidelity (needs --images; ImageNet-style files <synset>_<name>.JPEG, sorted by name, the
evaluation split is index % 10 != 0): top-1 agreement of qtool's runtime with ORT on the int8
model, the share of logits within one quantization step of ORT's (the step is the scale of the
DequantizeLinear that writes the output), and top-1 accuracy of both (and of ORT fp32 with --fp32).
Acceptance: agreement >= 0.998 and >= 99.9 % of logits within one step.
Preprocessing (EfficientNet-Lite): shorter side to 256 bicubic, centre crop 224, (x - 127) / 128.

Speed (as `qtool bench` measures it: the engines in alternation, each ratio the median of the rounds'
with its interval): median ms/image of qtool native, ORT int8 (same file), ORT fp32 (--fp32) and any
--ort-model (e.g. ONNX Runtime's quantize_dynamic output of the same model) on random input, per batch
size; an encoder's token ids and masks too (--shape 1,L). --profile adds a per-op-type table: time
share, GMAC, GMAC/s and the fraction of the VNNI peak (about 233 GMAC/s per core).
  python benchmarks/bench_runtime.py --model enc.int8.onnx --fp32 enc.onnx --ort-model enc.dynamic.onnx \
      --shape 1,128 --batch 1 --threads 1
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qtool.runtime import NativeSession  # noqa: E402
from qtool.runtime.bench import BenchOptions, bench, make_feeds, profile_steps  # noqa: E402
from qtool.runtime.profile import VNNI_GMACS_PER_CORE, format_table, format_top  # noqa: E402

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import numpy_helper  # noqa: E402
from qtool.data.config import load_config  # noqa: E402
from qtool.data.images import load_image  # noqa: E402


def preprocess(path, size=224):
    """EfficientNet-Lite preprocessing: qtool's efficientnet-lite preset (bit-identical to the ORT anchor's)."""
    cfg = load_config("efficientnet-lite")
    cfg.size, cfg.resize_to = (size, size), round(size * 256 / 224)
    return load_image(path, cfg)


def ort_session(path, threads):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def output_step(path):
    m = onnx.load(path)
    inits = {i.name: i for i in m.graph.initializer}
    out = m.graph.output[0].name
    for n in m.graph.node:
        if n.op_type == "DequantizeLinear" and n.output[0] == out and n.input[1] in inits:
            return float(numpy_helper.to_array(inits[n.input[1]]).reshape(-1)[0])
    return None


def fidelity(a, native, oq, of):
    files = sorted(glob.glob(os.path.join(a.images, "*.JPEG")))
    synsets = sorted({os.path.basename(f).split("_")[0] for f in files})
    label = {s: i for i, s in enumerate(synsets)}
    evals = [f for i, f in enumerate(files) if i % 10]
    if a.limit:
        evals = evals[:a.limit]
    step = output_step(a.model)
    name = native.get_inputs()[0].name
    agree = within = total = ok_n = ok_q = ok_f = exact = 0
    worst = 0.0
    t0 = time.time()
    for f in evals:
        x = preprocess(f, a.size)
        y = label.get(os.path.basename(f).split("_")[0], -1)
        ln = native.run(None, {name: x})[0]
        lq = oq.run(None, {name: x})[0]
        d = np.abs(ln.astype(np.float64) - lq.astype(np.float64))
        tol = step if step else 1e-4 * max(1.0, float(np.abs(lq).max()))
        within += int((d <= tol * 1.0001).sum())
        exact += int((d <= tol * 1e-3).sum())
        total += d.size
        worst = max(worst, float(d.max()) / tol)
        pn, pq = int(np.argmax(ln)), int(np.argmax(lq))
        agree += pn == pq
        ok_n += pn == y
        ok_q += pq == y
        if of is not None:
            ok_f += int(np.argmax(of.run(None, {name: x})[0])) == y
    n = len(evals)
    res = {"images": n, "top1_agreement": agree / n, "logits_within_one_step": within / total,
           "logits_exact": exact / total, "max_diff_steps": worst, "step": step,
           "top1_native": ok_n / n, "top1_ort_int8": ok_q / n, "top1_ort_fp32": (ok_f / n) if of is not None else None,
           "seconds": time.time() - t0}
    ok = res["top1_agreement"] >= 0.998 and res["logits_within_one_step"] >= 0.999
    print(f"fidelity on {n} images of {a.images} (eval split): top-1 agreement native vs ORT int8 {res['top1_agreement']:.4f} | "
          f"logits within {'one step (%.5g)' % step if step else 'float tolerance 1e-4*max|logit| (float output, no Q)'} "
          f"{100 * res['logits_within_one_step']:.3f}% (exact {100 * res['logits_exact']:.3f}%, "
          f"worst {worst:.2f} {'steps' if step else 'tolerances'}) | top-1 native {res['top1_native']:.4f}, ORT int8 {res['top1_ort_int8']:.4f}"
          + (f", ORT fp32 {res['top1_ort_fp32']:.4f}" if of is not None else "") + f" | {'PASS' if ok else 'FAIL'}")
    return res


def speed(a, batches):
    """qtool bench's timing (qtool.runtime.bench): the engines in alternation, per-round ratios with
    their interval; any inputs (token ids and masks for an encoder, with --shape 1,L)."""
    opts = BenchOptions(tuple(batches), a.threads, shape=tuple(a.shape) if a.shape else None,
                        others=tuple(a.ort_model or ()), rounds=a.rounds)
    r = bench(a.model, a.fp32, opts, log=print)
    return {bs: {k: v for k, v in x.items() if k != "rounds"} for bs, x in r["batches"].items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="QDQ int8 ONNX model")
    p.add_argument("--fp32", help="the float model it was quantized from")
    p.add_argument("--images", help="directory of <synset>_*.JPEG images")
    p.add_argument("--limit", type=int, default=0, help="only the first N evaluation images")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, action="append", help="batch sizes for speed (default 1 and 8)")
    p.add_argument("--shape", type=lambda v: [int(d) for d in v.split(",")],
                   help="input shape where the model's is dynamic, e.g. 1,128 (tokens) or 1,3,224,224")
    p.add_argument("--ort-model", action="append",
                   help="another ONNX file with the same inputs timed in ONNX Runtime beside (e.g. quantize_dynamic's)")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds at least (more while a range is wide)")
    p.add_argument("--profile", action="store_true", help="per-op-type time and GMAC/s of the native runtime")
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--report", action="store_true", help="print which nodes run in int8 / fp32")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    out = {"model": a.model, "fp32": a.fp32, "threads": a.threads}
    native = NativeSession(a.model, threads=a.threads)
    print(native.report() if a.report else native.report().splitlines()[0] + "\n" + "\n".join(
        native.report().splitlines()[1:4]))
    if a.images:
        of = ort_session(a.fp32, a.threads) if a.fp32 else None
        out["fidelity"] = fidelity(a, native, ort_session(a.model, a.threads), of)
    if not a.no_speed:
        out["speed"] = speed(a, a.batch or [1, 8])
    if a.profile:
        for bs in a.batch or [1]:
            p = profile_steps(native, make_feeds(native, bs, a.shape), 10, VNNI_GMACS_PER_CORE * a.threads)
            print(f"profile batch {bs} ({a.threads} threads, peak {VNNI_GMACS_PER_CORE:.0f} GMAC/s/core):")
            print(format_table(p["by_op"]))
            if p.get("worker_share") is not None:
                print(f"  (1T ms: on one thread; the other threads ran {100 * p['worker_share']:.0f} % of the parallel chunks)")
            print(format_top(p["top"]))
            out.setdefault("profile", {})[bs] = p["by_op"]
    if a.json:
        import json
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2, default=float)


if __name__ == "__main__":
    main()
