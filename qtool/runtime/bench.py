"""Speed of qtool's native runtime against ONNX Runtime (int8 on the same file, fp32 on the
original), measured side by side in interleaved rounds: in each round the engines run in turn,
one run each, again and again, in an order that alternates from round to round, so load from other
processes and the host's state hit all of them alike, and each round gives a paired ratio
(qtool.runtime.bench_stats makes the interval). Each round starts after a pause (`settle_s`); every
engine ran once, untimed, before the first (plans the native session, warms the caches). No
engine's idle threads may take the next one's time: ONNX Runtime's
sessions here do not spin (`session.intra_op.allow_spinning` 0; with it on, its workers spin for
tens of milliseconds after a run: a native EfficientNet-Lite0 run right after an ORT run took 9-11 ms
on the 2-vCPU box, 2.8 ms alone), and the native pool's workers spin for 100 us after a job, then
sleep. Library side of `qtool bench`."""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass

import numpy as np

from qtool.errors import QtoolError
from qtool.limits import MAX_FEED_BYTES, elems, human_bytes
from qtool.modelio import check_pair
from qtool.runtime.backend import cpu_name, kernel_info, pool_spin_us
from qtool.runtime.bench_stats import (
    BETWEEN_RUNS,
    BUSY_LIMIT,
    LEVEL,
    MAX_ROUNDS,
    MAX_SECONDS,
    RESAMPLES,
    SEED,
    WIDTH,
    Ratio,
    ratio_interval,
    round_order,
    rounds_to_use,
)
from qtool.runtime.profile import add_one_thread, measured_peak, op_type_table, top_steps
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
    stem = base.removesuffix(".onnx")
    for suf in (".int8", "_int8", "-int8", ".quant", "_quant", "-quant", ".qdq", "_qdq"):
        if stem.endswith(suf):
            cand = os.path.join(d, stem[: -len(suf)] + ".onnx")
            if os.path.exists(cand):
                return cand
    return None


def ort_session(path: str, threads: int):
    """An ORT session whose idle workers sleep instead of spinning (they would slow the next engine)."""
    from qtool.ortsession import session
    return session(path, threads, spin=False)


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
        feeds[i.name] = _random_input(rng, i, dims)
    return feeds


_INT_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(uint8)": np.uint8, "tensor(int8)": np.int8}


def _random_input(rng, arg, dims):
    """float inputs: standard normal; integer ones (token ids, masks, type ids): a mask all ones, others
    0 or 1 (a valid index of any table: the speed of a text model does not depend on which tokens)."""
    dt = _INT_TYPES.get(getattr(arg, "type", ""))
    if dt is None:
        return rng.standard_normal(dims).astype(np.float32)
    if "mask" in arg.name.lower():
        return np.ones(dims, dt)
    return rng.integers(0, 2, dims).astype(dt)


