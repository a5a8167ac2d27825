"""What `quantize` reports: quantize.json, the sensitivity report (JSON and HTML), the manifest entry,
and the text the command prints from them."""
from __future__ import annotations

import json
import os
import re

from qtool import outputs
from qtool.modelio import atomic_write_text, json_safe, model_bytes
from qtool.quantize.encoding import TARGETS
from qtool.quantize.method_choice import report as method_report
from qtool.quantize.qdq import QuantizeOutput
from qtool.quantize.steps.write import INT8
from qtool.report.sensitivity_html import render as render_sensitivity
from qtool.workdir import MANIFEST, Workdir

REPORT = "quantize.json"
SENS_JSON = "sensitivity.json"
SENS_HTML = "sensitivity.html"


def writes(wd: Workdir, output: str | None, sensitivity: bool) -> list:
    """What quantize writes: the int8 model (and its external-data file, should it need one), the
    report, the sensitivity report, the manifest."""
    path = output or wd.file(INT8)
    what = "int8 model" + (" (-o)" if output else "")
    return ([outputs.File(what, path, "quantize.int8_path"), outputs.File(f"{what}'s data", path + ".data"),
             outputs.File("quantize report", wd.file(REPORT), "quantize.report_path")]
            + ([outputs.File("sensitivity report", wd.file(SENS_JSON)), outputs.File("sensitivity page", wd.file(SENS_HTML))]
               if sensitivity else [])
            + [outputs.File("manifest", wd.file(MANIFEST))])


def _samples_used(run) -> dict:
    """Every number of calibration samples a step measured on (and of how many input sizes), and why that
    many: the work of a pass counted (budget.py) or, where it cannot be counted, each step's fixed default;
    never a timing."""
    a = run.afforded
    return {"basis": a.budget.basis if a is not None else "fixed",
            "gmac_per_sample": None if a is None or a.budget.macs_per_sample is None
            else round(a.budget.macs_per_sample / 1e9, 6),
            "steps": dict(sorted(run.used.items())),
            "input_sizes": dict(sorted(run.ctx.sizes_used.items()))}


def _tuning(run) -> dict:
    t = run.tuning
    return {"rounding": "output-aware" if t.hessians else "nearest",
            "rounded_layers": sorted(t.hessians or []),
            "tuned_ranges": None if t.search is None else dict(t.search.to_dict(), samples=t.samples),
            "tuning_seconds": t.seconds,
            "unrounded_layers": t.unrounded if t.hessians else {},
            # (what verified the rounding, on how many samples, by which figure, and what it decided)
            "rounding_check": None if t.check is None else t.check.to_dict()}


def quantize_report(run) -> dict:
    """What quantize.json holds."""
    out, o, model_path = run.out, run.options, run.inputs.model_path
    report = {
        "model": model_path, "int8_model": os.path.abspath(run.path), "method": run.ctx.method,
        **method_report(run.method_measures), "target": o.target,
        "target_description": TARGETS[o.target].description, "target_cost": run.cost,
        "encodings": encoding_counts(out), "encoding_choice": run.encoding_reasons, "input_grid": run.input_grid,
        "dynamic_inputs": run.dynamic,
        "embeddings": {k: v.__dict__ for k, v in out.embeddings.items()},
        "bias_correction": o.bias_correction,
        **_tuning(run),
        "budget": None if run.afforded is None else run.afforded.to_dict(),
        "samples_used": _samples_used(run),
        "optional_steps": run.steps.to_dict(),
        "resized_share": run.ctx.resized,
        "summary": out.plan.summary(),
        "subgraphs": [{"node": n, "branch": b, "summary": q.report["summary"], "int8_model": q.path,
                       "fallbacks": q.report["optional_steps"]["fallbacks"]} for n, b, q in run.branches],
        "excluded": run.final_exclude,
        "nodes": [d.__dict__ for d in out.plan.decisions],
        "notes": out.notes,
        "layers": {k: v.__dict__ for k, v in out.layers.items()},
        "size_bytes": {"fp32": model_bytes(model_path), "int8": model_bytes(run.path)},
        "ort_float_layers": run.ort_float,
    }
    if o.verify:  # (--verify: each step that changes the model, measured with and without it on held-out samples)
        report["verified"] = {k: v.to_dict() for k, v in run.verdicts.items()}
    return report


