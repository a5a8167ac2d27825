"""GMAC/s per op class of a real int8 model through the native executor, with the AVX2 tier's
vpmaddubsw kernels and with its exact 16-bit (vpmaddwd) kernels, in one process: two sessions
on the same file, profiled in turns (so load from other processes hits both alike), medians per
step, summed per class (Conv1x1, Conv3x3, DwConv, ...). Also the share of the measured AVX2
peak and how the packers paired the weights.

    QTOOL_ISA=avx2 .venv/bin/python benchmarks/bench_kernel_sets.py --model M.int8.onnx [--batch 1] [--threads 1]
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

import qtool.kernels as K
from qtool.runtime.bench import make_feeds
from qtool.runtime.session import NativeSession


def class_times(rows):
    t, m = defaultdict(float), defaultdict(int)
    for r in rows:
        t[r["op"]] += r["ms"]
        m[r["op"]] += r["macs"]
    return t, m


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6, help="profile turns per kernel set")
    ap.add_argument("--repeats", type=int, default=10, help="runs per profile turn")
    a = ap.parse_args()
    if K.get_isa() != "avx2":
        raise SystemExit(f"the comparison is for the AVX2 tier (QTOOL_ISA=avx2); active: {K.get_isa()}")
    K.set_exact_only(True)
    exact = NativeSession(a.model, threads=a.threads)
    K.set_exact_only(False)
    new = NativeSession(a.model, threads=a.threads)
    feeds = make_feeds(new, a.batch)
    o1, o2 = exact.run(None, feeds)[0], new.run(None, feeds)[0]
    assert np.array_equal(o1, o2), "the two kernel sets disagree"
    per = {"exact": [], "maddubs": []}
    for _ in range(a.rounds):
        for name, s in (("exact", exact), ("maddubs", new)):
            per[name].append(s.profile(feeds, repeats=a.repeats))
    # per step: the minimum over turns of the per-turn medians (the least disturbed turn)
    agg = {}
    for name, turns in per.items():
        rows = [dict(r, ms=min(t[i]["ms"] for t in turns)) for i, r in enumerate(turns[0])]
        agg[name] = class_times(rows)
    peak, what = K.peak_gmacs("avx2")
    peak_ex, _ = K.peak_gmacs("avx2-exact")
    print(f"{a.model}: batch {a.batch}, {a.threads} thread(s); outputs equal; measured peak per thread: "
          f"{peak:.0f} GMAC/s ({what}), exact kernel's mix {peak_ex:.0f}")
    print(f"{'class':<14}{'GMAC':>8}{'exact ms':>10}{'GMAC/s':>8}{'new ms':>9}{'GMAC/s':>8}{'% peak':>8}{'speed-up':>10}")
    te, me = agg["exact"]
    tn, mn = agg["maddubs"]
    for op in sorted(tn, key=lambda o: -tn[o]):
        if not mn[op]:
            continue
        ge, gn = me[op] / te[op] / 1e6, mn[op] / tn[op] / 1e6
        print(f"{op:<14}{mn[op] / 1e9:>8.3f}{te[op]:>10.3f}{ge:>8.1f}{tn[op]:>9.3f}{gn:>8.1f}"
              f"{100 * gn / (peak * a.threads):>7.1f}%{te[op] / tn[op]:>9.2f}x")
    tot_e, tot_n = sum(te.values()), sum(tn.values())
    print(f"{'all steps':<14}{'':>8}{tot_e:>10.3f}{'':>8}{tot_n:>9.3f}{'':>8}{'':>8}{tot_e / tot_n:>9.2f}x")
    pairs = {"gemm": defaultdict(int), "dwconv": defaultdict(int)}
    for st in new.program.steps:
        p = getattr(st, "p", None)
        cap = getattr(p, "_cap", None)
        if cap is not None:
            kind = "dwconv" if getattr(p, "kind", "") == "dwconv" else "gemm"
            for k, v in K._native.conv_info(cap)["pairing"].items():
                pairs[kind][k] += v
    for kind, what, fb in (("gemm", "column x block", "second pass"), ("dwconv", "channels", "16-bit form")):
        pr = pairs[kind]
        if pr["blocks"]:
            b = pr["blocks"]
            print(f"{kind} pairing ({what}): natural {100 * pr['natural'] / b:.1f}%, reordered "
                  f"{100 * pr['reordered'] / b:.1f}%, fallback ({fb}) {100 * pr['fallback'] / b:.1f}%")

if __name__ == "__main__":
    main()