def cpu_counters():
    """(wall s, CPU s the whole machine spent busy, CPU s this process spent, all its threads), or
    None without /proc/stat. Two of them give what other processes took in between (others_cpus)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    t = os.times()
    return time.perf_counter(), (sum(v) - v[3] - v[4]) / tick, t.user + t.system  # not idle, not iowait


def others_cpus(a, b) -> float | None:
    """How many CPUs other processes kept busy between two cpu_counters() (steal included)."""
    if a is None or b is None or b[0] <= a[0]:
        return None
    return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / (b[0] - a[0]))


def busy_cpus(seconds: float = 0.25) -> float | None:
    """How many CPUs other processes keep busy, measured now over `seconds` while this one sleeps
    (the load average lags by minutes)."""
    a = cpu_counters()
    time.sleep(seconds)
    return others_cpus(a, cpu_counters())


def time_round(engines: dict, order: list, feeds, min_runs: int, min_s: float, settle_s: float = 0.0) -> dict:
    """One round: a pause, then the engines' timed runs in turn (one run each, in `order`, again and
    again) until each has at least `min_runs` and the round has lasted at least `min_s` seconds per
    engine (at most 50 * min_runs runs each). -> {engine: [seconds per run, ...]}

    Runs in turn rather than one block per engine: this 2-vCPU VM's slow spells are shorter than a
    100 ms block, so they fell on one engine's block and not the other's (Lite0, batch 8, 10 rounds,
    two runs one after the other: per-round ratios 0.59-0.94 with blocks, 0.80-0.98 with runs in
    turn). Each engine's run follows another engine's, in every round alike: none keeps the caches
    warm for itself, and none needs an untimed run to wake its workers (the native pool is asleep
    at the start of every run, as at the first)."""
    if settle_s > 0:
        time.sleep(settle_s)
    runs = {k: [] for k in order}
    t_end = time.perf_counter() + min_s * len(order)
    while len(runs[order[0]]) < min_runs or (time.perf_counter() < t_end and len(runs[order[0]]) < 50 * min_runs):
        for k in order:
            t = time.perf_counter()
            engines[k].run(None, feeds)
            runs[k].append(time.perf_counter() - t)
    return runs


def time_rounds(engines: dict, feeds, rounds: int, min_runs: int, min_s: float, settle_s: float = 0.0,
                timer=time_round, first: int = 0) -> list:
    """`rounds` rounds (time_round), numbered from `first`, the engines in round_order(r), and the
    CPUs other processes kept busy during each.
    -> [{'order': [...], 'runs': {engine: [seconds, ...]}, 'others_cpus': float | None}, ...]"""
    out = []
    for r in range(first, first + rounds):
        order = round_order(engines, r)
        gc.collect()
        was = gc.isenabled()
        gc.disable()  # no collection inside a timed round
        try:
            c0 = cpu_counters()
            runs = timer(engines, order, feeds, min_runs, min_s, settle_s)
            out.append({"order": order, "runs": runs, "others_cpus": others_cpus(c0, cpu_counters())})
        finally:
            if was:
                gc.enable()
    return out


def summarize(rounds: list, batch: int, between: float = 0.0) -> dict:
    """Over the rounds that count (bench_stats.rounds_to_use: other processes quiet): medians
    (ms/image) per engine over the timed runs, and every other engine's time over the native one's
    per round with its interval (bench_stats.ratio_interval, widened by `between`: BETWEEN_RUNS in
    `qtool bench`). Every round stays in 'rounds'."""
    engines = list(rounds[0]["runs"])
    use = rounds_to_use([rd.get("others_cpus") for rd in rounds])
    kept = [rounds[i] for i in use]
    round_ms = {k: [float(np.median(r["runs"][k])) * 1000 / batch for r in kept] for k in engines}
    r = {f"{k}_ms": float(np.median(np.concatenate([rd["runs"][k] for rd in kept]))) * 1000 / batch
         for k in engines}
    r.setdefault("ort_fp32_ms", None)
    r["runs"] = sum(len(rd["runs"]["native"]) for rd in kept)
    r["rounds"] = [{"order": rd["order"], "others_cpus": rd.get("others_cpus"), "used": i in use,
                    **{f"{k}_ms": [t * 1000 / batch for t in rd["runs"][k]] for k in engines}}
                   for i, rd in enumerate(rounds)]
    r["rounds_used"] = len(use)
    r["round_ms"] = round_ms
    r["ratios"] = {}
    for k in engines:
        if k != "native":
            r["ratios"][k] = ratio_interval(round_ms[k], round_ms["native"], between=between).as_dict()
    r["between_runs"] = between
    r["native_vs_ort_int8"] = r["ratios"]["ort_int8"]["ratio"]
    r["native_vs_ort_fp32"] = r["ratios"]["ort_fp32"]["ratio"] if "ort_fp32" in r["ratios"] else None
    return r


def model_macs(path: str, feeds: dict) -> int | None:
    """Multiply-accumulates of one image of the model at `path` (its Conv, Gemm and MatMul nodes) for
    inputs shaped as `feeds` (batch 1); None where a shape cannot be inferred."""
    import onnx

    from qtool import graph as G
    try:
        macs = G.total_macs(onnx.load(path), {k: tuple(v.shape) for k, v in feeds.items()})
    except Exception:  # (a model whose shapes ONNX's inference cannot follow: no figure, not an error)
        return None
    return macs or None


@dataclass(frozen=True)
class RoundRules:
    """How the engines take turns: at least `rounds` rounds, in each at least `min_runs` runs and
    `min_s` seconds per engine after a `settle_s` pause; then two more rounds at a time while some
    ratio's range is wider than +-`width`, up to `max_rounds` rounds and `max_s` seconds."""
    rounds: int
    min_runs: int
    min_s: float
    settle_s: float = 0.0
    width: float = WIDTH
    max_rounds: int = MAX_ROUNDS
    max_s: float = MAX_SECONDS


