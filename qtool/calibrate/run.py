"""`calibrate`: model + data -> fused fp32 graph + calibration table, in the working directory."""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import onnx
from tqdm import tqdm

from qtool import graph as G
from qtool import outputs
from qtool.calibrate.budget import DEFAULT_GMAC, Spend, within_budget
from qtool.calibrate.collect import collect
from qtool.calibrate.checks import stem_fit
from qtool.data.config import config_from_any, config_name
from qtool.data.sources import ImageData
from qtool.data.images import list_images
from qtool.calibrate.methods import AUTO, DEFAULT_METHOD, METHODS
from qtool.data.tensors import tensor_source
from qtool.calibrate.table import FLAT, CalibrationTable, ranges_for_all_methods
from qtool.errors import LateWriteError, QtoolError, UsageError
from qtool.fuse import fuse_model
from qtool.lattice import DistinctValues
from qtool.limits import MAX_BATCH
from qtool.modelio import read_model, save_model
from qtool.plan import balanced_tensors, calibration_targets
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


def calibrate(model_path: str, data, config=None, method: str = DEFAULT_METHOD,
              workdir: str | None = None, batch: int = 4, limit: int | None = None, show_progress: bool = True,
              threads: int = 0, every: int = 1, say=print, budget_gmac: float = DEFAULT_GMAC,
              also_writes=()) -> CalibrateResult:
    """`data`: a folder of images, of .npy files or of .npz files (see data/tensors.py), or any
    iterable of {input name: array} dicts (or of arrays, for a one-input model). `every`: use every
    N-th sample of the sorted folder (index % N == 0), e.g. a fixed calibration split.
    `config` (images only): a preset name, a TOML path, a dict or a Preprocess; None takes the
    model's metadata, else assumes the torchvision ImageNet preset for a 3-channel input, sized
    to the model (data/config.py); `say` is told what was assumed before the pass starts.
    `budget_gmac`: a heavy model calibrates on fewer samples, spread over the data (budget.py; 0: all).
    The working directory is made and checked writable first, and held for the whole run; what the run
    will write (there, and `also_writes`: outputs.File, as the command's --json) is checked against
    what it reads before any work (outputs.py)."""
    if method not in METHODS and method != AUTO:
        raise UsageError(f"unknown calibration method '{method}' (choose from {', '.join(METHODS)}, {AUTO})")
    check_counts(batch=batch, limit=limit, every=every, threads=threads)
    if isinstance(budget_gmac, bool) or not isinstance(budget_gmac, (int, float)) or not budget_gmac >= 0:
        raise UsageError(f"--budget-gmac must be 0 (no budget) or more, not {budget_gmac!r}")
    wd = Workdir(workdir)
    with wd.lock(create=True):
        outputs.check(writes=list(also_writes) + writes(wd),
                      reads=outputs.model("fp32 model", model_path) + outputs.data("data folder", data)
                      + outputs.config("--config file", config) + outputs.recorded(wd.manifest()))
        return _calibrate(model_path, data, config, method, workdir, batch, limit, show_progress, threads, every,
                          say, budget_gmac)


def writes(wd: Workdir) -> list:
    """What calibrate writes in the working directory."""
    fused = wd.file(FUSED)
    return [outputs.File("fused graph", fused, "calibrate.fused_path"), outputs.File("fused graph's data", fused + ".data"),
            outputs.File("calibration table", wd.file(TABLE), "calibrate.table_path"),
            outputs.File("manifest", wd.file(MANIFEST))]


def check_counts(**options) -> None:
    """Numeric options: batch 1..MAX_BATCH, limit None or >= 1, every >= 1, threads >= 0."""
    for name, v in options.items():
        if name == "limit" and v is None:
            continue
        lo, hi = {"batch": (1, MAX_BATCH), "threads": (0, 1024)}.get(name, (1, None))
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise UsageError(f"--{name} must be an integer {'from ' + str(lo) + ' to ' + str(hi) if hi else str(lo) + ' or more'}"
                             f", not {v!r}")


