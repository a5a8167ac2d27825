"""Ground-truth labels for an evaluation folder.

Two layouts: ImageFolder (`class_name/image.jpg`, classes sorted = class indices), or a
labels file listing one class per line in class-index order, an image's class being the
entry its file name starts with before the first `_` (`n01440764_tench.JPEG`), matched
against the first word of each line.
"""
from __future__ import annotations

import os

from qtool.errors import QtoolError


def labels_from_file(path: str, files: list) -> list:
    try:
        with open(path, encoding="utf-8") as f:
            keys = [ln.split()[0] for ln in f if ln.strip()]
    except FileNotFoundError:
        raise QtoolError(f"{path}: no such labels file") from None
    except UnicodeDecodeError:
        raise QtoolError(f"{path}: labels file is not UTF-8 text") from None
    if not keys:
        raise QtoolError(f"{path}: labels file is empty")
    index = {k: i for i, k in enumerate(keys)}
    out, missing = [], 0
    for p in files:
        key = os.path.basename(p).split("_")[0]
        key = key if key in index else os.path.splitext(os.path.basename(p))[0]
        out.append(index.get(key))
        missing += key not in index
    if missing == len(files):
        raise QtoolError(f"{path}: no image's name starts with a class listed in the labels file "
                         f"(first entries: {', '.join(keys[:3])})")
    return out


def labels_from_folders(root: str, files: list) -> list | None:
    """Class index from the first folder level, or None when images are not in class folders."""
    rel = [os.path.relpath(p, root).split(os.sep) for p in files]
    if not rel or any(len(r) < 2 for r in rel):
        return None
    classes = sorted({r[0] for r in rel})
    if len(classes) < 2:
        return None
    idx = {c: i for i, c in enumerate(classes)}
    return [idx[r[0]] for r in rel]
