"""A catalogue: the models `qtool batch` runs, read from a TOML file and checked whole before any job starts.

    [defaults]                  # optional; every model takes these unless it says otherwise
    memory_mb = 4096            # a step whose process tree holds more is killed (its row says so)
    timeout_s = 900             # optional: a step running longer is killed
    [defaults.quantize]         # options of `qtool quantize`, named as on its command line
    strict = true

    [[model]]
    name = "resnet50"           # optional (default: the model file's name); the working folder OUT/NAME
    path = "models/resnet50.onnx"
    data = "calib/"             # calibration data (`qtool calibrate --data`)
    eval_data = "val/"          # optional (`qtool eval --data`; default: eval's own)
    config = "imagenet-torchvision"   # optional: a preset name or a TOML path (`--config`)
    memory_mb = 2048
    [model.calibrate]           # per-step options, over the defaults' (also [model.eval])
    method = "minmax"

Paths are relative to the catalogue's folder; `$NAME` or `${NAME}` in a path is the environment variable
(one that is not set is an error), so a catalogue committed with a project names no machine's folders.
Every problem is one line naming the file and what is wrong (a UsageError: exit 2); the step options
are checked against the commands themselves (qtool.commands.batch_steps).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from qtool.data.config import parse_toml
from qtool.errors import QtoolError, UsageError
from qtool.limits import regular_file

STEPS = ("calibrate", "quantize", "eval")
DEFAULT_MEMORY_MB = 4096
_LIMIT_KEYS = ("memory_mb", "timeout_s")
DEFAULT_KEYS = ("config",) + _LIMIT_KEYS + STEPS
MODEL_KEYS = ("name", "path", "data", "eval_data") + DEFAULT_KEYS
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_VAR = re.compile(r"\$(\w+)|\$\{([^}]*)\}")


@dataclass(frozen=True)
class Limits:
    """What a job may use: resident memory of each step's process tree, and optionally wall time per step."""
    memory_mb: float = DEFAULT_MEMORY_MB
    timeout_s: float | None = None


@dataclass(frozen=True)
class Entry:
    """One model of the catalogue, paths resolved; `options`: step -> {option name: value}."""
    name: str
    path: str
    data: str
    eval_data: str | None = None
    config: str | None = None
    limits: Limits = Limits()
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Catalogue:
    path: str
    entries: tuple


def load(path: str) -> Catalogue:
    """The catalogue in the TOML file `path`, every entry checked; one UsageError on the first problem."""
    try:
        with open(regular_file(path, "catalogue"), encoding="utf-8") as f:
            text = f.read()
        raw = parse_toml(text, path)
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a text file (a catalogue is TOML)") from None
    except QtoolError as e:
        raise UsageError(str(e)) from None
    return from_dict(raw, path)


def from_dict(raw: dict, path: str) -> Catalogue:
    unknown(raw, ("defaults", "model"), path, "at the top")
    defaults = raw.get("defaults", {})
    if not isinstance(defaults, dict):
        raise UsageError(f"{path}: [defaults] must be a table")
    unknown(defaults, DEFAULT_KEYS, path, "in [defaults]")
    models = raw.get("model")
    if not isinstance(models, list) or not models or not all(isinstance(m, dict) for m in models):
        raise UsageError(f"{path}: no models: list each as a [[model]] table with path and data")
    base = os.path.dirname(os.path.abspath(path))
    entries = [entry(m, defaults, base, path, i) for i, m in enumerate(models)]
    seen = set()
    for e in entries:
        if e.name in seen:
            raise UsageError(f"{path}: two models are named {e.name!r}: give each its own name (its working folder)")
        seen.add(e.name)
    return Catalogue(path, tuple(entries))


def unknown(table: dict, allowed: tuple, path: str, where: str) -> None:
    extra = sorted(k for k in table if k not in allowed)
    if extra:
        raise UsageError(f"{path}: unknown key {extra[0]!r} {where} (allowed: {', '.join(allowed)})")


def entry(m: dict, defaults: dict, base: str, path: str, index: int) -> Entry:
    unknown(m, MODEL_KEYS, path, f"in model {index + 1}")
    for key in ("path", "data"):
        if key not in m:
            raise UsageError(f"{path}: model {index + 1}: no {key!r} (each model needs path and data)")
    for key in ("name", "path", "data", "eval_data", "config"):
        if key in m and not (isinstance(m[key], str) and m[key]):
            raise UsageError(f"{path}: model {index + 1}: {key!r} must be a non-empty string")
    name = m.get("name") or os.path.splitext(os.path.basename(m["path"]))[0]
    where = f"{path}: model {name!r}"
    if not _NAME.match(name):
        raise UsageError(f"{where}: the name must be letters, digits, '.', '_' or '-' (it names a folder)")
    config = m.get("config", defaults.get("config"))
    if config is not None and not isinstance(config, str):
        raise UsageError(f"{where}: 'config' must be a preset name or a TOML path")
    if config is not None and ("/" in config or config.endswith(".toml") or "$" in config):
        config = resolve(config, base, f"{where}: config")
    return Entry(name=name, path=resolve(m["path"], base, f"{where}: path"),
                 data=resolve(m["data"], base, f"{where}: data"),
                 eval_data=resolve(m["eval_data"], base, f"{where}: eval_data") if "eval_data" in m else None,
                 config=config, limits=limits(m, defaults, where), options=options(m, defaults, where))


def limits(m: dict, defaults: dict, where: str) -> Limits:
    values = {}
    for key in _LIMIT_KEYS:
        v = m.get(key, defaults.get(key))
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise UsageError(f"{where}: {key} must be a number above 0, not {v!r}")
        values[key] = v
    return Limits(**values)


def options(m: dict, defaults: dict, where: str) -> dict:
    """Each step's options: the defaults' table, then the model's over it."""
    out = {}
    for step in STEPS:
        merged = {}
        for source, table in (("[defaults]", defaults.get(step, {})), ("the model", m.get(step, {}))):
            if not isinstance(table, dict):
                raise UsageError(f"{where}: {step} in {source} must be a table of options")
            merged.update(table)
        out[step] = merged
    return out


def resolve(value: str, base: str, what: str) -> str:
    """`value` with its environment variables expanded, made absolute from the catalogue's folder."""
    def var(match):
        key = match.group(1) or match.group(2)
        if key not in os.environ:
            raise UsageError(f"{what}: ${key} is not set (the catalogue reads it from the environment)")
        return os.environ[key]
    text = os.path.expanduser(_VAR.sub(var, value))
    return os.path.normpath(os.path.join(base, text))