def rounds_until_narrow(engines: dict, feeds, batch: int, rules: RoundRules, timer=time_round,
                        clock=time.perf_counter) -> dict:
    """summarize() of `rules.rounds` rounds, then of two more at a time while some ratio's range is
    wider than +-`rules.width` (up to rules.max_rounds and rules.max_s): a host noisier than usual gets
    more rounds, not a range too wide to decide anything (on this project's 2-vCPU VM, ResNet-50 at
    batch 8 runs one 0.3 s run per engine a round, and 10 such rounds gave ranges of +-8 to +-23 %).
    'widest' is the widest range's half-width at the end, 'narrow' whether it met the width."""
    t0 = clock()
    u = rules
    rr = time_rounds(engines, feeds, u.rounds, u.min_runs, u.min_s, u.settle_s, timer=timer)
    while True:
        r = summarize(rr, batch, BETWEEN_RUNS)
        r["widest"] = max((v["half_width"] for v in r["ratios"].values()), default=0.0)
        r["narrow"] = r["widest"] <= u.width
        if r["narrow"] or len(rr) >= u.max_rounds or clock() - t0 >= u.max_s:
            r["width_goal"], r["seconds"] = u.width, clock() - t0
            return r
        rr += time_rounds(engines, feeds, 2, u.min_runs, u.min_s, u.settle_s, timer=timer, first=len(rr))


def peak_share(macs: int | None, native_ms: float, peak_gmacs: float) -> dict | None:
    """The whole model's MACs per second at native's median time, and that as a share of the peak."""
    if not macs or native_ms <= 0 or peak_gmacs <= 0:
        return None
    g = macs / (native_ms / 1000.0) / 1e9
    return {"gmacs_per_image": macs / 1e9, "gmacs_per_s": g, "peak_gmacs": peak_gmacs, "share": g / peak_gmacs}


def format_batch(bs: int, r: dict) -> str:
    def ratio(k):
        return Ratio(**{f: r["ratios"][k][f] for f in ("ratio", "lo", "hi", "level", "rounds")}).text()
    return (f"batch {bs:>2}: native {r['native_ms']:7.2f} ms/image | ORT int8 {r['ort_int8_ms']:7.2f} ({ratio('ort_int8')})"
            + (f" | ORT fp32 {r['ort_fp32_ms']:7.2f} ({ratio('ort_fp32')})" if r["ort_fp32_ms"] else "")
            + "".join(f" | ORT {k[len(OTHER):]} {r[k + '_ms']:7.2f} ({ratio(k)})" for k in r["ratios"] if k.startswith(OTHER))
            + f"   [{rounds_note(r)}]"
            + (f"\n          native: {r['peak']['gmacs_per_s']:.1f} GMAC/s of the model's "
               f"{r['peak']['gmacs_per_image']:.3g} GMAC/image, {100 * r['peak']['share']:.1f} % of the peak"
               if r.get("peak") else ""))


