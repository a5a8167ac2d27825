"""Preprocessing configuration: a TOML file or a preset by name -> a plain dataclass.

Presets are the repository's configs/*.toml; a built package carries them as qtool/data/presets
(setup.py copies them there), so a wheel install finds them by name. The current folder is never
searched: a stray configs/ there must not change the preprocessing silently (pass a path for that).
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from qtool.errors import QtoolError

PRESET_DIRS = [Path(__file__).resolve().parent / "presets",  # inside an installed package
               Path(__file__).resolve().parents[2] / "configs"]  # a source checkout (editable install)
_INTERP = ("nearest", "bilinear", "bicubic", "lanczos")


@dataclass
class Preprocess:
    """How an image becomes a model input: x = (pixel - mean) / std, pixels in 0..255."""

    input_name: str | None = None
    layout: str = "NCHW"  # NCHW or NHWC
    size: tuple = (224, 224)  # H, W
    color: str = "RGB"  # RGB, BGR or GRAY
    resize: str = "shorter"  # shorter (then crop), exact (to size), none
    resize_to: int = 256  # the shorter side, for resize = "shorter"
    crop: str = "center"  # center or none
    interpolation: str = "bilinear"
    mean: tuple = (0.0, 0.0, 0.0)
    std: tuple = (1.0, 1.0, 1.0)
    source: str = field(default="(defaults)", compare=False)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def preset_names() -> list:
    names = set()
    for d in PRESET_DIRS:
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml"))
    return sorted(names)


def find_config(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    for d in PRESET_DIRS:
        cand = d / (name_or_path if name_or_path.endswith(".toml") else name_or_path + ".toml")
        if cand.is_file():
            return cand
    raise QtoolError(f"{name_or_path}: no such config file or preset (presets: {', '.join(preset_names()) or 'none'})")


def load_config(name_or_path: str | None) -> Preprocess:
    if name_or_path is None:
        return Preprocess()
    path = find_config(name_or_path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise QtoolError(f"{path}: not valid TOML ({e})") from None
    return from_dict(raw, str(path))


def from_dict(raw: dict, source: str = "(dict)") -> Preprocess:
    inp, pre = raw.get("input", {}), raw.get("preprocess", {})
    unknown = (set(raw) - {"input", "preprocess"}) | (set(inp) - {"name", "layout", "size", "color"}) | (
        set(pre) - {"resize", "resize_to", "crop", "interpolation", "mean", "std"})
    if unknown:
        raise QtoolError(f"{source}: unknown config keys: {', '.join(sorted(unknown))}")
    try:
        c = Preprocess(source=source)
        c.input_name = inp.get("name")
        c.layout = str(inp.get("layout", c.layout)).upper()
        c.size = tuple(int(v) for v in inp.get("size", c.size))
        c.color = str(inp.get("color", c.color)).upper()
        c.resize = pre.get("resize", c.resize)
        c.resize_to = int(pre.get("resize_to", c.resize_to))
        c.crop = pre.get("crop", c.crop)
        c.interpolation = pre.get("interpolation", c.interpolation)
        nch = 1 if c.color == "GRAY" else 3
        c.mean = tuple(float(v) for v in pre.get("mean", [0.0] * nch))
        c.std = tuple(float(v) for v in pre.get("std", [1.0] * nch))
    except (TypeError, ValueError) as e:
        raise QtoolError(f"{source}: a config value has the wrong type ({e}); see configs/*.toml for examples") from None
    problems = []
    if c.layout not in ("NCHW", "NHWC"):
        problems.append(f"layout must be NCHW or NHWC, not {c.layout}")
    if len(c.size) != 2 or min(c.size) <= 0:
        problems.append(f"size must be [height, width], not {list(c.size)}")
    if c.color not in ("RGB", "BGR", "GRAY"):
        problems.append(f"color must be RGB, BGR or GRAY, not {c.color}")
    if c.resize not in ("shorter", "exact", "none"):
        problems.append(f"resize must be shorter, exact or none, not {c.resize}")
    if c.crop not in ("center", "none"):
        problems.append(f"crop must be center or none, not {c.crop}")
    if c.interpolation not in _INTERP:
        problems.append(f"interpolation must be one of {', '.join(_INTERP)}")
    if len(c.mean) not in (1, nch) or len(c.std) not in (1, nch) or any(s == 0 for s in c.std):
        problems.append(f"mean and std need 1 or {nch} values, std non-zero")
    if problems:
        raise QtoolError(f"{source}: " + "; ".join(problems))
    return c


def config_from_model_shape(c: Preprocess, dims: list) -> Preprocess:
    """Take layout and size from a model input of rank 4 where the config left them at defaults."""
    if len(dims) != 4:
        return c
    if c.source == "(defaults)":
        if dims[1] in (1, 3) and isinstance(dims[2], int) and isinstance(dims[3], int):
            c.layout, c.size = "NCHW", (dims[2], dims[3])
        elif dims[3] in (1, 3) and isinstance(dims[1], int) and isinstance(dims[2], int):
            c.layout, c.size = "NHWC", (dims[1], dims[2])
        ch = dims[1] if c.layout == "NCHW" else dims[3]
        if ch == 1:
            c.color, c.mean, c.std = "GRAY", c.mean[:1], c.std[:1]
    return c




def config_from_any(config) -> Preprocess:
    """A Preprocess from a preset name or path, a dict as the calibration table stores it, or one already made."""
    if config is None or isinstance(config, str):
        return load_config(config)
    if isinstance(config, Preprocess):
        return config
    inp = {k: config[k] for k in ("layout", "size", "color") if k in config}
    if config.get("input_name"):
        inp["name"] = config["input_name"]
    pre = {k: config[k] for k in ("resize", "resize_to", "crop", "interpolation", "mean", "std") if k in config}
    return from_dict({"input": inp, "preprocess": pre}, config.get("source", "(calibration table)"))
