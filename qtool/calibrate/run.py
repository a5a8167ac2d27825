"""`calibrate`: model + data -> fused fp32 graph + calibration table, in the working directory."""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field

import onnx
from tqdm import tqdm

from qtool import graph as G
from qtool import outputs
from qtool.calibrate.budget import Spend
from qtool.calibrate.checks import stem_fit
from qtool.calibrate.collect import Pass, Targets, collect
from qtool.calibrate.segments import ShapesAt
from qtool.calibrate.stream import Seen, noted_feeds
from qtool.calibrate.options import CalibrateOptions
from qtool.calibrate.table import FLAT, CalibrationTable, ranges_for_all_methods
from qtool.data.config import config_from_any, config_name
from qtool.data.images import list_images
from qtool.data.sources import ImageData
from qtool.data.tensors import tensor_source
from qtool.errors import LateWriteError, QtoolError, UsageError
from qtool.fuse import fuse_model
from qtool.modelio import ModelFile, read_model_file, save_model
from qtool.plan import ModelFacts, balanced_tensors, calibration_targets
from qtool.qparams import clip_to_flat
from qtool.rules.activations import AWARE, activation_inputs, activation_mse_range, flat_bounds
from qtool.timing import Phases
from qtool.workdir import MANIFEST, Workdir

FUSED = "fused.onnx"
TABLE = "calibration.json"


@dataclass
class CalibrateResult:
    table: CalibrationTable
    fused: onnx.ModelProto
    fused_path: str
    table_path: str
    seconds: float
    fuse_counts: dict
    notes: list = field(default_factory=list)  # what was assumed or adapted about the preprocessing
    warnings: list = field(default_factory=list)  # the preprocessing may be wrong (checks.py)
    budget: dict = field(default_factory=dict)  # budget.Spend: samples available, GMAC each, how many used
    phases: dict = field(default_factory=dict)  # phase -> seconds (timing.Phases): where the time went
    fuse_seconds: dict = field(default_factory=dict)  # graph pass -> seconds, within the phase 'fuse'


def calibrate(model_path: str, data, options: CalibrateOptions = CalibrateOptions(), workdir: str | None = None,
              say=print, also_writes=()) -> CalibrateResult:
    """`data`: a folder of images, of .npy files or of .npz files (see data/tensors.py), or any
    iterable of {input name: array} dicts (or of arrays, for a one-input model). `options`: the
    preprocessing, method, threads and which samples (options.py); `say` is told what was assumed
    before the pass starts. The working directory is made and checked writable first, and held for the
    whole run; what the run will write (there, and `also_writes`: outputs.File, as the command's --json)
    is checked against what it reads once the model is read, before any other work (outputs.py)."""
    options.check()
    wd = Workdir(workdir)
    with wd.lock(create=True):
        return _calibrate(_Job(model_path, data, options, wd, say), also_writes)


def writes(wd: Workdir) -> list:
    """What calibrate writes in the working directory."""
    fused = wd.file(FUSED)
    return [outputs.File("fused graph", fused, "calibrate.fused_path"), outputs.File("fused graph's data", fused + ".data"),
            outputs.File("calibration table", wd.file(TABLE), "calibrate.table_path"),
            outputs.File("manifest", wd.file(MANIFEST))]


@dataclass(frozen=True)
class _Job:
    """What one calibration was asked to do, and where."""
    model_path: str
    data: object
    options: CalibrateOptions
    wd: Workdir
    say: object


@dataclass
class _Input:
    """The model, read once, and the data source fitted to it: all later stages take from here."""
    model: onnx.ModelProto | None  # fused in place (_fuse), then let go
    model_sha256: str  # of the bytes parsed
    source: object  # ImageData or a tensor source (data/)
    notes: list  # what was assumed or adapted about the model or the preprocessing
    alerts: list  # what may be wrong with the preprocessing (checks.py)