def rounds_note(r: dict) -> str:
    n, used = len(r["rounds"]), r.get("rounds_used", len(r["rounds"]))
    busy = sum(1 for rd in r["rounds"] if (rd.get("others_cpus") or 0.0) >= BUSY_LIMIT)
    wide = "" if r.get("narrow", True) else f" (the widest range still +-{100 * r['widest']:.0f} % at the limit)"
    if used < n:
        return f"{used} of {n} rounds, {n - used} left out: other processes busy, {r['runs']} native runs{wide}"
    if busy:
        return f"{n} rounds, other processes busy in {busy} of them (too many to leave out), {r['runs']} native runs{wide}"
    return f"{n} rounds, {r['runs']} native runs{wide}"


OTHER = "ort:"  # engine name prefix of another model timed in ONNX Runtime (BenchOptions.others)


@dataclass(frozen=True)
class BenchOptions:
    """What `qtool bench` measures: the batch sizes, threads, input shape (for a model dynamic beyond
    the batch), whether to profile, and how long: at least `rounds` rounds (more, up to
    `max_rounds`, while a range is wider than +-WIDTH), each at least `repeats` runs of each engine at
    batch 1 (a quarter, at least one, at larger batches) and at least `round_s` seconds per engine,
    after a `settle_s` pause. `others`: more ONNX files (the same inputs, e.g. ONNX Runtime's
    quantize_dynamic output of the same model) timed in ONNX Runtime in the same rounds."""
    batches: tuple = (1, 8)
    threads: int = 2
    repeats: int = 5
    shape: tuple | None = None
    profile: bool = False
    rounds: int = 10
    round_s: float = 0.1
    settle_s: float = 0.02
    max_rounds: int = MAX_ROUNDS
    others: tuple = ()


def other_engines(native: NativeSession, paths, threads: int) -> dict:
    """ONNX Runtime sessions of `paths`, named OTHER + file name; each must take the native model's inputs."""
    want = sorted(i.name for i in native.get_inputs())
    out = {}
    for p in paths:
        if not os.path.exists(p):
            raise QtoolError(f"{p}: no such file")
        sess = ort_session(p, threads)
        got = sorted(i.name for i in sess.get_inputs())
        if got != want:
            raise QtoolError(f"{p}: its inputs {got} are not the int8 model's {want}")
        out[OTHER + os.path.basename(p)] = sess
    return out


