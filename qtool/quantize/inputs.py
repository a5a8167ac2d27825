"""What `quantize` reads: the fused graph and the calibration table (from explicit paths or the
working directory, checked against what `qtool calibrate` recorded), the calibration files, labels."""
from __future__ import annotations

import os
from dataclasses import dataclass

import onnx

from qtool.calibrate.run import FUSED
from qtool.calibrate.table import check_against_model, load_table
from qtool.errors import QtoolError
from qtool.fuse import fuse_model
from qtool.labels import labels_from_file, labels_from_folders
from qtool.modelio import read_model
from qtool.workdir import Workdir


@dataclass(frozen=True)
class Inputs:
    fused: onnx.ModelProto
    table: object  # calibrate.table.CalibrationTable
    model_path: str  # the original fp32 model
    table_path: str  # the table read


def load_inputs(wd: Workdir, model: str | None = None, table_path: str | None = None,
                manifest: dict | None = None) -> Inputs:
    """The fused graph and table from explicit paths or the working directory `wd` (its `manifest`, as
    read once by the caller); a table taken from the working directory must be the one `qtool calibrate`
    recorded there (its sha256), and its per-channel lists must fit the graph's layers
    (table.check_against_model)."""
    manifest = wd.manifest() if manifest is None else manifest
    expect = None
    if table_path is None:
        if "calibrate" not in manifest and model is not None:
            raise QtoolError(f"{wd.path}: no calibration table; run `qtool calibrate --model {model} --data DIR` "
                             f"first (or pass --table)")
        entry = wd.require("calibrate", "calibrate", manifest)
        table_path = entry["table_path"]
        expect = lambda digest: wd.verify(table_path, entry["table_sha256"], "calibrate", "calibration table", digest)  # noqa: E731
    # every file below is hashed from the bytes parsed (table.sha256, read_model): the model is built
    # from, and recorded as, the same bytes
    table = load_table(table_path, expect)
    fused, model_path = _fused(table, table_path, model)
    check_against_model(table, fused, table_path)
    return Inputs(fused, table, model_path, table_path)


def _fused(table, table_path: str, model: str | None) -> tuple:
    """(the fused graph, the fp32 model's path): `model` fused, else calibrate's fused.onnx beside the
    table where it is still what calibrate wrote, else the recorded model fused again."""
    if model is not None:
        loaded, digest = read_model(model)
        if digest != table.model_sha256:
            raise QtoolError(f"{table_path}: calibration table was made for another model "
                             f"({table.model_path}), not {model}; run `qtool calibrate` on this model")
        return fuse_model(loaded, pins(table), inplace=True).model, model
    fused_path = os.path.join(os.path.dirname(os.path.abspath(table_path)), FUSED)
    fused = None
    if os.path.exists(fused_path):
        try:
            fused, digest = read_model(fused_path, check=False)
        except QtoolError:  # (not what calibrate wrote, which parsed: changed, as a wrong hash says)
            fused, digest = None, None
        if digest != table.fused_sha256:
            fused = None
    if fused is None:
        if not os.path.exists(table.model_path):
            raise QtoolError(f"{fused_path}: fused graph missing or changed, and the original model "
                             f"{table.model_path} is gone; run `qtool calibrate` again")
        loaded, digest = read_model(table.model_path)
        if digest != table.model_sha256:
            raise QtoolError(f"{table.model_path}: the model changed since calibration; run `qtool calibrate` again")
        return fuse_model(loaded, pins(table), inplace=True).model, table.model_path
    return fused, table.model_path


def pins(table) -> dict:
    """input -> shape the calibration's preprocessing pins (None where each image keeps its own size)."""
    c = table.config
    if not c or not table.input_name:
        return {}
    from qtool.data.config import config_from_any, input_shape, pinned_size
    cfg = config_from_any(c)
    return {table.input_name: input_shape(cfg, *pinned_size(cfg))}


def calibration_files(manifest: dict) -> list:
    """The calibration files recorded in the manifest that are still there."""
    return [f for f in manifest.get("calibrate", {}).get("files", []) if os.path.exists(f)]


def labels_for(files: list, labels_file: str | None, data_root: str | None) -> dict | None:
    """{file: class} of the calibration files (-1: unknown), from a labels file or the class folders."""
    if labels_file:
        ys = labels_from_file(labels_file, files)
    else:
        ys = labels_from_folders(data_root, files) if data_root else None
    return None if ys is None else dict(zip(files, [(-1 if y is None else y) for y in ys]))