def _calibrate(job: _Job, also_writes) -> CalibrateResult:
    t0 = time.time()
    phases = Phases()
    phases.lap("read model")
    notes = []
    read = read_model_file(job.model_path, notes=notes)  # (hashed from the bytes parsed)
    outputs.check(writes=list(also_writes) + writes(job.wd),  # (the model's external data as read: no second read)
                  reads=outputs.model("fp32 model", job.model_path, external=read.external)
                  + outputs.data("data folder", job.data) + outputs.config("--config file", job.options.config)
                  + outputs.recorded(job.wd.manifest()))
    inp = _fit_data(job, read, notes, phases)
    del read  # (inp holds the model: fused in place, it is let go there)
    phases.lap("fuse")
    fused = _fuse(job, inp)
    phases.lap("calibration pass")
    seen = _calibration_pass(job, inp.source, fused.model)
    nonfinite = _checked(job, seen, inp.source, fused.model, inp.alerts)
    phases.lap("ranges")
    ranges, aware = _finished_ranges(fused.model, seen.obs.histograms)
    phases.lap("write")
    table = _table(job, inp, seen, ranges, nonfinite)
    table.fused_sha256 = save_model(fused.model, job.wd.file(FUSED)).model_sha256  # (hashed as written)
    table.save(job.wd.file(TABLE))
    result = CalibrateResult(table, fused.model, job.wd.file(FUSED), job.wd.file(TABLE), time.time() - t0,
                             fused.counts, inp.notes, inp.alerts, seen.spend.to_dict(), {}, fused.seconds)
    try:  # (the table is written: should the manifest fail now, the figures are still shown)
        _record(job, table, inp, seen, aware)
    except QtoolError as e:
        result.phases = phases.stop()
        raise LateWriteError(str(e), result) from None
    result.seconds, result.phases = time.time() - t0, phases.stop()
    result.phases.update({f"calibration pass: {k}": v for k, v in seen.phases.items()})  # (sharded: sharded.py)
    return result


def _fit_data(job: _Job, read: ModelFile, load_notes: list, phases: Phases) -> _Input:
    """The data source fitted to the model as read, and what was assumed, said."""
    model_path, data, o, model = job.model_path, job.data, job.options, read.model
    q = G.quantized_ops(model)
    if q:
        raise QtoolError(f"{model_path}: already int8 ({', '.join(f'{k} x{v}' for k, v in sorted(q.items()))}); "
                         f"calibrate the fp32 original")
    cfg = None if o.config is None else config_from_any(o.config)
    phases.lap("list data")
    s = o.sampling
    source = tensor_source(data, model, model_path, batch=s.batch, limit=s.limit, every=s.every)
    if source is None:
        files = list_images(data)[::s.every]
        source = ImageData(data, cfg, model, model_path, batch=s.batch, limit=s.limit, files=files)
    elif o.config is not None:
        raise UsageError(f"--config describes image preprocessing; {_describe(data)} holds tensors, fed as they are")
    notes, alerts = load_notes + list(getattr(source, "notes", [])), []
    for line in notes:
        job.say(line)
    if source.kind == "images":
        phases.lap("stem check")
        fit = stem_fit(model, source.inp.name, source.files, source.cfg, config_name(source.cfg), o.threads,
                       source.assumed)
        if fit is not None and fit.warning():
            alerts.append(fit.warning())
            warnings.warn(alerts[-1], stacklevel=3)
    return _Input(model, read.sha256, source, notes, alerts)


def _fuse(job: _Job, inp: _Input):
    """The model fused in place (inp.model is let go: the fused graph is all that is needed from here on)."""
    fused = fuse_model(inp.model, inp.source.pins, inplace=True)
    inp.model = None
    for line in fused.messages:  # (what changed the model as a whole, not one node)
        if line.startswith(("upgrade_opset:", "upcast_float16:")):
            job.say("note: " + line.split(": ", 1)[1])
    return fused