def bench(model: str, fp32: str | None = None, opts: BenchOptions = BenchOptions(), log=print) -> dict:
    """-> {'batches': {bs: {'native_ms', 'ort_int8_ms', 'ort_fp32_ms', 'ratios', 'rounds', ...}}, 'profile': ...}
    Times are medians, in ms per image; ratios are other engine's time / native time (above 1:
    native is faster), each the median of the paired rounds (rounds_until_narrow) with its 95 %
    bootstrap interval."""
    batches, threads, repeats, shape, profile = opts.batches, opts.threads, opts.repeats, opts.shape, opts.profile
    rounds, round_s, settle_s = opts.rounds, opts.round_s, opts.settle_s
    if not os.path.exists(model):
        raise QtoolError(f"{model}: no such file")
    if fp32 is not None and not os.path.exists(fp32):
        raise QtoolError(f"{fp32}: no such file")
    if fp32 is not None:
        check_pair(fp32, model)
    max_rounds = max(rounds, opts.max_rounds)
    native = NativeSession(model, threads=threads)
    engines = {"native": native, "ort_int8": ort_session(model, threads)}
    if fp32:
        engines["ort_fp32"] = ort_session(fp32, threads)
    engines.update(other_engines(native, opts.others, threads))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cpus = os.cpu_count() or 1
    busy = busy_cpus()
    if log and busy is not None and busy >= BUSY_LIMIT:
        log(f"note: other processes keep {busy:.1f} of {cpus} CPUs busy: absolute times are inflated and the "
            f"intervals wider; compare the ratios")
    kinfo = kernel_info(native.K)
    res = {"load_average": load, "busy_cpus": busy, "cpus": cpus, "cpu": cpu_name(), "model": os.path.abspath(model),
           "fp32": os.path.abspath(fp32) if fp32 else None, "threads": threads,
           "isa": kinfo.get("isa"), "backend": native.backend, "spin_us": pool_spin_us(native.K),
           "fallback_nodes": len(native.fallback_nodes()), "rounds": rounds, "max_rounds": max_rounds,
           "width_goal": WIDTH, "round_s": round_s,
           "settle_s": settle_s, "interval": {"level": LEVEL, "resamples": RESAMPLES, "seed": SEED,
                                              "of": "median of the per-round ratios, rounds resampled; lo-hi: another run's ratio, "
                                                    "ci_lo-ci_hi: the median's confidence interval"},
           "batches": {}}
    if log:
        log(f"{res['cpu']}, {res['isa']} kernels, {threads} threads, {rounds}-{max_rounds} rounds per batch "
            f"(more while a range is wider than +-{100 * WIDTH:.0f} %); ratios are the other "
            f"engine's time over native's (above 1: native faster), median of the rounds, and where another run's "
            f"falls (95 %)")
    one = make_feeds(native, 1, shape)
    # (the int8 model first: its graph is the fused one, whose shapes ONNX infers where a raw export's may not)
    macs = model_macs(model, one) or (model_macs(fp32, one) if fp32 else None)
    peak, peak_label = measured_peak(native.K, threads) if macs or profile else (0.0, None)
    res["model_gmacs_per_image"] = None if macs is None else macs / 1e9
    res["peak_gmacs"], res["peak"] = (peak, peak_label) if macs else (None, None)
    if log and macs:
        log(f"peak: {peak:.0f} GMAC/s ({peak_label})")
    for bs in batches:
        feeds = make_feeds(native, bs, shape)
        for e in engines.values():  # warm up (and plan, for the native session)
            e.run(None, feeds)
        min_runs = repeats if bs == 1 else max(1, repeats // 4)
        r = rounds_until_narrow(engines, feeds, bs, RoundRules(rounds, min_runs, round_s, settle_s, max_rounds=max_rounds))
        r["peak"] = peak_share(macs, r["native_ms"], peak)
        res["batches"][bs] = r
        if log:
            log(format_batch(bs, r))
    res["load_average_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    res["busy_cpus_after"] = busy_cpus()
    if profile:
        res["profile"] = {bs: dict(profile_steps(native, make_feeds(native, bs, shape), max(5, repeats // 2), peak),
                                   peak_gmacs=peak, peak=peak_label) for bs in batches}
    return res


def profile_steps(native: NativeSession, feeds, repeats: int, peak: float) -> dict:
    """Per step and per op type on the session's threads; with more than one, each op type's time on one
    thread beside it ('ms_1t', 'scaling') and the share of the parallel chunks the other threads ran
    ('worker_share': near 0, they were off the CPU and the caller did the work)."""
    threads = native.threads
    pool = lambda: kernel_info(native.K).get("pool", {})  # noqa: E731
    p0 = pool()
    rows = native.profile(feeds, repeats=repeats)
    p1 = pool()
    out = {"steps": rows, "by_op": op_type_table(rows, threads, peak), "top": top_steps(rows, threads, peak=peak)}
    if threads > 1:
        add_one_thread(out["by_op"], op_type_table(native.profile(feeds, repeats=repeats, threads=1), 1, peak))
        chunks = p1.get("chunks", 0) - p0.get("chunks", 0)
        out["worker_share"] = (p1.get("chunks_run_by_workers", 0) - p0.get("chunks_run_by_workers", 0)) / chunks \
            if chunks > 0 else None
    return out