def _calibrate(model_path, data, config, method, workdir, batch, limit, show_progress, threads, every, say,
               budget_gmac):
    t0 = time.time()
    phases = Phases()
    phases.lap("read model")
    load_notes = []
    model, model_sha256 = read_model(model_path, notes=load_notes)  # (hashed from the bytes parsed)
    q = G.quantized_ops(model)
    if q:
        raise QtoolError(f"{model_path}: already int8 ({', '.join(f'{k} x{v}' for k, v in sorted(q.items()))}); "
                         f"calibrate the fp32 original")
    cfg = None if config is None else config_from_any(config)
    phases.lap("list data")
    source = tensor_source(data, model, model_path, batch=batch, limit=limit, every=every)
    if source is None:
        files = list_images(data)[::every]
        source = ImageData(data, cfg, model, model_path, batch=batch, limit=limit, files=files)
    elif config is not None:
        raise UsageError(f"--config describes image preprocessing; {_describe(data)} holds tensors, fed as they are")
    notes, alerts = load_notes + list(getattr(source, "notes", [])), []
    for line in notes:
        say(line)
    if source.kind == "images":
        phases.lap("stem check")
        fit = stem_fit(model, source.inp.name, source.files, source.cfg, config_name(source.cfg), threads,
                       source.assumed)
        if fit is not None and fit.warning():
            alerts.append(fit.warning())
            warnings.warn(alerts[-1], stacklevel=2)
    phases.lap("fuse")
    fused = fuse_model(model, source.pins, inplace=True)
    del model  # fused in place: the fused graph is all that is needed from here on
    for line in fused.messages:  # (what changed the model as a whole, not one node)
        if line.startswith(("upgrade_opset:", "upcast_float16:")):
            say("note: " + line.split(": ", 1)[1])
    ranges, means = calibration_targets(fused.model)
    if not ranges:  # (the int8 model will be the fp32 one; quantize says which ops stay fp32 and why)
        warnings.warn(f"{model_path}: nothing in this model's graph has an int8 rule"
                      + (f" (what it computes sits in {', '.join(sorted(sub))} subgraphs, which stay fp32)"
                         if (sub := {n.op_type for n in fused.model.graph.node if G._subgraphs(n)}) else ""),
                      stacklevel=2)
    out = fused.model.graph.output[0] if fused.model.graph.output else None
    watch = out.name if out is not None and out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT else None
    names = []  # sample index -> file (or sample) name, for naming the samples that hold NaN/inf
    spend = Spend(budget_gmac, len(source))

    def macs(feeds):
        return G.total_macs(fused.model, {k: np.shape(v) for k, v in feeds.items()})

    def planned(line):
        say(line)
        bar.total = spend.planned
        bar.refresh()

    inputs = {i.name for i in G.real_inputs(fused.model)}
    distinct = {}  # model input -> its distinct values while few (lattice.py: an 8-bit image's grid)

    def feeds():
        for n, f in within_budget(source.batches(), len(source), macs, budget_gmac, planned, spend=spend):
            names.extend(os.path.abspath(x) if source.kind != "iterable" else x for x in n)
            for k, v in f.items():
                if k in inputs:  # (an integer input gives up at once: DistinctValues keeps float values only)
                    distinct.setdefault(k, DistinctValues()).add(v)
            yield f

    phases.lap("calibration pass")
    with tqdm(total=len(source) or None, unit="sample", desc="calibrate", disable=not show_progress, leave=False) as bar:
        obs = collect(fused.model, ranges, means, feeds(), bar.update, threads, watch=watch,
                      where=f"{model_path} (fused)", ranged=balanced_tensors(fused.model),
                      cut=source.kind == "images" or source.batch > 1)
    if obs.n_samples == 0:
        raise QtoolError(f"{_describe(data)}: no samples" if source.kind != "images" else
                         f"{data}: none of the {len(source)} images could be read")
    nonfinite = check_nonfinite(obs, names, _describe(data))
    by_design = obs.watch is not None and G.unmasked(fused.model, obs.watch.name) != obs.watch.name
    if obs.watch is not None and obs.watch.warning(by_design):
        alerts.append(obs.watch.warning(by_design))
        warnings.warn(alerts[-1], stacklevel=2)
    phases.lap("ranges")
    ranges_all = ranges_for_all_methods(obs.histograms)
    aware = {}  # tensors read only by an activation: `mse` minimises the activation's output error
    for t, (label, f) in activation_inputs(fused.model).items():
        if t in obs.histograms and label in AWARE:
            ranges_all["mse"][t] = list(activation_mse_range(obs.histograms[t], f))
            aware[t] = label
    flat = {t: ab for t, ab in flat_bounds(fused.model).items() if t in obs.histograms}
    for m in list(ranges_all) if flat else []:  # each method again, the steps beyond flat ends not spent
        r = dict(ranges_all[m])
        for t, (a, b) in flat.items():
            if t in r:
                r[t] = list(clip_to_flat(r[t][0], r[t][1], a, b))
        if r != ranges_all[m]:
            ranges_all[m + FLAT] = r
    phases.lap("write")
    wd = Workdir(workdir)
    fused_path, table_path = wd.file(FUSED), wd.file(TABLE)
    table = CalibrationTable(
        model_path=os.path.abspath(model_path), model_sha256=model_sha256,
        fused_sha256="", method=method, n_samples=obs.n_samples, skipped=list(source.skipped),
        config=source.cfg.to_dict() if source.cfg is not None else {}, ranges=ranges_all,
        channel_means=obs.channel_means(), channel_ranges=obs.channel_ranges(), histograms={t: h.to_dict() for t, h in obs.histograms.items()},
        input_name=source.inp.name if source.kind == "images" else "", nonfinite=nonfinite,
        lattices={k: lat.to_dict() for k, d in distinct.items() if (lat := d.lattice()) is not None})
    table.fused_sha256 = save_model(fused.model, fused_path).model_sha256  # (hashed as written)
    table.save(table_path)
    result = CalibrateResult(table, fused.model, fused_path, table_path, time.time() - t0, fused.counts, notes, alerts,
                             spend.to_dict(), {}, fused.seconds)
    try:  # (the table is written: should the manifest fail now, the figures are still shown)
        _record(wd, table, method, notes, alerts, obs, data, source, aware, spend, names)
    except QtoolError as e:
        result.phases = phases.stop()
        raise LateWriteError(str(e), result) from None
    result.seconds, result.phases = time.time() - t0, phases.stop()
    return result


def _record(wd, table, method, notes, alerts, obs, data, source, aware, spend, names) -> None:
    """The calibration into the manifest: a new calibration, so the previous int8 model and its evaluation
    no longer belong here."""
    wd.update(drop=("quantize", "eval"),
              calibrate={"model_path": table.model_path, "model_sha256": table.model_sha256,
                         "fused_path": wd.file(FUSED), "fused_sha256": table.fused_sha256, "table_path": wd.file(TABLE),
                         "table_sha256": table.sha256, "method": method,
                         "config": table.config, "preprocessing_notes": notes, "preprocessing_warnings": alerts,
                         "fp32_output": obs.watch.summary() if obs.watch is not None else None,
                         "data": _describe(data, absolute=True),
                         "data_kind": source.kind, "activation_aware_mse": aware, "n_samples": obs.n_samples,
                         "skipped": len(source.skipped), "budget": spend.to_dict(),
                         "files": names if spend.capped else
                         [os.path.abspath(f) if source.kind != "iterable" else f for f in source.files]})


def check_nonfinite(obs, names: list, where: str) -> dict:
    """NaN and inf were left out of every statistic (collect.py); say where they were, once.
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
