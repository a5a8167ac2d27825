"""Calibration and evaluation data: a folder of images -> batches of model inputs."""
from __future__ import annotations

import os
from dataclasses import dataclass

import onnx

from qtool import graph as G
from qtool.data.config import (METADATA_KEY, Preprocess, assumed_config, config_from_metadata, config_name, describe,
                               fit_to_input, input_shape, input_size, pinned_size)
from qtool.data.images import IMAGE_EXTS, ImageStream, list_images
from qtool.errors import QtoolError
from qtool.limits import walk


@dataclass
class ModelInput:
    name: str
    dims: list  # ints where static, str/None where dynamic
    dtype: str = "float32"  # what the pixels are handed over as: float32, or float16 for a half-precision model


_IMAGE_TYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}


def float_inputs(model: onnx.ModelProto) -> list:
    return [ModelInput(i.name, G.input_dims(i), _IMAGE_TYPES[i.type.tensor_type.elem_type])
            for i in G.real_inputs(model) if i.type.tensor_type.elem_type in _IMAGE_TYPES]


def image_input(model: onnx.ModelProto, cfg: Preprocess, path: str) -> ModelInput:
    ins = float_inputs(model)
    if cfg.input_name:
        match = [i for i in ins if i.name == cfg.input_name]
        if not match:
            raise QtoolError(f"{path}: model has no float input named '{cfg.input_name}' "
                             f"(it has: {', '.join(i.name for i in ins) or 'none'})")
        others = [i.name for i in G.real_inputs(model) if i.name != cfg.input_name]
        if others:
            raise QtoolError(f"{path}: model needs inputs besides '{cfg.input_name}' ({', '.join(repr(o) for o in others)}); images "
                             f"feed one input only: calibrate from .npz files holding every input")
        return match[0]
    if not ins:
        raise QtoolError(f"{path}: model has no float32 or float16 input to feed images to")
    chosen = ins[0]
    others = [i.name for i in G.real_inputs(model) if i.name != chosen.name]
    if others:
        raise QtoolError(f"{path}: model needs inputs besides '{chosen.name}' ({', '.join(repr(o) for o in others)}); images feed one "
                         f"input only: calibrate from .npz files holding every input")
    return chosen


class ImageData:
    """Batches {input name: array} from an image folder, shaped for the model.
    (Tensor data, .npy/.npz/iterables, is calibrate/tensors.py; both have this interface.)

    Given .npy/.npz files (a tensor folder, or the file list a tensor calibration recorded),
    it hands back the matching tensor source instead, so a later step that re-reads "the
    calibration data" (sensitivity, eval) works whatever kind it was; `cfg` is unused then."""

    def __new__(cls, folder: str, cfg=None, model=None, model_path: str = "", batch: int = 8,
                limit: int | None = None, files: list | None = None):
        from qtool.data.tensors import TENSOR_EXTS, NpyFolder, NpzFolder, classify_folder
        if files:
            kinds = {os.path.splitext(f)[1].lower() for f in files}
            kind = kinds.pop()[1:] if len(kinds) == 1 and next(iter(kinds)) in TENSOR_EXTS else None
        else:
            kind = classify_folder(folder) if os.path.isdir(folder) else None
            kind = None if kind == "images" else kind
        if kind is None:
            return super().__new__(cls)
        src = (NpyFolder if kind == "npy" else NpzFolder)(folder, model, model_path, batch, files=files, limit=limit)
        src.inp = ModelInput(src.input_name, (src.float_inputs or src.inputs)[0].dims)
        return src

    kind = "images"

    def __init__(self, folder: str, cfg: Preprocess | None, model: onnx.ModelProto, model_path: str, batch: int = 8,
                 limit: int | None = None, files: list | None = None):
        self.cfg, self.notes, self.assumed = self._choose(cfg, model, model_path)
        self._check_shape(model_path)
        files = list_images(folder) if files is None else files
        if not files:
            n = sum(len(f) for _, _, f in walk(folder))
            raise QtoolError(f"{folder}: no images found ({n} other files; looked for "
                             f"{', '.join(IMAGE_EXTS)})" if n else f"{folder}: data folder is empty")
        self.files = files[:limit] if limit else files
        fixed_batch = self.inp.dims[0] if self.inp.dims and isinstance(self.inp.dims[0], int) else None
        self.fixed_batch = fixed_batch if fixed_batch and fixed_batch > 1 else None
        self.left_out = 0  # images of a last, partial batch a fixed-batch model cannot take
        self.stream = ImageStream(self.files, self.cfg, batch=fixed_batch or batch)

    def _choose(self, cfg: Preprocess | None, model: onnx.ModelProto, model_path: str) -> tuple:
        """(the preprocessing fitted to the model's image input, lines saying what was assumed or
        changed, whether it was assumed). No config: the model's metadata, else assumed_config."""
        notes = []
        if cfg is None:
            cfg = config_from_metadata(model, model_path)
            if cfg is not None:
                notes.append(f"preprocessing from the model's metadata ({METADATA_KEY}: {cfg.source}): {describe(cfg)}")
        self.inp = image_input(model, cfg or Preprocess(), model_path)
        where = f"input '{self.inp.name}' " + "[" + ", ".join(
            str(d) if isinstance(d, int) else "N" if k == 0 else "?" for k, d in enumerate(self.inp.dims)) + "]"
        if cfg is None:
            cfg, what = assumed_config(self.inp.dims)
            cfg, _ = fit_to_input(cfg, self.inp.dims)
            notes.append(f"no --config: assumed {what}: {describe(cfg)}, for {where}; "
                         f"pass --config PRESET|FILE to change it")
            return cfg, notes, True
        cfg, changes = fit_to_input(cfg, self.inp.dims)
        if changes:
            notes.append(f"{config_name(cfg)}: took {' and '.join(changes)} from the model's {where}")
        return cfg, notes, False

    def _check_shape(self, model_path):
        d = self.inp.dims
        want = input_shape(self.cfg, *input_size(self.cfg))
        if len(d) != 4 or any(isinstance(a, int) and b is not None and a != b for a, b in zip(d, want)):
            raise QtoolError(f"{model_path}: input '{self.inp.name}' has shape {d}, but the preprocessing makes "
                             f"{['N'] + want[1:]} ({self.cfg.layout}); pass a matching --config")

    @property
    def pins(self) -> dict:
        # None: left dynamic, or the fused graph would take one image's size only
        return {self.inp.name: input_shape(self.cfg, *pinned_size(self.cfg))}

    @property
    def skipped(self) -> list:
        return self.stream.skipped

    def __len__(self):
        return len(self.files)

    def batches(self):
        for names, x in self.stream:
            if self.fixed_batch and len(names) < self.fixed_batch:  # (its batch dimension is fixed)
                self.left_out += len(names)
                continue
            yield names, {self.inp.name: x if self.inp.dtype == "float32" else x.astype(self.inp.dtype)}
