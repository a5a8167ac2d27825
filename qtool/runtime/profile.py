"""Where the runtime's time goes: per-op-type totals from NativeSession.profile()."""
from __future__ import annotations

from collections import OrderedDict

# vpdpbusd on Zen 4: 64 MAC per instruction, ~3.6 G instructions/s per core (shared/anchors/ANCHORS.md);
# used only when the kernels cannot measure a peak (numpy backends)
VNNI_GMACS_PER_CORE = 233.0


def measured_peak(K, threads: int) -> tuple[float, str]:
    """(GMAC/s, label): the active tier's GEMM mix in a register-only loop, timed on this machine
    (qtool.kernels.peak_gmacs), times the threads; the recorded VNNI figure for other backends."""
    f = getattr(K, "peak_gmacs", None)
    isa = K.get_isa() if hasattr(K, "get_isa") else None
    if f is not None and isa:
        g, what = f(isa)
        if g > 0:
            return g * threads, f"{isa} peak, measured ({what} loop, {g:.0f} GMAC/s per thread)"
    return VNNI_GMACS_PER_CORE * threads, "VNNI peak (recorded, not measured here)"


def op_type_table(rows, threads: int, peak: float | None = None):
    """rows: NativeSession.profile() output -> list of dicts per op type, biggest time first.
    peak: GMAC/s the shares are of (default: the recorded VNNI figure times threads)."""
    agg = OrderedDict()
    total = sum(r["ms"] for r in rows) or 1e-9
    for r in rows:
        key = r["op"] if r["mode"] != "fp32" else f"{r['op']} (fp32)"
        a = agg.setdefault(key, {"op": key, "n": 0, "ms": 0.0, "macs": 0})
        a["n"] += 1
        a["ms"] += r["ms"]
        a["macs"] += r["macs"]
    peak = peak or VNNI_GMACS_PER_CORE * threads
    out = []
    for a in sorted(agg.values(), key=lambda a: -a["ms"]):
        a["share"] = a["ms"] / total
        a["gmac"] = a["macs"] / 1e9
        a["gmacs_per_s"] = a["macs"] / (a["ms"] / 1000) / 1e9 if a["ms"] > 0 and a["macs"] else 0.0
        a["peak_frac"] = a["gmacs_per_s"] / peak if a["macs"] else 0.0
        out.append(a)
    out.append({"op": "total", "n": len(rows), "ms": total, "share": 1.0,
                "gmac": sum(r["macs"] for r in rows) / 1e9,
                "gmacs_per_s": sum(r["macs"] for r in rows) / (total / 1000) / 1e9, "macs": 0, "peak_frac": 0.0})
    out[-1]["peak_frac"] = out[-1]["gmacs_per_s"] / peak
    return out


def add_one_thread(table, table_1t) -> None:
    """Put each op type's time on one thread (a table of the same steps) beside its time here: 'ms_1t',
    and 'scaling' = ms_1t / ms (2.0 on two threads: the op split perfectly; 1.0: not at all)."""
    one = {a["op"]: a["ms"] for a in table_1t}
    for a in table:
        if a["op"] in one:
            a["ms_1t"] = one[a["op"]]
            a["scaling"] = one[a["op"]] / a["ms"] if a["ms"] > 0 else 0.0


def format_table(table):
    more = any("ms_1t" in a for a in table)
    lines = [f"  {'op':<24}{'n':>4}{'ms':>9}{'share':>8}{'GMAC':>9}{'GMAC/s':>9}{'% peak':>8}"
             + (f"{'1T ms':>9}{'x':>6}" if more else "")]
    for a in table:
        lines.append(f"  {a['op']:<24}{a['n']:>4}{a['ms']:>9.3f}{100 * a['share']:>7.1f}%{a['gmac']:>9.4f}"
                     f"{a['gmacs_per_s']:>9.1f}{100 * a['peak_frac']:>7.1f}%"
                     + (f"{a['ms_1t']:>9.3f}{a['scaling']:>6.2f}" if "ms_1t" in a else ""))
    return "\n".join(lines)


def top_steps(rows, threads: int, n: int = 8, peak: float | None = None):
    """The n slowest steps: name, op, kernel, ms, GMAC/s, share of the peak."""
    peak = peak or VNNI_GMACS_PER_CORE * threads
    out = []
    for r in sorted(rows, key=lambda r: -r["ms"])[:n]:
        g = r["macs"] / (r["ms"] / 1000) / 1e9 if r["ms"] > 0 and r["macs"] else 0.0
        out.append({**r, "gmacs_per_s": g, "peak_frac": g / peak})
    return out


def format_top(top):
    lines = [f"  {'slowest steps':<44}{'op':<10}{'ms':>8}{'GMAC/s':>9}{'% peak':>8}  kernel"]
    for r in top:
        lines.append(f"  {r['name'][:43]:<44}{r['op'][:9]:<10}{r['ms']:>8.3f}{r['gmacs_per_s']:>9.1f}"
                     f"{100 * r['peak_frac']:>7.1f}%  {r['kernel']}")
    return "\n".join(lines)
