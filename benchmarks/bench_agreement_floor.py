#!/usr/bin/env python3
"""What top-1 agreement can a classifier reach at all in qtool's int8 format?

Calibrates on the calibration split (sorted index % 10 == 0) and judges on the other 900 images:

1. weights only: int8 per-channel weights (bias corrected), every activation left fp32, with
   the k layers whose weights hurt the output most (ranked on calibration images) kept fp32.
   Activation quantization adds independent noise on top, so with all activations int8 as
   well, k excluded layers are not expected to do better than these lines.
2. the all-int8 model's output error scaled down by a factor a (ref + a * (int8 - ref)): how
   many dB less noise, with the same structure, a target agreement needs.
3. the fp32 top-1 margins (top-1 minus top-2 logit) of the images that flip.

  python benchmarks/bench_agreement_floor.py --model M.onnx --images DIR [--config efficientnet-lite]
"""
import argparse
import json
import os
import tempfile

import numpy as np
import onnx

import imagenet_split as split
from qtool.data.config import load_config
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions, Sampling
from qtool.calibrate.table import load_table
from qtool.metrics import sqnr_db, top1_agreement
from qtool.quantize.qdq import quantize_graph
from qtool.ortsession import run_first_output
from qtool.quantize.sensitivity import quantizable_layers
from qtool.quantize.qdq import BuildOptions


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--config", default="efficientnet-lite")
    p.add_argument("--excluded", type=int, nargs="+", default=[0, 5, 8])
    p.add_argument("--out", default="bench_out")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cal, evals = split.split(a.images)
    work = tempfile.mkdtemp(prefix="qtool-floor-")
    calibrate(a.model, a.images,
              CalibrateOptions(config=a.config, method="minmax",
                               sampling=Sampling(every=split.EVERY), show_progress=False),
              workdir=work)
    fused = onnx.load(os.path.join(work, "fused.onnx"))
    table = load_table(os.path.join(work, "calibration.json"))
    cfg = load_config(a.config)
    name = fused.graph.input[0].name

    cal_feeds, eval_feeds = (split.feeds(split.images(f, cfg), name) for f in (cal, evals))
    cal_ref, ref = run_first_output(fused, cal_feeds), run_first_output(fused, eval_feeds)
    top2 = np.sort(ref, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]

    def judge(model):
        y = run_first_output(model, eval_feeds)
        flips = np.nonzero(ref.argmax(1) != y.argmax(1))[0]
        return y, {"agreement": top1_agreement(ref, y), "sqnr_db": sqnr_db(ref, y), "flips": int(len(flips)),
                   "flip_margins": [round(float(m), 3) for m in margin[flips]]}

    # rank layers by the output damage of their int8 weights alone (activations fp32), on calibration images
    layers = [d.name for d in quantizable_layers(fused)]
    cache = {}
    ranked = []
    for layer in layers:
        q = quantize_graph(fused, table, BuildOptions(exclude={o: "floor" for o in layers if o != layer}, activations=False, weight_cache=cache))
        ranked.append((sqnr_db(cal_ref, run_first_output(q.model, cal_feeds)), layer))
    ranked.sort()
    res = {"eval_images": len(ref), "weight_ranking": [{"layer": l, "output_sqnr_db": s} for s, l in ranked[:10]],
           "weights_only": {}, "margin_quantiles": {str(q): float(np.quantile(margin, q)) for q in (0.005, 0.01, 0.02)}}
    print(f"evaluation split, {len(ref)} images; fp32 top-1 margin: 0.5% of images below "
          f"{res['margin_quantiles']['0.005']:.3f}, 1% below {res['margin_quantiles']['0.01']:.3f}")
    for k in a.excluded:
        excl = {l: "floor" for _, l in ranked[:k]}
        _, r = judge(quantize_graph(fused, table, BuildOptions(exclude=excl, activations=False, weight_cache=cache)).model)
        r["excluded"] = sorted(excl)
        res["weights_only"][str(k)] = r
        print(f"  int8 weights only (all activations fp32), {k} layers fp32: agreement {r['agreement']:.4f}  "
              f"{r['sqnr_db']:.2f} dB  {r['flips']} flips, fp32 margins {r['flip_margins']}")
    y, r = judge(quantize_graph(fused, table, BuildOptions(weight_cache=cache)).model)
    res["all_int8"] = r
    print(f"  all int8: agreement {r['agreement']:.4f}  {r['sqnr_db']:.2f} dB  {r['flips']} flips, "
          f"fp32 margins {r['flip_margins']}")
    res["scaled_error"] = []
    for s in (0.8, 0.6, 0.5, 0.4, 0.3):
        ys = ref + s * (y - ref)
        flips = int((ys.argmax(1) != ref.argmax(1)).sum())
        res["scaled_error"].append({"scale": s, "db_less_noise": -20 * np.log10(s), "flips": flips,
                                    "agreement": 1 - flips / len(ref)})
        print(f"  all-int8 error x {s:.1f} ({-20 * np.log10(s):4.1f} dB less noise): {flips} flips, "
              f"agreement {1 - flips / len(ref):.4f}")
    path = os.path.join(a.out, "agreement_floor.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
