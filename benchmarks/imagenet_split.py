"""The shared ImageNet samples as the benchmarks read them (../shared/imagenet-samples/README.md):
files sorted by name; index % 10 == 0 is the calibration split (what `qtool calibrate --every 10`
takes), the rest the evaluation split. A file's class is its name up to the first '_'."""
import glob
import os

import numpy as np

from qtool.data.images import load_image

EVERY = 10


def split(folder: str) -> tuple:
    """(calibration files, evaluation files)."""
    files = sorted(glob.glob(os.path.join(folder, "*.JPEG")))
    return [f for i, f in enumerate(files) if i % EVERY == 0], [f for i, f in enumerate(files) if i % EVERY]


def class_indices(folder: str, files: list) -> np.ndarray:
    """Each file's class index, classes numbered in sorted order over the whole folder."""
    synsets = sorted({os.path.basename(f).split("_")[0] for f in glob.glob(os.path.join(folder, "*.JPEG"))})
    index = {s: i for i, s in enumerate(synsets)}
    return np.array([index[os.path.basename(f).split("_")[0]] for f in files])


def images(files: list, cfg) -> np.ndarray:
    return np.concatenate([load_image(f, cfg) for f in files])


def feeds(xs: np.ndarray, name: str, batch: int = 50) -> list:
    return [{name: xs[k:k + batch]} for k in range(0, len(xs), batch)]
