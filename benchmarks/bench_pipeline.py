#!/usr/bin/env python3
"""What `qtool quantize` costs, phase by phase, and what the sensitivity pass costs in fp32 passes.

Calibrates a model (an ImageNet-style folder with a preset, or any image folder turned into tensors
of --shape with --mean/--std, as bench_sqnr.py does), then:

1. sensitivity of every layer on --samples calibration samples, in CPU seconds, against the CPU
   seconds of one fp32 pass of the same model over the same samples, measured in the same process
   with one thread each (CPU time, not wall time: on a shared machine other work stretches wall
   time, not CPU time; one thread: ORT's idle threads spin, which CPU time would count);
2. the default `qtool quantize` (sensitivity on) and `qtool quantize --exclude-sensitive`, wall time,
   with the time of each phase.

  python benchmarks/bench_pipeline.py --model ../shared/models/efficientnet-lite0.onnx \\
      --images ../shared/imagenet-samples --config efficientnet-lite
  python benchmarks/bench_pipeline.py --model ../shared/models/yolox-det.onnx --images ../shared/imagenet-samples \\
      --shape 1,3,416,416
"""
import argparse
import glob
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import replace

import numpy as np

from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions, Sampling
from qtool.ortsession import session
from qtool.quantize.context import QuantizeContext
from qtool.quantize.options import ExclusionOptions, QuantizeOptions, SensitivityOptions
from qtool.quantize.run import quantize
from qtool.quantize.split import SampleSplit, sensitivity_samples
from qtool.quantize.samples import load_samples
from qtool.quantize.sensitivity import layer_exclusions, layer_sensitivity, layer_variants
from qtool.quantize.simulate import Simulator, tails
from qtool.workdir import Workdir

sys.path.insert(0, os.path.dirname(__file__))
from bench_sqnr import tensor_args, write_tensors  # noqa: E402


def cpu_of(fn, *args, **kw):
    t = time.process_time()
    out = fn(*args, **kw)
    return out, time.process_time() - t


def passes_per_layer(a, cal, wd) -> dict:
    """1. Sensitivity in fp32 passes (CPU time, one process)."""
    recorded = [f for f in Workdir(wd).manifest()["calibrate"]["files"]]
    split = SampleSplit.of(recorded, a.samples or sensitivity_samples(cal.fused))
    ctx = QuantizeContext(cal.fused, cal.table, "minmax", threads=1)
    samples = load_samples(cal.fused, cal.table, split.sensitivity)
    fp32 = session(cal.fused, 1)
    for f in samples.feeds[:1]:
        fp32.run(None, f)  # warm
    passes = [cpu_of(lambda: [fp32.run(None, f) for f in samples.feeds])[1] for _ in range(3)]
    t = time.time()
    layers, sens_cpu = cpu_of(layer_sensitivity, ctx, samples)
    sens_wall = time.time() - t
    passes += [cpu_of(lambda: [fp32.run(None, f) for f in samples.feeds])[1] for _ in range(3)]
    pass_cpu = float(np.median(passes))  # (before and after: one pass alone varies by a third on a shared host)
    per_layer = sens_cpu / pass_cpu / len(layers)
    print(f"sensitivity of {len(layers)} layers on {len(samples)} samples: {sens_cpu:.1f} CPU s ({sens_wall:.1f} s wall); "
          f"one fp32 pass over them: {pass_cpu:.2f} CPU s -> {per_layer:.2f} fp32 passes per layer")
    if a.check_full:
        check_full_models(ctx, samples, layers)
    floor = suffix_floor(ctx, samples)
    print(f"  of which the suffixes alone (each layer's model from its first changed node on, ORT's profile): "
          f"{floor:.2f} passes per layer; the rest is making sessions and graphs, and the quantizers")
    return {"layers": len(layers), "samples": len(samples), "sensitivity_cpu_seconds": sens_cpu,
            "fp32_pass_cpu_seconds": pass_cpu, "fp32_passes_per_layer": per_layer, "sensitivity_wall_seconds": sens_wall,
            "suffix_passes_per_layer": floor}