def _calibration_pass(job: _Job, source, model: onnx.ModelProto) -> Seen:
    """The calibration pass: the source's batches, thinned to the budget, streamed through the fused graph."""
    facts = ModelFacts.of(model)  # (what both plans below read of the graph, worked out once)
    ranges, means = calibration_targets(model, facts)
    if not ranges:  # (the int8 model will be the fp32 one; quantize says which ops stay fp32 and why)
        warnings.warn(f"{job.model_path}: nothing in this model's graph has an int8 rule"
                      + (f" (what it computes sits in {', '.join(sorted(sub))} subgraphs, which stay fp32)"
                         if (sub := {n.op_type for n in model.graph.node if G._subgraphs(n)}) else ""),
                      stacklevel=3)
    out = model.graph.output[0] if model.graph.output else None
    watch = out.name if out is not None and out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT else None
    s = job.options.sampling
    seen = Seen(None, [], {}, Spend(s.budget_gmac, len(source)), source.skipped)
    shapes = ShapesAt(model)  # (the budget and collect's plan both read the first batch's shapes)
    show = job.options.show_progress
    macs = lambda f: G.total_macs(model, shapes.inputs(f), shapes(f))
    targets = Targets(ranges, means, watch, balanced_tensors(model, facts))
    with tqdm(total=len(source) or None, unit="sample", desc="calibrate", disable=not show, leave=False) as bar:
        def planned(line):
            job.say(line)
            bar.total = seen.spend.planned
            bar.refresh()

        run = Pass(bar.update, job.options.threads, f"{job.model_path} (fused)",
                   cut=source.kind == "images" or source.batch > 1, shapes=shapes)
        if job.options.ray is not None:  # (Ray is imported only then: distributed/cluster.py)
            from qtool.calibrate.sharded import Sharded, sharded_pass
            return sharded_pass(Sharded(model, source, targets, run, job.options), seen, macs, planned)
        batches = noted_feeds(source, seen, macs, planned, {i.name for i in G.real_inputs(model)})
        seen.obs = collect(model, targets, batches, run)
    return seen


def _checked(job: _Job, seen: Seen, source, model: onnx.ModelProto, alerts: list) -> dict:
    """Samples there were; NaN/inf said (-> the table's nonfinite); the first output's summary warned of."""
    obs, data = seen.obs, job.data
    if obs.n_samples == 0:
        raise QtoolError(f"{_describe(data)}: no samples" if source.kind != "images" else
                         f"{data}: none of the {len(source)} images could be read")
    nonfinite = check_nonfinite(obs, seen.names, _describe(data))
    by_design = obs.watch is not None and G.unmasked(model, obs.watch.name) != obs.watch.name
    if obs.watch is not None and obs.watch.warning(by_design):
        alerts.append(obs.watch.warning(by_design))
        warnings.warn(alerts[-1], stacklevel=3)
    return nonfinite


def _finished_ranges(model: onnx.ModelProto, histograms: dict) -> tuple:
    """Every method's ranges from the histograms, with the activation-aware `mse` where an activation
    alone reads a tensor, and each method again as `<method>+flat` where a flat end leaves steps unspent.
    -> (method -> tensor -> [lo, hi], tensor -> the activation's label)"""
    ranges_all = ranges_for_all_methods(histograms)
    aware = {}  # tensors read only by an activation: `mse` minimises the activation's output error
    for t, (label, f) in activation_inputs(model).items():
        if t in histograms and label in AWARE:
            ranges_all["mse"][t] = list(activation_mse_range(histograms[t], f))
            aware[t] = label
    flat = {t: ab for t, ab in flat_bounds(model).items() if t in histograms}
    for m in list(ranges_all) if flat else []:  # each method again, the steps beyond flat ends not spent
        r = dict(ranges_all[m])
        for t, (a, b) in flat.items():
            if t in r:
                r[t] = list(clip_to_flat(r[t][0], r[t][1], a, b))
        if r != ranges_all[m]:
            ranges_all[m + FLAT] = r
    return ranges_all, aware


