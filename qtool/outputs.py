"""One rule for every path a command writes, checked before any work: no output may be an input, or
another output of the same command, and every output must be writable.

An output named like an input replaced the input (issue 51): `qtool quantize -o m.onnx`, m.onnx being
the fp32 model calibrated, left the int8 model there with exit 0; `--json m.onnx` left JSON text;
`-o W/sensitivity.json` wrote the model, then the report over it. Every command (calibrate,
quantize, eval, inspect, bench) lists what it reads and what it writes and calls `check` once, before
the long work; a collision is one line naming both paths, exit 2, and nothing is written.

Two paths are the same file when, once `..` and symlinks are resolved, they name the same place
(a write replaces the link's target as much as the link, as far as the user is concerned), or when
they are one file under two names (a hard link: the same st_dev and st_ino). A folder read (the
calibration data) collides with an output that would land on a file the folder's reader takes
(an image, a .npy, a .npz inside it).

Paths a working directory's manifest records are inputs too (the fp32 model calibrated, its table,
the int8 model quantized), except where this command writes that very role again: quantize replaces
the int8 model it recorded, calibrate its table and fused graph.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from qtool.errors import UsageError
from qtool.modelio import check_writable, external_files


@dataclass(frozen=True)
class File:
    """A path a command reads or writes. `what` names it in an error ("int8 model (-o)"); `role`: the
    manifest field it is recorded under (calibrate.table_path), so that a write of the same role may
    replace what the manifest recorded there."""
    what: str
    path: str
    role: str | None = None


@dataclass(frozen=True)
class Folder:
    """A folder whose files of these extensions a command reads (calibration or evaluation data)."""
    what: str
    path: str
    exts: tuple


def model(what: str, path: str | None, role: str | None = None, external: list | None = None) -> list:
    """A model read, and the external-data files it reads (`external`, when the model has been read
    already: modelio.ModelFile.external)."""
    if not path or not os.path.isfile(path):
        return [File(what, path, role)] if path else []
    files = external_files(path) if external is None else external
    return [File(what, path, role)] + [File(f"external data of the {what}", f) for f in files]


def data(what: str, path) -> list:
    """A data folder read (images, .npy or .npz files); nothing for a Python iterable."""
    from qtool.data.images import IMAGE_EXTS
    from qtool.data.tensors import TENSOR_EXTS
    return [Folder(what, os.fspath(path), IMAGE_EXTS + TENSOR_EXTS)] if isinstance(path, (str, os.PathLike)) else []


def config(what: str, value) -> list:
    """A preprocessing option read from a file (a TOML path), not a preset's name."""
    return [File(what, os.fspath(value))] if isinstance(value, (str, os.PathLike)) and os.path.isfile(value) else []


_RECORDED = {"model_path": "fp32 model", "fused_path": "fused graph", "table_path": "calibration table",
             "int8_path": "int8 model", "report_path": "quantize report"}


def recorded(manifest: dict) -> list:
    """The paths a working directory's manifest records, each with its role (entry.field)."""
    out = []
    for entry, fields in manifest.items():
        for k, v in fields.items() if isinstance(fields, dict) else ():
            if k.endswith("_path") and isinstance(v, str) and v:
                out.append(File(f"{_RECORDED.get(k, k[:-5].replace('_', ' '))} recorded by `qtool {entry}`", v,
                                f"{entry}.{k}"))
    return out


def check(writes, reads=()) -> None:
    """Every write (File) against every read (File or Folder) and every other write; then each write
    checked writable. A collision is a UsageError naming both paths (nothing written); an output that
    cannot be written, a QtoolError."""
    writes = [w for w in writes if w.path]
    ids = [_ids(w.path) for w in writes]
    for i, w in enumerate(writes):
        for r in reads:
            if not r.path or (getattr(r, "role", None) is not None and r.role == w.role):
                continue
            if isinstance(r, Folder) and _inside(w.path, r):
                raise UsageError(f"{w.path}: the {w.what} would land in the {r.what} {r.path}, as one of its "
                                 f"files; write it elsewhere")
            if isinstance(r, File) and ids[i] & _ids(r.path):
                raise UsageError(f"{w.path}: the {w.what} is the {r.what} ({r.path}); writing it would destroy "
                                 f"that file: write it elsewhere")
        for j in range(i):
            if ids[i] & ids[j]:
                raise UsageError(f"{writes[j].path}: the {writes[j].what} and the {w.what} ({w.path}) are the same "
                                 f"file; give them different paths")
    for w in writes:
        check_writable(w.path, w.what)


def _ids(path: str) -> set:
    """What identifies the file `path` names: its resolved path, its path with only the folder resolved
    (a symlink itself, which a rename replaces), and its (st_dev, st_ino) when it exists."""
    p = os.path.abspath(path)
    ids = {os.path.realpath(p), os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))}
    try:
        st = os.stat(p)
        ids.add((st.st_dev, st.st_ino))
    except OSError:
        pass
    return ids


def _inside(path: str, folder: Folder) -> bool:
    """`path` (resolved) is within `folder` and named like the files read from it."""
    if not os.path.isdir(folder.path):
        return False
    root = os.path.realpath(folder.path)
    p = os.path.abspath(path)
    for q in (os.path.realpath(p), os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))):
        if q == root or (os.path.commonpath([root, q]) == root and q.lower().endswith(folder.exts)):
            return True
    return False