def check_full_models(ctx, samples, layers) -> None:
    """That the simulation is the same function as before it: each layer's output SQNR against that
    of its whole QDQ model (every other layer excluded), run in float by ONNX Runtime."""
    from qtool.metrics import sqnr_db
    picked, exclusions = layer_exclusions(Simulator(ctx))
    alone = {d.name: e for (_, d), e in zip(picked, exclusions)}
    diffs = []
    for s in layers:
        q = ctx.build(alone[s.name], prune_excluded=False).model
        full = session(q, 1, basic=True)
        y = np.concatenate([full.run(None, f)[0] for f in samples.feeds])
        whole = sqnr_db(samples.reference, y)
        # both beyond float resolution (a Concat alone changes nothing: exactly fp32 simulated, 128 dB in
        # the whole model's session)
        same = min(whole, s.output_sqnr_db) > 100
        diffs.append(0.0 if same else abs(whole - s.output_sqnr_db))
        if not diffs[-1] <= 0.1:
            print(f"    {s.name}: simulated {s.output_sqnr_db:.2f} dB, whole QDQ model {whole:.2f} dB")
    print(f"  per-layer output SQNR, simulated against each layer's whole QDQ model: largest difference "
          f"{max(diffs):.4f} dB, mean {np.mean(diffs):.4f} dB over {len(diffs)} layers")


def suffix_floor(ctx, samples) -> float:
    """What re-running only what changes costs at best, in fp32 passes per layer: the share of an fp32
    pass from each layer's first changed node to the end (ORT's per-node profile), averaged."""
    sim = Simulator(ctx)
    _, variants = layer_variants(sim)
    tail = tails(sim.shares(samples))
    return float(sum(tail[sim.first(v)] for v in variants) / max(len(variants), 1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tensor_args(p, shape_required=False)  # (--shape: tensor data, as bench_sqnr.py)
    p.add_argument("--config", help="preprocessing preset (images); else --shape/--mean/--std tensors")
    p.add_argument("--calibration", type=int, default=100, help="calibration samples (every 10th image)")
    p.add_argument("--samples", type=int, default=None,
                   help="sensitivity samples (default: quantize's, 64 or fewer for large outputs)")
    p.add_argument("--no-exclude", action="store_true", help="skip the --exclude-sensitive run")
    p.add_argument("--no-passes", action="store_true", help="skip part 1 (sensitivity in fp32 passes)")
    p.add_argument("--no-quantize", action="store_true", help="skip part 2 (the pipeline as a user runs it)")
    p.add_argument("--check-full", action="store_true",
                   help="part 1 also builds each layer's whole QDQ model and compares its output SQNR")
    p.add_argument("--out", default="bench_out")
    a = p.parse_args(argv)
    warnings.simplefilter("ignore")
    os.makedirs(a.out, exist_ok=True)
    files = sorted(glob.glob(os.path.join(a.images, "*.JPEG")))[::10][:a.calibration]
    work = tempfile.mkdtemp(prefix="qtool-pipeline-")
    data = a.images
    if a.shape:
        data = write_tensors(files, os.path.join(work, "calib"), tuple(int(v) for v in a.shape.split(",")), a.mean,
                             a.std)
        t = time.time()
        cal = calibrate(a.model, data,
                        CalibrateOptions(show_progress=False), workdir=os.path.join(work, "w"))  # (method: auto)
    else:
        t = time.time()
        cal = calibrate(a.model, data,
                        CalibrateOptions(config=a.config,
                                         sampling=Sampling(limit=a.calibration, every=10), show_progress=False),
                        workdir=os.path.join(work, "w"))
    wd = os.path.join(work, "w")
    print(f"{os.path.basename(a.model)}: calibrated on {cal.table.n_samples} samples in {time.time() - t:.1f}s")

    res = {"model": os.path.basename(a.model)}
    if not a.no_passes:
        res.update(passes_per_layer(a, cal, wd))
    # 2. the pipeline as a user runs it
    default = QuantizeOptions(progress=False, sensitivity=SensitivityOptions(samples=a.samples))
    runs = [] if a.no_quantize else [("default", default)]
    if not a.no_exclude and not a.no_quantize:
        runs.append(("exclude_sensitive", replace(default, exclusion=ExclusionOptions(enabled=True))))
    for label, opts in runs:
        said = []  # (when, line): a phase announces itself when it starts

        def say(line, said=said):
            said.append((time.time(), line[:100]))
        t, c = time.time(), time.process_time()
        r = quantize(wd, replace(opts, output=os.path.join(work, f"{label}.onnx")), say=say)
        end = time.time()
        phases = [(round((said[k + 1][0] if k + 1 < len(said) else end) - w, 1), line) for k, (w, line) in enumerate(said)]
        res[label] = {"wall_seconds": end - t, "cpu_seconds": time.process_time() - c,
                      "phases": phases, "excluded": sorted(r.report["excluded"])}
        print(f"quantize ({label}): {res[label]['wall_seconds']:.1f} s wall, {res[label]['cpu_seconds']:.1f} CPU s")
        for secs, line in phases:
            print(f"    {secs:6.1f}s  {line}")
    with open(os.path.join(a.out, f"pipeline-{os.path.basename(a.model)}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
