#!/usr/bin/env python3
"""Sensitivity report and --exclude-sensitive on an ImageNet classifier, judged on the evaluation split.

Calibrates on the calibration split (sorted index % 10 == 0), computes per-layer sensitivity
on 64 of those images (timed), then measures on the other 900 images: the model with the
top-ranked layer alone kept fp32 against the one with the median-ranked layer alone kept fp32,
and the model --exclude-sensitive writes (which tunes ranges and rounds weights by output error,
from calibration images only; the all-int8 lines show each step of that on its own).

  python benchmarks/bench_sensitivity.py --model M.onnx --images DIR [--config efficientnet-lite]
"""
import argparse
import json
import os
import sys
import tempfile
import time

import onnx

import imagenet_split as split
from qtool.data.config import load_config
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions, Sampling
from qtool.calibrate.table import load_table
from qtool.metrics import sqnr_db, top1_agreement
from qtool.quantize.qdq import quantize_graph
from qtool.quantize.run import quantize
from qtool.ortsession import run_first_output
from qtool.quantize.options import ExclusionOptions, QuantizeOptions, SensitivityOptions
from qtool.quantize.qdq import BuildOptions


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--config", default="efficientnet-lite")
    p.add_argument("--method", default="minmax")
    p.add_argument("--out", default="bench_out")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    _, evals = split.split(a.images)
    work = tempfile.mkdtemp(prefix="qtool-sens-")
    calibrate(a.model, a.images,
              CalibrateOptions(config=a.config, method=a.method,
                               sampling=Sampling(every=split.EVERY), show_progress=False),
              workdir=work)
    t = time.time()
    r = quantize(work, QuantizeOptions(progress=False, sensitivity=SensitivityOptions(samples=64), exclusion=ExclusionOptions(enabled=True)), say=lambda s: None)
    total = time.time() - t
    sens = r.sensitivity
    layers = sorted(sens["layers"], key=lambda l: l["rank"])
    cfg = load_config(a.config)
    name = onnx.load(os.path.join(work, "fused.onnx"), load_external_data=False).graph.input[0].name
    feeds = split.feeds(split.images(evals, cfg), name)
    fused = onnx.load(os.path.join(work, "fused.onnx"))
    table = load_table(os.path.join(work, "calibration.json"))
    ref = run_first_output(fused, feeds)

    tn = r.tuning
    cache = {}

    def judge(exclude, tuned=True, hessians=True):
        q = quantize_graph(fused, table, BuildOptions(method=a.method, exclude=exclude, ranges=tn.ranges if tuned else None, hessians=tn.hessians if hessians else None, weight_cache=cache))
        y = run_first_output(q.model, feeds)
        return {"agreement": top1_agreement(ref, y), "sqnr_db": sqnr_db(ref, y), "excluded": sorted(exclude)}

    y = run_first_output(onnx.load(r.path), feeds)
    written = {"agreement": top1_agreement(ref, y), "sqnr_db": sqnr_db(ref, y), "excluded": sorted(r.exclusion.excluded)}
    top, median = layers[0]["name"], layers[len(layers) // 2]["name"]
    res = {"sensitivity_seconds": sens["seconds"], "layers": len(layers), "samples": sens["samples"],
           "quantize_with_exclusion_seconds": total, "tuning_seconds": tn.seconds,
           "tuned_ranges": len(tn.ranges or {}), "rounded_layers": len(tn.hessians or {}),
           "all_int8_nearest_default_ranges": judge({}, tuned=False, hessians=False),
           "all_int8_output_rounding": judge({}, tuned=False),
           "all_int8": judge({}), "top_ranked_fp32": judge({top: "top"}), "median_ranked_fp32": judge({median: "m"}),
           "exclude_sensitive": written, "exclude_sensitive_reached_on_calibration": r.exclusion.reached}
    print(f"sensitivity of {len(layers)} layers on {sens['samples']} images: {sens['seconds']:.1f}s "
          f"(whole quantize with --exclude-sensitive {total:.1f}s, of which rounding and range tuning "
          f"{tn.seconds:.1f}s: {len(tn.hessians or {})} layers rounded, {len(tn.ranges or {})} ranges changed)")
    print(f"evaluation split, {len(evals)} images: agreement / output SQNR")
    for key, label in (("all_int8_nearest_default_ranges", "all int8, nearest rounding, default ranges"),
                       ("all_int8_output_rounding", "all int8, output-aware rounding"),
                       ("all_int8", "all int8, output-aware rounding and tuned ranges"),
                       ("top_ranked_fp32", f"rank 1 fp32 ({top})"),
                       ("median_ranked_fp32", f"rank {len(layers) // 2 + 1} fp32 ({median})"),
                       ("exclude_sensitive", f"--exclude-sensitive ({len(r.exclusion.excluded)} fp32)")):
        print(f"  {label:60} {res[key]['agreement']:.4f}  {res[key]['sqnr_db']:.2f} dB")
    print(f"  --exclude-sensitive kept fp32: {', '.join(r.exclusion.excluded) or 'none'}")
    with open(os.path.join(a.out, "sensitivity.json"), "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
