"""sensitivity.html: one self-contained page (inline SVG and a few lines of JS, no network).

Every name that comes from the model is escaped: models are untrusted input.
"""
from __future__ import annotations

import json
from html import escape

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;font-size:13px}th,td{padding:3px 8px;border-bottom:1px solid #ddd;text-align:right}
th{cursor:pointer;background:#f4f4f4;position:sticky;top:0}td.l,th.l{text-align:left}
tr.excluded td{background:#fff3e0}.note{color:#555}svg text{font:11px system-ui,sans-serif}
"""

JS = """
document.querySelectorAll('table.sortable th').forEach((th, i) => th.addEventListener('click', () => {
  const tb = th.closest('table').tBodies[0], rows = Array.from(tb.rows);
  const asc = th.dataset.dir !== 'asc'; th.dataset.dir = asc ? 'asc' : 'desc';
  rows.sort((a, b) => { const x = a.cells[i].dataset.v ?? a.cells[i].textContent, y = b.cells[i].dataset.v ?? b.cells[i].textContent;
    const nx = parseFloat(x), ny = parseFloat(y);
    const c = (isNaN(nx) || isNaN(ny)) ? x.localeCompare(y) : nx - ny; return asc ? c : -c; });
  rows.forEach(r => tb.appendChild(r));
}));
"""


def _fmt(v, digits=2):
    if v is None:
        return "-"
    if isinstance(v, float) and v == float("inf"):
        return "inf"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _bar_chart(layers: list, excluded: set) -> str:
    finite = [l["output_sqnr_db"] for l in layers if l["output_sqnr_db"] != float("inf")]
    if not finite:
        return "<p>No layer changes the output measurably.</p>"
    top = max(finite) + 3
    w, h, pad = max(600, 12 * len(layers) + 60), 260, 40
    bw = (w - pad - 10) / max(len(layers), 1)
    deficits = [top - min(l["output_sqnr_db"], top) for l in layers]
    scale = (h - 50) / max(max(deficits), 1e-9)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
             f'aria-label="sensitivity by layer">',
             f'<line x1="{pad}" y1="{h - 30}" x2="{w - 5}" y2="{h - 30}" stroke="#999"/>',
             f'<text x="4" y="14">damage: {top:.0f} dB minus output SQNR with only this layer int8 (taller = more sensitive)</text>']
    for k, (l, d) in enumerate(zip(layers, deficits)):
        x = pad + k * bw
        bh = d * scale
        color = "#e65100" if l["name"] in excluded else "#1565c0"
        tip = escape(f'{l["name"]} ({l["op_type"]}): SQNR {_fmt(l["output_sqnr_db"])} dB, rank {l["rank"]}')
        parts.append(f'<rect x="{x:.1f}" y="{h - 30 - bh:.1f}" width="{max(bw - 2, 1):.1f}" height="{bh:.1f}" '
                     f'fill="{color}"><title>{tip}</title></rect>')
    parts.append(f'<text x="{pad}" y="{h - 12}">graph order: first layer</text>')
    parts.append(f'<text x="{w - 90}" y="{h - 12}">last layer</text></svg>')
    return "".join(parts)


def _curve_chart(curve: list, figures=("agreement", "predicted")) -> str:
    """The trade-off: each step's two figures (exclude.ExclusionResult.figures: a recognizer's texts read and
    positions, an encoder's neighbours and cosine) against the layers kept fp32."""
    if not curve:
        return ""
    w, h, pad = 520, 220, 50
    ys = [p["agreement"] for p in curve] + [p["predicted_agreement"] for p in curve]
    lo, hi = min(ys + [0.99]) - 0.002, 1.0005
    n = max(len(curve) - 1, 1)

    def xy(k, v):
        return pad + k * (w - pad - 20) / n, (h - 30) - (v - lo) / (hi - lo) * (h - 50)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" aria-label="trade-off curve">',
             f'<line x1="{pad}" y1="{h - 30}" x2="{w - 10}" y2="{h - 30}" stroke="#999"/>',
             f'<line x1="{pad}" y1="10" x2="{pad}" y2="{h - 30}" stroke="#999"/>',
             f'<text x="{pad}" y="{h - 8}">layers kept in fp32</text>',
             f'<text x="2" y="12">{escape(figures[0])}</text>']
    for key, color in (("agreement", "#1565c0"), ("predicted_agreement", "#2e7d32")):
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(k, p[key]) for k, p in enumerate(curve)))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
    for k, p in enumerate(curve):
        x, y = xy(k, p["agreement"])
        lat = f', {p["ort_int8_ms"]:.2f} ms' if p.get("ort_int8_ms") else ""
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="#1565c0"><title>{len(p["excluded"])} fp32: '
                     f'{escape(figures[0])} {p["agreement"]:.4f}, {escape(figures[1])} {p["predicted_agreement"]:.4f}'
                     f'{escape(lat)}</title></circle>')
        parts.append(f'<text x="{x - 3:.1f}" y="{h - 18}">{len(p["excluded"])}</text>')
    for v in (lo, (lo + hi) / 2, 1.0):
        parts.append(f'<text x="4" y="{xy(0, v)[1] + 4:.1f}">{v:.3f}</text>')
    parts.append(f'<text x="300" y="24" fill="#1565c0">{escape(figures[0])}</text>'
                 f'<text x="370" y="24" fill="#2e7d32">{escape(figures[1])}</text></svg>')
    return "".join(parts)


