"""`quantize`: fused graph + calibration table -> INT8 QDQ model and its report, in the working directory."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import onnx
from tqdm import tqdm

from qtool.calibrate.config import config_from_any
from qtool.calibrate.data import ImageData
from qtool.quantize.method_choice import method_scores
from qtool.labels import labels_from_file, labels_from_folders
from qtool.quantize.exclude import exclude_sensitive
from qtool.quantize.range_search import search_ranges
from qtool.quantize.rounding import layer_hessians
from qtool.quantize.sensitivity import layer_sensitivity, quantizable_layers, run_first_output
from qtool.report.sensitivity_html import render as render_sensitivity

from qtool.calibrate.run import FUSED, TABLE
from qtool.calibrate.table import load_table
from qtool.errors import QtoolError
from qtool.fuse import fuse_model
from qtool.modelio import atomic_write_text, json_safe, load_model, model_hash, save_model
from qtool.quantize.qdq import QuantizeOutput, quantize_graph
from qtool.workdir import Workdir

INT8 = "model.int8.onnx"
REPORT = "quantize.json"
SENS_JSON = "sensitivity.json"
MIN_HELD_BACK = 64  # fewer held-back images than this: check exclusions on every calibration image
TUNE_SAMPLES = 32  # calibration images for output-aware rounding and range tuning
SENS_HTML = "sensitivity.html"


@dataclass
class QuantizeResult:
    output: QuantizeOutput
    path: str
    report: dict
    seconds: float
    sensitivity: dict | None = None
    exclusion: object = None
    tuning: object = None  # Tuning: the rounding covariances and tuned ranges the model was built with


def load_inputs(workdir: str | None, model: str | None, table_path: str | None):
    """(fused graph, table, original model path) from explicit paths or the working directory."""
    wd = Workdir(workdir)
    if table_path is None:
        entry = wd.manifest().get("calibrate")
        table_path = entry["table_path"] if entry else None
        if table_path is None:
            if model is not None:
                raise QtoolError(f"{wd.path}: no calibration table; run `qtool calibrate --model {model} --data DIR` "
                                 f"first (or pass --table)")
            wd.require("calibrate", "calibrate")
    table = load_table(table_path)
    if model is not None:
        if model_hash(model) != table.model_sha256:
            raise QtoolError(f"{table_path}: calibration table was made for another model "
                             f"({table.model_path}), not {model}; run `qtool calibrate` on this model")
        fused = fuse_model(load_model(model), _pins(table)).model
        return fused, table, model
    fused_path = os.path.join(os.path.dirname(os.path.abspath(table_path)), FUSED)
    if not os.path.exists(fused_path) or model_hash(fused_path) != table.fused_sha256:
        if not os.path.exists(table.model_path):
            raise QtoolError(f"{fused_path}: fused graph missing or changed, and the original model "
                             f"{table.model_path} is gone; run `qtool calibrate` again")
        if model_hash(table.model_path) != table.model_sha256:
            raise QtoolError(f"{table.model_path}: the model changed since calibration; run `qtool calibrate` again")
        return fuse_model(load_model(table.model_path), _pins(table)).model, table, table.model_path
    return load_model(fused_path, check=False), table, table.model_path


def _pins(table) -> dict:
    c = table.config
    if not c or not table.input_name:
        return {}
    h, w = c["size"]
    ch = 1 if c.get("color") == "GRAY" else 3
    return {table.input_name: [None, ch, h, w] if c.get("layout", "NCHW") == "NCHW" else [None, h, w, ch]}


@dataclass
class SensitivityOptions:
    enabled: bool = True
    samples: int = 64
    exclude_sensitive: bool = False
    target_agreement: float = 0.995
    max_drop: float | None = None
    max_excluded: int = 5
    labels: str | None = None  # labels file for --max-drop (else class folders, if any)
    show_progress: bool = True


def _calibration_feeds(fused, table, files: list, batch: int = 16):
    cfg = config_from_any(table.config)
    data = ImageData(os.path.dirname(files[0]), cfg, fused, table.model_path, batch=batch, files=files)
    names, feeds = [], []
    for n, f in data.batches():
        names.extend(n)
        feeds.append(f)
    return names, feeds


def _labels_for(files: list, labels_file: str | None, data_root: str | None):
    if labels_file:
        ys = labels_from_file(labels_file, files)
    else:
        ys = labels_from_folders(data_root, files) if data_root else None
    return None if ys is None else [(-1 if y is None else y) for y in ys]


def _calibration_files(wd: Workdir) -> list:
    return [f for f in wd.manifest().get("calibrate", {}).get("files", []) if os.path.exists(f)]


def _sensitivity_files(files: list, samples: int) -> list:
    """The calibration images sensitivity (and tuning) use; the others are held back to check exclusions."""
    step = max(1, len(files) // samples) if len(files) > samples else 1
    return files[::step][:samples]


@dataclass
class Tuning:
    """Output-aware weight rounding (rounding.py) and activation ranges (range_search.py)."""
    hessians: dict | None = None
    ranges: dict | None = None
    search: object = None  # RangeSearch
    seconds: float = 0.0
    samples: int = 0


def tune(fused, table, method, wd: Workdir, exclude: dict, bias_correction: bool, rounding: bool, ranges: bool,
         samples: int, weight_cache: dict, say=print, show_progress: bool = True) -> Tuning:
    """Layer input covariances and tuned ranges from `TUNE_SAMPLES` of the sensitivity images (calibration only)."""
    res = Tuning()
    files = _calibration_files(wd)
    if not (rounding or ranges):
        return res
    if not files:
        say("note: no calibration images recorded in the working directory; weights rounded to nearest, "
            "ranges not tuned")
        return res
    t0 = time.time()
    tfiles = _sensitivity_files(files, samples)[:TUNE_SAMPLES]
    _, feeds = _calibration_feeds(fused, table, tfiles)
    res.samples = len(tfiles)
    if rounding:
        res.hessians = layer_hessians(fused, feeds)
    if ranges:
        ref = run_first_output(fused, feeds)
        with tqdm(unit="probe", desc="tune ranges", disable=not show_progress, leave=False) as bar:
            res.search = search_ranges(fused, table, method, feeds, ref, exclude, bias_correction, bar.update,
                                       hessians=res.hessians, weight_cache=weight_cache)
        res.ranges = res.search.ranges or None
        s = res.search
        say(f"tuned ranges: {len(s.ranges)} tensors changed ({s.probes} probes), output SQNR on {len(tfiles)} "
            f"calibration images {s.sqnr_default_db:.1f} -> {s.sqnr_tuned_db:.1f} dB"
            + ("" if s.kept or not s.choices else "; not better, default ranges kept"))
    if res.hessians:
        # round every layer once now, at the ranges that will be used: later builds reuse the cache
        quantize_graph(fused, table, method, exclude, bias_correction, ranges=res.ranges, weight_cache=weight_cache,
                       hessians=res.hessians)
    res.seconds = time.time() - t0
    return res


def run_sensitivity(fused, table, method, opts: SensitivityOptions, wd: Workdir, user_exclude: dict,
                    bias_correction: bool, say=print, tuning: Tuning | None = None, weight_cache: dict | None = None):
    """Sensitivity on `opts.samples` calibration images, then (optionally) the exclusion search on the rest."""
    entry = wd.manifest().get("calibrate", {})
    files = _calibration_files(wd)
    if not files:
        say("note: no calibration images recorded in the working directory; sensitivity skipped")
        return None, None
    tuning = tuning or Tuning()
    t0 = time.time()
    sens_files = _sensitivity_files(files, opts.samples)
    held = [f for f in files if f not in set(sens_files)]
    _, feeds = _calibration_feeds(fused, table, sens_files)
    ref = run_first_output(fused, feeds)
    n_layers = len(quantizable_layers(fused))
    with tqdm(total=n_layers, unit="layer", desc="sensitivity", disable=not opts.show_progress, leave=False) as bar:
        layers = layer_sensitivity(fused, table, method, feeds, ref, bar.update, bias_correction,
                                   ranges=tuning.ranges, hessians=tuning.hessians, weight_cache=weight_cache)
    secs = time.time() - t0
    exclusion = None
    if opts.exclude_sensitive:
        check_files = held if len(held) >= MIN_HELD_BACK else files
        if check_files is files:
            say(f"note: only {len(held)} calibration images held back; checking exclusions on all {len(files)}")
        names, cfeeds = _calibration_feeds(fused, table, check_files)
        cref = run_first_output(fused, cfeeds)
        labels = _labels_for(names, opts.labels, entry.get("data"))
        with tqdm(total=1 + opts.max_excluded * 3 + 12, unit="model", desc="exclude-sensitive",
                  disable=not opts.show_progress, leave=False) as bar:
            exclusion = exclude_sensitive(fused, table, method, layers, cfeeds, cref, opts.target_agreement,
                                          opts.max_drop, labels, opts.max_excluded, bias_correction, user_exclude,
                                          bar.update, ranges=tuning.ranges, hessians=tuning.hessians,
                                          weight_cache=weight_cache)
        exclusion.check_images = len(check_files)
    return {"layers": [l.to_dict() for l in layers], "seconds": secs, "samples": len(sens_files)}, exclusion


AUTO = "auto"
AUTO_SAMPLES = 8


def pick_method(fused, table, wd: Workdir, bias_correction: bool, say=print):
    """The range method whose int8 model has the best output SQNR on a few calibration samples
    (never the evaluation data): (method, {method: dB})."""
    files = [f for f in wd.manifest().get("calibrate", {}).get("files", []) if os.path.exists(f)]
    if not files:
        say(f"note: --method auto needs the calibration samples; none recorded, using {table.method}")
        return table.method, None
    step = max(1, len(files) // AUTO_SAMPLES)
    _, feeds = _calibration_feeds(fused, table, files[::step][:AUTO_SAMPLES])
    scores = method_scores(fused, table, feeds, None, bias_correction=bias_correction)
    best = max(scores, key=scores.get)
    say(f"method auto: {best} (output SQNR on {min(len(files), AUTO_SAMPLES)} calibration samples: "
        + ", ".join(f"{m} {v:.1f} dB" for m, v in scores.items()) + ")")
    return best, scores


def quantize(workdir: str | None = None, model: str | None = None, table_path: str | None = None,
             output: str | None = None, method: str | None = None, exclude: dict | None = None,
             bias_correction: bool = True, sensitivity: SensitivityOptions | None = None, say=print,
             rounding: bool | None = None, tune_ranges: bool | None = None) -> QuantizeResult:
    """`rounding`: output-aware weight rounding from calibration images (rounding.py), nearest otherwise.
    `tune_ranges`: activation ranges chosen at the model output (range_search.py). None (both): on
    with --exclude-sensitive, which tries them before it gives up any layer, off otherwise."""
    t0 = time.time()
    fused, table, model_path = load_inputs(workdir, model, table_path)
    exclude = dict(exclude or {})
    names = {n.name for n in fused.graph.node}
    unknown = [n for n in exclude if n not in names]
    if unknown:
        raise QtoolError(f"--exclude: no node named {', '.join(repr(u) for u in unknown)} in the fused graph "
                         f"(`qtool inspect` lists the names)")
    method = method or table.method
    wd = Workdir(workdir)
    method_scores_db = None
    if method == AUTO:
        method, method_scores_db = pick_method(fused, table, wd, bias_correction, say)
    sens, exclusion = (None, None)
    sens_on = sensitivity is not None and sensitivity.enabled
    auto = bool(sens_on and sensitivity.exclude_sensitive)
    tune_ranges = auto if tune_ranges is None else tune_ranges
    rounding = auto if rounding is None else rounding
    cache = {}
    tuning = tune(fused, table, method, wd, exclude, bias_correction, rounding, tune_ranges,
                  sensitivity.samples if sensitivity is not None else 64, cache, say,
                  sensitivity.show_progress if sensitivity is not None else False)
    if sens_on:
        sens, exclusion = run_sensitivity(fused, table, method, sensitivity, wd, exclude, bias_correction, say,
                                          tuning, cache)
    if exclusion is not None:
        exclude = dict(exclusion.excluded)
    out = quantize_graph(fused, table, method, exclude, bias_correction, ranges=tuning.ranges,
                         weight_cache=cache, hessians=tuning.hessians)
    path = output or wd.file(INT8)
    save_model(out.model, path)
    report = {
        "model": model_path, "int8_model": os.path.abspath(path), "method": method,
        "method_scores_db": method_scores_db,
        "bias_correction": bias_correction,
        "rounding": "output-aware" if tuning.hessians else "nearest",
        "rounded_layers": sorted(tuning.hessians or []),
        "tuned_ranges": None if tuning.search is None else dict(tuning.search.to_dict(), samples=tuning.samples),
        "tuning_seconds": tuning.seconds,
        "summary": out.plan.summary(),
        "excluded": exclude,
        "nodes": [d.__dict__ for d in out.plan.decisions],
        "notes": out.notes,
        "layers": {k: v.__dict__ for k, v in out.layers.items()},
        "size_bytes": {"fp32": os.path.getsize(model_path), "int8": os.path.getsize(path)},
    }
    if sens is not None:
        srep = {"meta": {"model": os.path.basename(model_path), "method": method, "samples": sens["samples"],
                         "seconds": sens["seconds"]},
                "layers": sens["layers"], "excluded": exclude,
                "exclusion": None if exclusion is None else dict(exclusion.to_dict(),
                                                                  check_images=exclusion.check_images),
                "fp32_ops": [d.__dict__ for d in out.plan.decisions if d.status == "fp32"]}
        atomic_write_text(wd.file(SENS_JSON), json.dumps(json_safe(srep), indent=1))
        atomic_write_text(wd.file(SENS_HTML), render_sensitivity(srep))
        report["sensitivity"] = {"json": wd.file(SENS_JSON), "html": wd.file(SENS_HTML), "seconds": sens["seconds"]}
        if exclusion is not None:
            report["exclusion"] = srep["exclusion"]
    atomic_write_text(wd.file(REPORT), json.dumps(json_safe(report), indent=1))
    wd.update(quantize={"int8_path": os.path.abspath(path), "report_path": wd.file(REPORT),
                        "method": report["method"], "excluded": exclude, "bias_correction": bias_correction})
    return QuantizeResult(out, path, report, time.time() - t0, sens, exclusion, tuning)



def fp32_ops_of(out: QuantizeOutput) -> dict:
    c = {}
    for d in out.plan.decisions:
        if d.status == "fp32":
            c.setdefault(d.op_type, []).append(d.reason)
    return c

