"""Speed of qtool's native runtime against ONNX Runtime (int8 on the same file, fp32 on the
original), measured side by side: the engines take turns in short blocks, so load from other
processes hits all of them alike. Each block starts after a pause (`settle_s`) and an untimed run,
so that one engine's thread pool, still spinning after its last run, does not slow the next: ONNX
Runtime's intra-op workers keep spinning for tens of milliseconds after a run (measured on the
2-vCPU box: a native EfficientNet-Lite0 run right after an ORT run took 9-11 ms with a 0-20 ms
pause, 4.7 ms after 100 ms, 2.8 ms alone). Library side of `qtool bench`."""
from __future__ import annotations

import os
import time

import numpy as np

from qtool.errors import QtoolError
from qtool.limits import MAX_FEED_BYTES, elems, human_bytes
from qtool.modelio import check_pair
from qtool.runtime.profile import measured_peak, op_type_table, top_steps
from qtool.runtime.session import NativeSession


def find_fp32(int8_path: str, workdir: str | None = None) -> str | None:
    """The float model an int8 file came from: qtool's workdir manifest, else a sibling file
    named without the .int8/_int8/-int8/.quant suffix."""
    try:
        from qtool.workdir import Workdir
        m = Workdir(workdir).manifest()
        q, c = m.get("quantize", {}), m.get("calibrate", {})
        if q.get("int8_path") and os.path.abspath(q["int8_path"]) == os.path.abspath(int8_path) \
                and c.get("model_path") and os.path.exists(c["model_path"]):
            return c["model_path"]
    except Exception:
        pass
    d, base = os.path.split(os.path.abspath(int8_path))
    stem = base[:-5] if base.endswith(".onnx") else base
    for suf in (".int8", "_int8", "-int8", ".quant", "_quant", "-quant", ".qdq", "_qdq"):
        if stem.endswith(suf):
            cand = os.path.join(d, stem[: -len(suf)] + ".onnx")
            if os.path.exists(cand):
                return cand
    return None


def ort_session(path: str, threads: int):
    from qtool.ortsession import session
    return session(path, threads)


def make_feeds(sess: NativeSession, batch: int, shape=None, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in sess.get_inputs():
        dims = list(shape) if shape else list(i.shape or [])
        if not dims:
            raise QtoolError(f"{sess.where}: input '{i.name}' has no declared shape; pass --shape")
        dims = [batch if k == 0 else d for k, d in enumerate(dims)]
        if any(not isinstance(d, int) or d <= 0 for d in dims):
            raise QtoolError(f"{sess.where}: input '{i.name}' has dynamic dimensions {i.shape}; pass --shape, "
                             f"e.g. --shape 1,3,224,224")
        nbytes = elems(dims) * 4
        if nbytes > MAX_FEED_BYTES:
            raise QtoolError(f"{sess.where}: input '{i.name}' of shape {dims} would take {human_bytes(nbytes)}, over "
                             f"the limit of {human_bytes(MAX_FEED_BYTES)}; use a smaller --batch or --shape")
        feeds[i.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def bench(model: str, fp32: str | None = None, batches=(1, 8), threads: int = 2, repeats: int = 20,
          shape=None, profile: bool = False, budget_s: float = 4.0, settle_s: float = 0.1,
          log=print) -> dict:
    """-> {'batches': {bs: {'native_ms', 'ort_int8_ms', 'ort_fp32_ms', ...}}, 'profile': ...}
    Times are medians, in ms per image."""
    if not os.path.exists(model):
        raise QtoolError(f"{model}: no such file")
    if fp32 is not None and not os.path.exists(fp32):
        raise QtoolError(f"{fp32}: no such file")
    if fp32 is not None:
        check_pair(fp32, model)
    native = NativeSession(model, threads=threads)
    engines = {"native": native, "ort_int8": ort_session(model, threads)}
    if fp32:
        engines["ort_fp32"] = ort_session(fp32, threads)
    from qtool.runtime.backend import kernel_info
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cpus = os.cpu_count() or 1
    if log and load is not None and load > 0.5 * cpus:
        log(f"note: load average {load:.1f} on {cpus} CPUs: other processes share the cores, absolute times are "
            f"inflated; compare the ratios (the engines take turns in short blocks)")
    res = {"load_average": load, "cpus": cpus, "model": os.path.abspath(model), "fp32": os.path.abspath(fp32) if fp32 else None, "threads": threads,
           "isa": kernel_info(native.K).get("isa"), "backend": native.backend,
           "fallback_nodes": len(native.fallback_nodes()), "batches": {}}
    for bs in batches:
        feeds = make_feeds(native, bs, shape)
        for e in engines.values():  # warm up (and plan, for the native session)
            e.run(None, feeds)
        times = {k: [] for k in engines}
        n_min = repeats if bs == 1 else max(4, repeats // 4)
        block = 5 if bs == 1 else 2
        t_end = time.perf_counter() + budget_s
        while True:
            # engines take turns in blocks: a block starts after a pause, in which the previous
            # engine's spinning worker threads go quiet, and an untimed run (wakes this engine's
            # workers, warms the caches)
            for k, e in engines.items():
                if settle_s > 0:
                    time.sleep(settle_s)
                e.run(None, feeds)
                for _ in range(block):
                    t = time.perf_counter()
                    e.run(None, feeds)
                    times[k].append(time.perf_counter() - t)
            n = len(times["native"])
            if n >= n_min and (time.perf_counter() > t_end or n >= 5 * n_min):
                break
        r = {f"{k}_ms": float(np.median(v)) * 1000 / bs for k, v in times.items()}
        r.setdefault("ort_fp32_ms", None)
        r["runs"] = len(times["native"])
        r["native_vs_ort_int8"] = r["ort_int8_ms"] / r["native_ms"]
        r["native_vs_ort_fp32"] = r["ort_fp32_ms"] / r["native_ms"] if r["ort_fp32_ms"] else None
        res["batches"][bs] = r
        if log:
            log(f"batch {bs:>2}: native {r['native_ms']:7.2f} ms/image | ORT int8 {r['ort_int8_ms']:7.2f} ({r['native_vs_ort_int8']:.2f}x)"
                + (f" | ORT fp32 {r['ort_fp32_ms']:7.2f} ({r['native_vs_ort_fp32']:.2f}x)" if r["ort_fp32_ms"] else "")
                + f"   [{r['runs']} runs, median]")
    if profile:
        res["profile"] = {}
        peak, label = measured_peak(native.K, threads)
        for bs in batches:
            rows = native.profile(make_feeds(native, bs, shape), repeats=max(5, repeats // 2))
            res["profile"][bs] = {"steps": rows, "by_op": op_type_table(rows, threads, peak),
                                  "top": top_steps(rows, threads, peak=peak), "peak_gmacs": peak, "peak": label}
    return res