def script_json(data) -> str:
    """JSON to embed in a <script> element: still plain JSON (a script's text is not HTML-unescaped,
    so &quot; would break it), with <, > and & as \\u escapes so that no '</script>' or '<!--' in a
    model-provided name can end the element."""
    text = json.dumps(data, allow_nan=False)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def render(report: dict) -> str:
    layers = sorted(report["layers"], key=lambda l: l["order"])
    excluded = report.get("excluded", {})
    rows = []
    for l in layers:
        cls = ' class="excluded"' if l["name"] in excluded else ""
        why = escape(excluded.get(l["name"], ""))
        rows.append(
            f'<tr{cls}><td data-v="{l["order"]}">{l["order"]}</td><td class="l">{escape(l["name"])}</td>'
            f'<td class="l">{escape(l["op_type"])}</td><td data-v="{l["rank"]}">{l["rank"]}</td>'
            f'<td>{_fmt(l["output_sqnr_db"])}</td><td>{_fmt(l["top1_agreement"], 4)}</td><td>{_fmt(l["kl"], 5)}</td>'
            f'<td>{_fmt(l["weight_sqnr_db"])}</td><td>{_fmt(100 * l["clip_fraction"], 4)}</td><td class="l">{why}</td></tr>')
    ex = report.get("exclusion") or {}
    curve = ex.get("curve", [])
    figures = tuple(ex.get("figures") or ("agreement", "predicted"))
    trade = "".join(
        f'<tr><td>{len(p["excluded"])}</td><td class="l">{escape(p.get("added") or "(all int8)")}</td>'
        f'<td>{p["agreement"]:.4f}</td><td>{p["predicted_agreement"]:.4f}</td><td>{_fmt(p["sqnr_db"])}</td>'
        f'<td>{_fmt(p.get("accuracy_drop_pt"))}</td><td>{_fmt(p.get("ort_int8_ms"))}</td></tr>' for p in curve)
    fp32_ops = report.get("fp32_ops", [])
    fp32_list = "".join(f"<li>{escape(d['name'])} ({escape(d['op_type'])}): {escape(d['reason'])}</li>" for d in fp32_ops)
    meta = report.get("meta", {})
    title = escape(meta.get("model", "model"))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>qtool sensitivity: {title}</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<style>{CSS}</style></head><body>
<h1>Per-layer sensitivity: {title}</h1>
<p class="note">Each layer is quantized alone (every other layer fp32) and the model output compared with fp32 on
{meta.get("samples", "?")} calibration images ({escape(str(meta.get("method", "")))} ranges). Ranked by output SQNR,
lowest first. Computed in {meta.get("seconds", 0):.1f} s.</p>
<h2>Sensitivity by layer, in graph order</h2>
{_bar_chart(layers, set(excluded))}
<h2>Layers kept in fp32</h2>
<p>{"".join(f"<b>{escape(n)}</b>: {escape(r)}<br>" for n, r in excluded.items()) or "None: every quantizable layer is int8."}</p>
{"<p>" + escape(("Target reached: " if ex.get("reached") else "Target NOT reached; the best model found was written: ") + ex.get("target", "")) + "</p>" if ex else ""}
<h2>Trade-off: layers kept in fp32 -> agreement -> ONNX Runtime int8 latency</h2>
{_curve_chart(curve, figures) if curve else "<p>Run <code>qtool quantize --exclude-sensitive</code> to compute the trade-off.</p>"}
{('<table><thead><tr><th>fp32 layers</th><th class="l">added</th>'
  f'<th>{escape(figures[0])}</th><th>{escape(figures[1])}</th><th>SQNR dB</th><th>acc. drop pt</th>'
  '<th>ORT int8 ms</th></tr></thead><tbody>' + trade + '</tbody></table>') if curve else ''}
<h2>All layers</h2>
<table class="sortable"><thead><tr><th>#</th><th class="l">layer</th><th class="l">op</th><th>rank</th>
<th>output SQNR dB</th><th>top-1 agreement</th><th>KL</th><th>weight SQNR dB</th><th>clipped %</th><th class="l">kept fp32 because</th>
</tr></thead><tbody>{"".join(rows)}</tbody></table>
<h2>Ops that stay fp32 (no int8 rule or not quantizable)</h2>
<ul>{fp32_list or "<li>none</li>"}</ul>
<script>{JS}</script>
<script type="application/json" id="data">{script_json({"n_layers": len(layers)})}</script>
</body></html>
"""
