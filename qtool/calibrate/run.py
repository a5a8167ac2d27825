"""`calibrate`: model + data -> fused fp32 graph + calibration table, in the working directory."""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field

import onnx
from tqdm import tqdm

from qtool import graph as G
from qtool.calibrate.collect import collect
from qtool.calibrate.checks import stem_fit
from qtool.data.config import config_from_any, config_name
from qtool.data.sources import ImageData
from qtool.data.images import list_images
from qtool.calibrate.methods import METHODS
from qtool.data.tensors import tensor_source
from qtool.calibrate.table import CalibrationTable, ranges_for_all_methods
from qtool.errors import QtoolError, UsageError
from qtool.fuse import fuse_model
from qtool.modelio import load_model, model_hash, save_model
from qtool.plan import calibration_targets
from qtool.rules.activations import AWARE, activation_inputs, activation_mse_range
from qtool.workdir import Workdir

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


def calibrate(model_path: str, data, config=None, method: str = "minmax",
              workdir: str | None = None, batch: int = 4, limit: int | None = None, show_progress: bool = True,
              threads: int = 0, every: int = 1, say=print) -> CalibrateResult:
    """`data`: a folder of images, of .npy files or of .npz files (see data/tensors.py), or any
    iterable of {input name: array} dicts (or of arrays, for a one-input model). `every`: use every
    N-th sample of the sorted folder (index % N == 0), e.g. a fixed calibration split.
    `config` (images only): a preset name, a TOML path, a dict or a Preprocess; None takes the
    model's metadata, else assumes the torchvision ImageNet preset for a 3-channel input, sized
    to the model (data/config.py); `say` is told what was assumed before the pass starts."""
    if method not in METHODS:
        raise UsageError(f"unknown calibration method '{method}' (choose from {', '.join(METHODS)})")
    t0 = time.time()
    model = load_model(model_path)
    q = G.quantized_ops(model)
    if q:
        raise QtoolError(f"{model_path}: already int8 ({', '.join(f'{k} x{v}' for k, v in sorted(q.items()))}); "
                         f"calibrate the fp32 original")
    cfg = None if config is None else config_from_any(config)
    if every < 1:
        raise UsageError(f"--every must be 1 or more, not {every}")
    source = tensor_source(data, model, model_path, batch=batch, limit=limit, every=every)
    if source is None:
        files = list_images(data)[::every]
        source = ImageData(data, cfg, model, model_path, batch=batch, limit=limit, files=files)
    elif config is not None:
        raise UsageError(f"--config describes image preprocessing; {_describe(data)} holds tensors, fed as they are")
    notes, alerts = list(getattr(source, "notes", [])), []
    for line in notes:
        say(line)
    if source.kind == "images":
        fit = stem_fit(model, source.inp.name, source.files, source.cfg, config_name(source.cfg), threads,
                       source.assumed)
        if fit is not None and fit.warning():
            alerts.append(fit.warning())
            warnings.warn(alerts[-1], stacklevel=2)
    fused = fuse_model(model, source.pins)
    del model  # the fused copy is all that is needed from here on
    ranges, means = calibration_targets(fused.model)
    if not ranges:
        raise QtoolError(f"{model_path}: nothing in this model can be quantized (no op with an int8 rule)")
    out = fused.model.graph.output[0] if fused.model.graph.output else None
    watch = out.name if out is not None and out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT else None
    with tqdm(total=len(source) or None, unit="sample", desc="calibrate", disable=not show_progress, leave=False) as bar:
        obs = collect(fused.model, ranges, means, (feeds for _, feeds in source.batches()), bar.update, threads,
                      watch=watch)
    if obs.n_samples == 0:
        raise QtoolError(f"{_describe(data)}: no samples" if source.kind != "images" else
                         f"{data}: none of the {len(source)} images could be read")
    if obs.watch is not None and obs.watch.warning():
        alerts.append(obs.watch.warning())
        warnings.warn(alerts[-1], stacklevel=2)
    ranges_all = ranges_for_all_methods(obs.histograms)
    aware = {}  # tensors read only by an activation: `mse` minimises the activation's output error
    for t, (label, f) in activation_inputs(fused.model).items():
        if t in obs.histograms and label in AWARE:
            ranges_all["mse"][t] = list(activation_mse_range(obs.histograms[t], f))
            aware[t] = label
    wd = Workdir(workdir)
    os.makedirs(wd.path, exist_ok=True)
    fused_path, table_path = wd.file(FUSED), wd.file(TABLE)
    table = CalibrationTable(
        model_path=os.path.abspath(model_path), model_sha256=model_hash(model_path),
        fused_sha256="", method=method, n_samples=obs.n_samples, skipped=list(source.skipped),
        config=source.cfg.to_dict() if source.cfg is not None else {}, ranges=ranges_all,
        channel_means=obs.channel_means(), histograms={t: h.to_dict() for t, h in obs.histograms.items()},
        input_name=source.inp.name if source.kind == "images" else "")
    save_model(fused.model, fused_path)
    table.fused_sha256 = model_hash(fused_path)
    table.save(table_path)
    wd.update(calibrate={"model_path": table.model_path, "model_sha256": table.model_sha256,
                         "fused_path": fused_path, "table_path": table_path, "method": method,
                         "config": table.config, "preprocessing_notes": notes, "preprocessing_warnings": alerts,
                         "fp32_output": obs.watch.summary() if obs.watch is not None else None,
                         "data": _describe(data, absolute=True),
                         "data_kind": source.kind, "activation_aware_mse": aware, "n_samples": obs.n_samples,
                         "skipped": len(source.skipped),
                         "files": [os.path.abspath(f) if source.kind != "iterable" else f for f in source.files]})
    return CalibrateResult(table, fused.model, fused_path, table_path, time.time() - t0, fused.counts, notes, alerts)


def _describe(data, absolute: bool = False) -> str:
    if isinstance(data, (str, os.PathLike)):
        return os.path.abspath(data) if absolute else os.fspath(data)
    return "(python iterable)"
