"""`calibrate`: model + data -> fused fp32 graph + calibration table, in the working directory."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import onnx
from tqdm import tqdm

from qtool.calibrate.collect import collect
from qtool.calibrate.config import load_config
from qtool.calibrate.data import ImageData
from qtool.calibrate.images import list_images
from qtool.calibrate.methods import METHODS
from qtool.calibrate.table import CalibrationTable, ranges_for_all_methods
from qtool.errors import QtoolError, UsageError
from qtool.fuse import fuse_model
from qtool.modelio import load_model, model_hash, save_model
from qtool.quantize.plan import calibration_targets
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


def calibrate(model_path: str, data: str, config: str | None = None, method: str = "percentile",
              workdir: str | None = None, batch: int = 8, limit: int | None = None, show_progress: bool = True,
              threads: int = 0, every: int = 1) -> CalibrateResult:
    """`every`: use every N-th image of the sorted folder (index % N == 0), e.g. a fixed calibration split."""
    if method not in METHODS:
        raise UsageError(f"unknown calibration method '{method}' (choose from {', '.join(METHODS)})")
    t0 = time.time()
    model = load_model(model_path)
    cfg = load_config(config)
    if every < 1:
        raise UsageError(f"--every must be 1 or more, not {every}")
    files = list_images(data)[::every]
    source = ImageData(data, cfg, model, model_path, batch=batch, limit=limit, files=files)
    fused = fuse_model(model, source.pins)
    ranges, means = calibration_targets(fused.model)
    if not ranges:
        raise QtoolError(f"{model_path}: nothing in this model can be quantized (no op with an int8 rule)")
    with tqdm(total=len(source), unit="img", desc="calibrate", disable=not show_progress, leave=False) as bar:
        obs = collect(fused.model, ranges, means, (feeds for _, feeds in source.batches()), bar.update, threads)
    if obs.n_samples == 0:
        raise QtoolError(f"{data}: none of the {len(source)} images could be read")
    wd = Workdir(workdir)
    os.makedirs(wd.path, exist_ok=True)
    fused_path, table_path = wd.file(FUSED), wd.file(TABLE)
    table = CalibrationTable(
        model_path=os.path.abspath(model_path), model_sha256=model_hash(model_path),
        fused_sha256="", method=method, n_samples=obs.n_samples, skipped=list(source.skipped),
        config=source.cfg.to_dict(), ranges=ranges_for_all_methods(obs.histograms),
        channel_means=obs.channel_means(), histograms={t: h.to_dict() for t, h in obs.histograms.items()},
        input_name=source.inp.name)
    save_model(fused.model, fused_path)
    table.fused_sha256 = model_hash(fused_path)
    table.save(table_path)
    wd.update(calibrate={"model_path": table.model_path, "model_sha256": table.model_sha256,
                         "fused_path": fused_path, "table_path": table_path, "method": method,
                         "config": table.config, "data": os.path.abspath(data), "n_samples": obs.n_samples,
                         "skipped": len(source.skipped),
                         "files": [os.path.abspath(f) for f in source.files]})
    return CalibrateResult(table, fused.model, fused_path, table_path, time.time() - t0, fused.counts)
