"""Micro-benchmark of the native INT8 kernels on the conv / GEMM / depthwise shapes of ResNet-50
and EfficientNet-Lite0 (NHWC, batch 1 or --batch). Reports GMAC/s and the fraction of the vpdpbusd peak
(about 233 GMAC/s per core here; on the AMX tier the tdpbusd peak, about 2.7 TMAC/s per core),
plus the summed time of each model's conv layers.

    .venv/bin/python benchmarks/bench_kernels.py [--threads 2] [--isa avx512vnni] [--model resnet50] [--batch 8]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import qtool.kernels as K

# AMX tier: tdpbusd (16 x 16 x 64 MACs) register-only loop, one per 16 cycles, measured on the
# Sapphire Rapids VM (0.166 G tdpbusd/s per core)
AMX_PEAK_PER_CORE = 2700.0

# name, h(=w), cin, cout, k, stride, pad, group, count in the model
RESNET50 = [
    ("conv1 7x7/2", 224, 3, 64, 7, 2, 3, 1, 1),
    ("l1 1x1 64-64", 56, 64, 64, 1, 1, 0, 1, 1),
    ("l1 1x1 256-64", 56, 256, 64, 1, 1, 0, 1, 2),
    ("l1 3x3 64", 56, 64, 64, 3, 1, 1, 1, 3),
    ("l1 1x1 64-256", 56, 64, 256, 1, 1, 0, 1, 4),
    ("l2 1x1 256-128", 56, 256, 128, 1, 1, 0, 1, 1),
    ("l2 3x3/2 128", 56, 128, 128, 3, 2, 1, 1, 1),
    ("l2 1x1/2 256-512", 56, 256, 512, 1, 2, 0, 1, 1),
    ("l2 1x1 512-128", 28, 512, 128, 1, 1, 0, 1, 3),
    ("l2 3x3 128", 28, 128, 128, 3, 1, 1, 1, 3),
    ("l2 1x1 128-512", 28, 128, 512, 1, 1, 0, 1, 4),
    ("l3 1x1 512-256", 28, 512, 256, 1, 1, 0, 1, 1),
    ("l3 3x3/2 256", 28, 256, 256, 3, 2, 1, 1, 1),
    ("l3 1x1/2 512-1024", 28, 512, 1024, 1, 2, 0, 1, 1),
    ("l3 1x1 1024-256", 14, 1024, 256, 1, 1, 0, 1, 5),
    ("l3 3x3 256", 14, 256, 256, 3, 1, 1, 1, 5),
    ("l3 1x1 256-1024", 14, 256, 1024, 1, 1, 0, 1, 6),
    ("l4 1x1 1024-512", 14, 1024, 512, 1, 1, 0, 1, 1),
    ("l4 3x3/2 512", 14, 512, 512, 3, 2, 1, 1, 1),
    ("l4 1x1/2 1024-2048", 14, 1024, 2048, 1, 2, 0, 1, 1),
    ("l4 1x1 2048-512", 7, 2048, 512, 1, 1, 0, 1, 2),
    ("l4 3x3 512", 7, 512, 512, 3, 1, 1, 1, 3),
    ("l4 1x1 512-2048", 7, 512, 2048, 1, 1, 0, 1, 3),
    ("fc 2048-1000", 1, 2048, 1000, 1, 1, 0, 1, 1),
]

EFFNET_LITE0 = [
    ("stem 3x3/2", 224, 3, 32, 3, 2, 1, 1, 1),
    ("dw3 32 @112", 112, 32, 32, 3, 1, 1, 32, 1),
    ("pw 32-16 @112", 112, 32, 16, 1, 1, 0, 1, 1),
    ("pw 16-96 @112", 112, 16, 96, 1, 1, 0, 1, 1),
    ("dw3/2 96 @112", 112, 96, 96, 3, 2, 1, 96, 1),
    ("pw 96-24 @56", 56, 96, 24, 1, 1, 0, 1, 1),
    ("pw 24-144 @56", 56, 24, 144, 1, 1, 0, 1, 2),
    ("dw3 144 @56", 56, 144, 144, 3, 1, 1, 144, 1),
    ("pw 144-24 @56", 56, 144, 24, 1, 1, 0, 1, 1),
    ("dw5/2 144 @56", 56, 144, 144, 5, 2, 2, 144, 1),
    ("pw 144-40 @28", 28, 144, 40, 1, 1, 0, 1, 1),
    ("pw 40-240 @28", 28, 40, 240, 1, 1, 0, 1, 2),
    ("dw5 240 @28", 28, 240, 240, 5, 1, 2, 240, 1),
    ("pw 240-40 @28", 28, 240, 40, 1, 1, 0, 1, 1),
    ("dw3/2 240 @28", 28, 240, 240, 3, 2, 1, 240, 1),
    ("pw 240-80 @14", 14, 240, 80, 1, 1, 0, 1, 1),
    ("pw 80-480 @14", 14, 80, 480, 1, 1, 0, 1, 3),
    ("dw3 480 @14", 14, 480, 480, 3, 1, 1, 480, 2),
    ("pw 480-80 @14", 14, 480, 80, 1, 1, 0, 1, 2),
    ("dw5 480 @14", 14, 480, 480, 5, 1, 2, 480, 1),
    ("pw 480-112 @14", 14, 480, 112, 1, 1, 0, 1, 1),
    ("pw 112-672 @14", 14, 112, 672, 1, 1, 0, 1, 3),
    ("dw5 672 @14", 14, 672, 672, 5, 1, 2, 672, 2),
    ("pw 672-112 @14", 14, 672, 112, 1, 1, 0, 1, 2),
    ("dw5/2 672 @14", 14, 672, 672, 5, 2, 2, 672, 1),
    ("pw 672-192 @7", 7, 672, 192, 1, 1, 0, 1, 1),
    ("pw 192-1152 @7", 7, 192, 1152, 1, 1, 0, 1, 4),
    ("dw5 1152 @7", 7, 1152, 1152, 5, 1, 2, 1152, 3),
    ("pw 1152-192 @7", 7, 1152, 192, 1, 1, 0, 1, 3),
    ("dw3 1152 @7", 7, 1152, 1152, 3, 1, 1, 1152, 1),
    ("pw 1152-320 @7", 7, 1152, 320, 1, 1, 0, 1, 1),
    ("pw 320-1280 @7", 7, 320, 1280, 1, 1, 0, 1, 1),
    ("fc 1280-1000", 1, 1280, 1000, 1, 1, 0, 1, 1),
]

MODELS = {"resnet50": RESNET50, "efficientnet-lite0": EFFNET_LITE0}


CLOCK = time.perf_counter


def bench(fn, min_time=0.05, repeat=5):
    """Best of `repeat` batches (the machine is shared: the minimum is the least disturbed)."""
    fn()
    n, t0 = 0, CLOCK()
    while CLOCK() - t0 < min_time / repeat or n < 2:
        fn()
        n += 1
    best = []
    for _ in range(repeat):
        t = CLOCK()
        for _ in range(n):
            fn()
        best.append((CLOCK() - t) / n)
    return float(np.min(best))


def weights(rng, shape, kind):
    if kind == "uniform":
        return rng.integers(-127, 128, shape, dtype=np.int8)
    f = rng.standard_normal(shape)
    f = f / np.abs(f).reshape(shape[0], -1).max(1).reshape((-1,) + (1,) * (len(shape) - 1)) * 127
    return np.rint(f).astype(np.int8)


def layer_fn(lname, x, w, bias, cin, cout, k, s, p, g):
    n = x.shape[0]
    if lname.startswith("fc"):
        pk = K.pack_gemm(w.reshape(cout, cin), bias, x_zp=3, multiplier=np.float32(1e-3), y_zp=5)
        xx = x.reshape(n, cin)
        out = np.empty((n, cout), np.uint8)
        return pk, (lambda: K.gemm(pk, xx, out=out)), n * cin * cout
    pk = K.pack_conv2d(w, bias, x_zp=3, multiplier=np.float32(1e-3), y_zp=5,
                       geometry=K.ConvGeometry(strides=(s, s), pads=(p,) * 4, group=g))
    out = np.empty(pk.out_shape(n, x.shape[1], x.shape[2]), np.uint8)
    return pk, (lambda: K.conv2d(pk, x, out=out)), out.size * (cin // g) * k * k


def run_model(name, layers, threads, min_time, wkind="normal", compare=False, batch=1):
    rng = np.random.default_rng(0)
    isa = K.get_isa()
    per = AMX_PEAK_PER_CORE if isa == "amx" else K.peak_gmacs(isa)[0]
    peak = per * threads
    compare = compare and isa == "avx2"
    print(f"\n== {name}: ISA {isa}, batch {batch}, {threads} thread(s), {wkind} weights, peak {peak:.0f} GMAC/s "
          f"(measured here: {K.peak_gmacs(isa)[1]}) ==")
    print(f"{'layer':22s} {'kernel':56s} {'MMAC':>8s} {'us':>9s} {'GMAC/s':>7s} {'%peak':>6s} {'x':>2s}"
          + ("  exact GMAC/s  speed-up" if compare else ""))
    total_t = total_mac = total_te = 0.0
    for lname, h, cin, cout, k, s, p, g, count in layers:
        x = rng.integers(0, 256, (batch, h, h, cin), dtype=np.uint8)
        w = weights(rng, (cout, cin // g, k, k), wkind)
        bias = rng.integers(-1000, 1000, cout, dtype=np.int32)
        pk, fn, macs = layer_fn(lname, x, w, bias, cin, cout, k, s, p, g)
        if compare:  # in turns, so a busy machine slows both alike
            K.set_exact_only(True)
            _, fe, _ = layer_fn(lname, x, w, bias, cin, cout, k, s, p, g)
            K.set_exact_only(False)
            t, te = 1e9, 1e9
            for _ in range(3):
                te, t = min(te, bench(fe, min_time / 3)), min(t, bench(fn, min_time / 3))
            total_te += te * count
        else:
            t = bench(fn, min_time)
        gm = macs / t / 1e9
        total_t += t * count
        total_mac += macs * count
        print(f"{lname:22s} {pk.kernel:56s} {macs / 1e6:8.1f} {t * 1e6:9.1f} {gm:7.1f} {100 * gm / peak:5.1f}% {count:2d}"
              + (f"  {macs / te / 1e9:12.1f}  {te / t:7.2f}x" if compare else ""))
    print(f"-- {name} conv/gemm layers total: {total_mac / 1e9:.2f} GMAC in {total_t * 1e3:.2f} ms "
          f"= {total_mac / total_t / 1e9:.0f} GMAC/s ({100 * total_mac / total_t / 1e9 / peak:.0f}% of peak)"
          + (f"; exact kernels {total_te * 1e3:.2f} ms ({total_te / total_t:.2f}x)" if compare else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", choices=K.ISAS, default=None)
    ap.add_argument("--model", choices=sorted(MODELS) + ["all"], default="all")
    ap.add_argument("--min-time", type=float, default=0.05, help="seconds per layer measurement")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time with the thread's CPU clock (only meaningful with --threads 1; "
                         "ignores time lost to other processes on a shared machine)")
    ap.add_argument("--weights", choices=["normal", "uniform"], default="normal")
    ap.add_argument("--batch", type=int, default=1, help="images per call (NHWC batch)")
    ap.add_argument("--compare-exact", action="store_true",
                    help="AVX2 tier: also time the exact 16-bit kernels on each layer, in turns")
    a = ap.parse_args()
    if a.cpu_time:
        global CLOCK
        CLOCK = time.thread_time
    K.set_num_threads(a.threads)
    K.set_isa(a.isa)
    print({k: v for k, v in K.info().items() if k != "supported"})
    for name in (MODELS if a.model == "all" else [a.model]):
        run_model(name, MODELS[name], a.threads, a.min_time, a.weights, a.compare_exact, a.batch)


if __name__ == "__main__":
    main()