def write_reports(run, report: dict) -> None:
    """sensitivity.json and .html (when measured), then quantize.json, then the manifest's entry."""
    wd, sens, exclusion = run.wd, run.sensitivity, run.exclusion
    if sens is not None:
        srep = {"meta": {"model": os.path.basename(run.inputs.model_path), "method": run.ctx.method,
                         "target": run.options.target, "samples": sens["samples"], "seconds": sens["seconds"]},
                "layers": sens["layers"], "excluded": run.final_exclude,
                "exclusion": None if exclusion is None else dict(exclusion.to_dict(),
                                                                  check_images=exclusion.check_images,
                                                                  check_held_back=exclusion.check_held_back),
                "fp32_ops": [d.__dict__ for d in run.out.plan.decisions if d.status == "fp32"]}
        atomic_write_text(wd.file(SENS_JSON), json.dumps(json_safe(srep), indent=1))
        atomic_write_text(wd.file(SENS_HTML), render_sensitivity(srep))
        report["sensitivity"] = {"json": wd.file(SENS_JSON), "html": wd.file(SENS_HTML), "seconds": sens["seconds"]}
        if exclusion is not None:
            report["exclusion"] = srep["exclusion"]
    atomic_write_text(wd.file(REPORT), json.dumps(json_safe(report), indent=1))
    table = run.inputs.table
    wd.update(drop=("eval",),
              quantize={"int8_path": os.path.abspath(run.path), "int8_sha256": run.saved.file_sha256,
                        "table_sha256": table.sha256, "model_sha256": table.model_sha256,
                        "report_path": wd.file(REPORT),
                        "method": report["method"], "target": run.options.target, "excluded": run.final_exclude,
                        "bias_correction": run.options.bias_correction})


def encoding_counts(out: QuantizeOutput) -> dict:
    c = {}
    for l in out.layers.values():
        if l.encoding:
            c[l.encoding] = c.get(l.encoding, 0) + 1
    return c


def reasons_text(reasons: list) -> str:
    """One op type's reasons for staying fp32, each said once; the sensitivity ranks of the layers
    --exclude-sensitive kept are listed together ("kept fp32 by --exclude-sensitive, sensitivity
    ranks 1, 2, 3, 4, 10"), not the first layer's rank for all."""
    groups = {}
    for r in reasons:
        m = re.fullmatch(r"(.*) \(rank (\d+)\)", r or "")
        base, rank = (m.group(1), int(m.group(2))) if m else (r, None)
        groups.setdefault(base, []).append(rank)
    parts = []
    for base, ranks in groups.items():
        rs = sorted(r for r in ranks if r is not None)
        text = base + (f", sensitivity rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}" if rs else "")
        parts.append(text + (f" x{len(ranks)}" if len(groups) > 1 else ""))
    return "; ".join(parts)


def fp32_ops_of(out: QuantizeOutput) -> dict:
    c = {}
    for d in out.plan.decisions:
        if d.status == "fp32":
            c.setdefault(d.op_type, []).append(d.reason)
    return c


def sensitivity_lines(sensitivity: dict) -> list:
    """The sensitivity analysis as the command prints it: the ten most sensitive layers."""
    layers = sorted(sensitivity["layers"], key=lambda l: l["rank"])
    lines = [f"sensitivity of {len(layers)} layers on {sensitivity['samples']} images "
             f"({sensitivity['seconds']:.1f}s); most sensitive:",
             f"  {'rank':>4}  {'layer':44} {'op':8} {'SQNR dB':>8} {'agree':>7} {'KL':>8} {'w SQNR':>7} {'clip %':>7}"]
    for l in layers[:10]:
        ws = "-" if l["weight_sqnr_db"] is None else f"{l['weight_sqnr_db']:.1f}"
        lines.append(f"  {l['rank']:>4}  {l['name'][-44:]:44} {l['op_type'][:8]:8} {l['output_sqnr_db']:>8.1f} "
                     f"{l['top1_agreement']:>7.4f} {l['kl']:>8.5f} {ws:>7} {100 * l['clip_fraction']:>7.3f}")
    return lines