def _table(job: _Job, inp: _Input, seen: Seen, ranges: dict, nonfinite: dict) -> CalibrationTable:
    obs, source = seen.obs, inp.source
    return CalibrationTable(
        model_path=os.path.abspath(job.model_path), model_sha256=inp.model_sha256,
        fused_sha256="", method=job.options.method, n_samples=obs.n_samples, skipped=list(seen.skipped),
        config=source.cfg.to_dict() if source.cfg is not None else {}, ranges=ranges,
        channel_means=obs.channel_means(), channel_ranges=obs.channel_ranges(),
        histograms={t: h.to_dict() for t, h in obs.histograms.items()},
        input_name=source.inp.name if source.kind == "images" else "", nonfinite=nonfinite,
        lattices={k: lat.to_dict() for k, d in seen.distinct.items() if (lat := d.lattice()) is not None})


def _record(job: _Job, table: CalibrationTable, inp: _Input, seen: Seen, aware: dict) -> None:
    """The calibration into the manifest: a new calibration, so the previous int8 model and its evaluation
    no longer belong here."""
    wd, source, obs, spend = job.wd, inp.source, seen.obs, seen.spend
    wd.update(drop=("quantize", "eval"),
              calibrate={"model_path": table.model_path, "model_sha256": table.model_sha256,
                         "fused_path": wd.file(FUSED), "fused_sha256": table.fused_sha256, "table_path": wd.file(TABLE),
                         "table_sha256": table.sha256, "method": job.options.method,
                         "config": table.config, "preprocessing_notes": inp.notes, "preprocessing_warnings": inp.alerts,
                         "fp32_output": obs.watch.summary() if obs.watch is not None else None,
                         "data": _describe(job.data, absolute=True),
                         "data_kind": source.kind, "activation_aware_mse": aware, "n_samples": obs.n_samples,
                         "skipped": len(seen.skipped), "budget": spend.to_dict(),
                         "files": seen.names if spend.capped else
                         [os.path.abspath(f) if source.kind != "iterable" else f for f in source.files]})


def check_nonfinite(obs, names: list, where: str) -> dict:
    """NaN and inf were left out of every statistic (observed.py); say where they were, once.
    A tensor with no finite value at all has no range: that is an error naming its samples.
    -> tensor -> {"count", "samples"} for the table."""
    if not obs.nonfinite:
        return {}

    def named(t):
        idx = obs.nonfinite_samples.get(t, [])
        return [names[i] if i < len(names) else f"sample {i}" for i in idx]

    order = {t: k for k, t in enumerate(obs.histograms)}  # graph order: the model's input first
    dead = sorted(obs.no_finite_value(), key=lambda t: order.get(t, len(order)))
    if dead:
        t = dead[0]
        raise QtoolError(f"{where}: tensor '{t}' has no finite value in any sample (NaN/inf in "
                         f"{', '.join(os.path.basename(str(n)) for n in named(t))}"
                         f"{', ...' if obs.nonfinite[t] > len(named(t)) else ''}); its range cannot be calibrated"
                         + (f" ({len(dead) - 1} more tensors likewise)" if len(dead) > 1 else ""))
    out = {t: {"count": c, "samples": [str(n) for n in named(t)]} for t, c in sorted(obs.nonfinite.items())}
    samples = sorted({n for v in out.values() for n in v["samples"]})
    worst = max(out, key=lambda t: out[t]["count"])
    warnings.warn(f"{len(out)} tensor{'s' if len(out) > 1 else ''} held NaN/inf values, excluded from the ranges and "
                  f"means (most: '{worst}', {out[worst]['count']} values); samples: "
                  f"{', '.join(os.path.basename(n) for n in samples[:5])}{', ...' if len(samples) > 5 else ''}",
                  stacklevel=2)
    return out


def _describe(data, absolute: bool = False) -> str:
    if isinstance(data, (str, os.PathLike)):
        return os.path.abspath(data) if absolute else os.fspath(data)
    return "(python iterable)"
