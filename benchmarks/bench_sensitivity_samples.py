#!/usr/bin/env python3
"""Does the sensitivity ranking hold on fewer images? Layer rankings on two disjoint sets of calibration
samples (A and B, --samples each) and on the first --fewer of each, compared by Spearman correlation
and by how many of the top 10 (and 5) layers they share. The noise floor is A against B at full size;
fewer images are as good where A-fewer against B is as close to it. Sets the smallest default sample
count of `quantize` (run.MIN_SENSITIVITY_SAMPLES) on a detector.

  python benchmarks/bench_sensitivity_samples.py --model ../shared/models/yolox-det.onnx \\
      --images ../shared/imagenet-samples --shape 1,3,416,416
"""
import argparse
import glob
import json
import os
import sys
import tempfile
import time
import warnings

import numpy as np

from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions
from qtool.quantize.context import QuantizeContext
from qtool.quantize.samples import load_samples
from qtool.quantize.sensitivity import layer_sensitivity

sys.path.insert(0, os.path.dirname(__file__))
from bench_sqnr import tensor_args, write_tensors  # noqa: E402


def ranks(d: dict, names: list) -> np.ndarray:
    return np.argsort(np.argsort([d[n] for n in names]))


def top(d: dict, k: int) -> set:
    return set(sorted(d, key=d.get)[:k])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tensor_args(p)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--fewer", type=int, default=4)
    p.add_argument("--method", default="mse")
    p.add_argument("--out", default="bench_out")
    a = p.parse_args(argv)
    warnings.simplefilter("ignore")
    files = sorted(glob.glob(os.path.join(a.images, "*.JPEG")))[::10][:100]
    work = tempfile.mkdtemp(prefix="qtool-sens-samples-")
    data = write_tensors(files, os.path.join(work, "calib"), tuple(int(v) for v in a.shape.split(",")), a.mean, a.std)
    cal = calibrate(a.model, data, CalibrateOptions(show_progress=False), workdir=os.path.join(work, "w"))
    npys = sorted(glob.glob(os.path.join(data, "*.npy")))
    step = len(npys) // (2 * a.samples)
    ctx = QuantizeContext(cal.fused, cal.table, a.method)
    sets = {"A": load_samples(cal.fused, cal.table, npys[0::step][::2][:a.samples]),
            "B": load_samples(cal.fused, cal.table, npys[0::step][1::2][:a.samples])}
    res, secs = {}, {}
    for key, s in sets.items():
        for n in (a.samples, a.fewer):
            t = time.time()
            res[f"{key}{n}"] = {l.name: l.output_sqnr_db for l in layer_sensitivity(ctx, s.subset(range(n)))}
            secs[f"{key}{n}"] = time.time() - t
            print(f"ranking on {key}{n}: {secs[f'{key}{n}']:.1f} s", flush=True)
    names = sorted(res[f"A{a.samples}"])
    out = {"layers": len(names), "seconds": secs, "pairs": {}}
    for x, y in ((f"A{a.samples}", f"B{a.samples}"), (f"A{a.fewer}", f"B{a.samples}"), (f"B{a.fewer}", f"A{a.samples}"),
                 (f"A{a.fewer}", f"A{a.samples}")):
        rho = float(np.corrcoef(ranks(res[x], names), ranks(res[y], names))[0, 1])
        t10, t5 = len(top(res[x], 10) & top(res[y], 10)), len(top(res[x], 5) & top(res[y], 5))
        out["pairs"][f"{x}-{y}"] = {"spearman": rho, "top10_shared": t10, "top5_shared": t5}
        print(f"{x} vs {y}: Spearman {rho:.3f}, top 10 shared {t10}, top 5 shared {t5}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"sensitivity-samples-{os.path.basename(a.model)}.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