def exclusion_lines(e, user_excluded) -> list:
    """--exclude-sensitive's search as the command prints it: each step tried, and what it kept fp32
    beside the user's `user_excluded` nodes."""
    agreement, predicted = e.figures  # (an encoder's: neighbour agreement, cosine)
    lines = [f"exclude-sensitive ({e.target}, checked on {e.check_images} "
             + ("held-back images):" if e.check_held_back else "calibration images, not held back):"),
             f"  {'fp32 layers':>11}  {agreement + ' [95% interval]':>25}  {predicted:>9}  {'SQNR dB':>7}  "
             f"{e.error:>8}  {'ORT int8 ms':>11}  step"]
    for p in e.curve:
        ms = "-" if p.ort_int8_ms is None else f"{p.ort_int8_ms:.2f}"
        gain = "" if p.gain_se is None else f"gain {p.gain_se:.1f} SE"
        step = "all int8" if not p.added else (f"+{p.added[-40:]} ({gain})" if p.kept else
                                               f"+{p.added[-40:]} ({gain}: {p.undone or 'no gain'}, undone)")
        lines.append(f"  {len(p.excluded):>11}  {p.agreement:>7.4f} [{p.agreement_95[0]:.4f}, {p.agreement_95[1]:.4f}]"
                     f"  {p.predicted_agreement:>9.4f}  {p.sqnr_db:>7.1f}  "
                     f"{(f'{p.kl:>8.1f}' if e.error == '-SQNR' else f'{p.kl:>8.5f}')}  {ms:>11}  {step}")
    kept = [n for n in e.excluded if n not in user_excluded]
    lines.append(("  target reached" if e.reached else "  target NOT reached; wrote the best model found")
                 + f" with {len(e.excluded) - len(user_excluded)} layers kept fp32: {', '.join(kept) or 'none'}")
    return lines


def summary_lines(report: dict, seconds: float, target: str) -> list:
    """What was quantized, and what the target's encoding costs."""
    s = report["summary"]
    subs = report.get("subgraphs") or []
    inside = (f" (and in {len(subs)} If branch{'es' if len(subs) > 1 else ''}, quantized as models of their own: "
              f"{sum(b['summary'].get('int8', 0) for b in subs)} ops int8, "
              f"{sum(b['summary'].get('fp32', 0) for b in subs)} fp32)") if subs else ""
    enc = report["encodings"]
    line = f"target {target}: weights " + (", ".join(f"{k} x{v}" for k, v in sorted(enc.items())) or "none in int8")
    cost = report.get("target_cost")
    if cost:
        line += f"; output SQNR on {cost['samples']} calibration images {cost['output_sqnr_db']:.2f} dB " + (
            f"(plain int8 weights: {cost['output_sqnr_plain_int8_db']:.2f} dB)"
            if cost.get("output_sqnr_plain_int8_db") is not None else f"({cost.get('measured', '')})")
    return [f"quantized in {seconds:.1f}s with {report['method']} ranges: {s.get('int8', 0)} ops int8, "
            f"{s.get('passthrough', 0)} pass int8 through, {s.get('fused', 0)} activations fused, "
            f"{s.get('fp32', 0)} stay fp32{inside}", line]


def fp32_lines(out: QuantizeOutput, verbose: bool) -> list:
    """The ops that stay fp32 and why, and the build's notes (all with `verbose`, else the opset's)."""
    lines = [f"  fp32: {op} x{len(reasons)} ({reasons_text(reasons)})" for op, reasons in sorted(fp32_ops_of(out).items())]
    return lines + [f"  note: {note}" for note in out.notes if verbose or "opset" in note]


def written_lines(report: dict, path: str) -> list:
    sb = report["size_bytes"]
    lines = [f"wrote {path} ({sb['int8'] / 1e6:.2f} MB, {100 * sb['int8'] / sb['fp32']:.1f}% of fp32)"]
    if report.get("sensitivity"):  # (absent when a write before it failed)
        lines.append(f"wrote {report['sensitivity']['html']}")
    return lines + ["next: qtool eval --compare fp32 --data DIR"]
