"""Image files -> model input tensors, as a preprocessing config describes.

Decoding is Pillow's, with EXIF orientation applied; grayscale, RGBA, palette, CMYK and
16-bit images are converted to the config's colour; a file Pillow cannot read is skipped,
counted and named, never fatal.
"""
from __future__ import annotations

import math
import os
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageOps

from qtool.data.config import Preprocess
from qtool.errors import QtoolError
from qtool.limits import MAX_IMAGE_PIXELS, MAX_RESIZED_PIXELS, is_regular_file, walk

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm", ".pgm")
_RESAMPLE = {"nearest": Image.NEAREST, "bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC,
             "lanczos": Image.LANCZOS}


class BadImage(Exception):
    pass


def list_images(folder: str) -> list:
    """Image files below `folder` (recursively, sorted by relative path)."""
    if not os.path.exists(folder):
        raise QtoolError(f"{folder}: no such data folder")
    if not os.path.isdir(folder):
        raise QtoolError(f"{folder}: not a folder")
    files = []
    for root, dirs, names in walk(folder):
        dirs.sort()
        files.extend(os.path.join(root, n) for n in names if n.lower().endswith(IMAGE_EXTS))
    files.sort(key=lambda p: os.path.relpath(p, folder))
    return files


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        a = np.asarray(im, np.float64)
        peak = 65535.0 if (im.mode.startswith("I;16") or a.max() > 255) else 255.0
        a = np.clip(a * (255.0 / peak), 0, 255).astype(np.uint8)
        return Image.fromarray(a, "L").convert("RGB")
    if im.mode == "F":
        a = np.asarray(im, np.float64)
        a = a * 255.0 if a.max() <= 1.0 else a
        return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8), "L").convert("RGB")
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA"):
        # composite over white, as a viewer shows the picture, rather than keep hidden colours
        im = im.convert("RGBA")
        bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, im).convert("RGB")
    return im.convert("RGB")


def _resize(im: Image.Image, size: tuple, resample, path: str) -> Image.Image:
    """im.resize, after checking what it would allocate."""
    w, h = size
    if w * h > MAX_RESIZED_PIXELS:
        iw, ih = im.size
        raise BadImage(f"{path}: resizing {iw} x {ih} pixels to {w} x {h} would exceed the limit of "
                       f"{MAX_RESIZED_PIXELS} pixels")
    return im.resize((w, h), resample)


def limit_size(iw: int, ih: int, limit_side: int, multiple: int) -> tuple:
    """(W, H) as PP-OCR's detector resizes (DetResizeForTest, limit_type "max"): the longest side scaled
    down to `limit_side`, never up, each side truncated, then rounded to the nearest multiple (Python's
    round: half to even), at least one multiple. Its arithmetic exactly: a side off by one multiple
    moves every text box the model finds."""
    ratio = min(1.0, limit_side / max(iw, ih))
    return tuple(max(int(round(int(s * ratio) / multiple) * multiple), multiple) for s in (iw, ih))


def load_image(path: str, cfg: Preprocess) -> np.ndarray:
    """One image as a float32 array [1, C, H, W] or [1, H, W, C]. Only a regular file is opened (a FIFO
    would block for ever), and the decoded size (from the header, before decoding) and the size of
    every resize are checked against limits first: an image over them is a BadImage (skipped)."""
    if not is_regular_file(path):
        raise BadImage(f"{path}: not a regular file")
    try:
        with Image.open(path) as im:
            iw, ih = im.size
            if iw * ih > MAX_IMAGE_PIXELS:
                raise BadImage(f"{path}: {iw} x {ih} pixels, over the limit of {MAX_IMAGE_PIXELS} decoded pixels")
            im.load()
            im = ImageOps.exif_transpose(im)
            im = _to_rgb(im)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, EOFError, MemoryError) as e:
        raise BadImage(f"{path}: {type(e).__name__}: {e}") from None
    h, w = cfg.size
    rs = _RESAMPLE[cfg.interpolation]
    if cfg.resize == "limit":  # (these two resize below, to (w, h))
        w, h = limit_size(*im.size, cfg.limit_side, cfg.multiple)
    elif cfg.resize == "height":  # as PP-OCR's recognizer (resize_norm_img): the width in ratio, rounded up
        iw, ih = im.size
        w = min(w, math.ceil(h * (iw / ih)))
    elif cfg.resize == "shorter":
        iw, ih = im.size
        s = cfg.resize_to / min(iw, ih)
        im = _resize(im, (max(1, round(iw * s)), max(1, round(ih * s))), rs, path)
    elif cfg.resize == "exact":
        im = _resize(im, (w, h), rs, path)
    if cfg.crop == "center":
        iw, ih = im.size
        if iw < w or ih < h:
            im = _resize(im, (max(w, iw), max(h, ih)), rs, path)
            iw, ih = im.size
        left, top = (iw - w) // 2, (ih - h) // 2
        im = im.crop((left, top, left + w, top + h))
    if im.size != (w, h):
        im = _resize(im, (w, h), rs, path)
    if cfg.color == "GRAY":
        x = np.asarray(im.convert("L"), np.float32)[..., None]
    else:
        x = np.asarray(im, np.float32)
        if cfg.color == "BGR":
            x = x[..., ::-1]
    x = (x - np.asarray(cfg.mean, np.float32)) / np.asarray(cfg.std, np.float32)
    if cfg.resize == "height" and w < cfg.size[1]:  # zeros after normalising, as PaddleOCR's padding_im
        x = np.pad(x, ((0, 0), (0, cfg.size[1] - w), (0, 0)))
    x = x.transpose(2, 0, 1) if cfg.layout == "NCHW" else x
    return np.ascontiguousarray(x[None], np.float32)


def _bounded_map(pool, fn, items, ahead: int):
    """(item, fn(item)) in order, with at most `ahead` calls submitted but not yet consumed."""
    pending = deque()
    it = iter(items)
    for item in it:
        pending.append((item, pool.submit(fn, item)))
        if len(pending) >= ahead:
            break
    while pending:
        item, fut = pending.popleft()
        nxt = next(it, None)
        if nxt is not None:
            pending.append((nxt, pool.submit(fn, nxt)))
        yield item, fut.result()


@dataclass
class ImageStream:
    """Iterates (names, batch) over image files; bad files are skipped and recorded. A batch ends early
    where the next image's size differs, so memory stays at one batch whatever the sizes."""

    files: list
    cfg: Preprocess
    batch: int = 8
    workers: int = 2
    skipped: list = field(default_factory=list)

    def __len__(self):
        return len(self.files)

    def __iter__(self):
        names, xs = [], []
        with ThreadPoolExecutor(self.workers) as pool:
            # Pillow releases the GIL while decoding and resizing: two files at once, and at
            # most two batches decoded ahead, so memory does not grow with the folder
            for path, res in _bounded_map(pool, self._safe_load, self.files, 2 * self.batch + self.workers):
                if isinstance(res, str):
                    self.skipped.append(res)
                    warnings.warn(f"skipping unreadable image {res}", stacklevel=2)
                    continue
                if xs and res.shape != xs[0].shape:  # a batch holds one size (resize = "limit": per image)
                    yield names, np.concatenate(xs)
                    names, xs = [], []
                names.append(path)
                xs.append(res)
                if len(xs) == self.batch:
                    yield names, np.concatenate(xs)
                    names, xs = [], []
        if xs:
            yield names, np.concatenate(xs)

    def _safe_load(self, path):
        try:
            return load_image(path, self.cfg)
        except BadImage as e:
            return str(e)
