"""Integers out (unidic's tags from an ArgMax, a class id): an SQNR over ids, or an argmax over them, means
nothing; each value and each sample is equal or not."""
from __future__ import annotations

import numpy as np


def _pixels(a: np.ndarray) -> bool:
    """uint8 / uint16 values out (depth2normal's normal map, a picture, 16-bit audio) are magnitudes,
    judged by SQNR: an off-by-one in a 0-255 pixel is no wrong class. Ids come as int32/int64 (ArgMax)."""
    return a.dtype.kind == "u" and a.dtype.itemsize <= 2


class Ids:
    @staticmethod
    def recognises(a: np.ndarray, b: np.ndarray) -> bool:
        return a.dtype.kind in "iub" and b.dtype.kind in "iub" and a.shape == b.shape and not _pixels(a)

    def __init__(self):
        self.shape = None
        self.n = self.same = self.positions = self.samples_same = 0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        self.shape = list(a.shape)
        rows = a.reshape(len(a), -1) if a.ndim else a.reshape(1, 1)
        eq = rows == b.reshape(rows.shape)
        self.n += len(rows)
        self.positions += eq.size
        self.same += int(eq.sum())
        self.samples_same += int(eq.all(axis=1).sum())

    def result(self) -> dict:
        return {"shape": self.shape, "labels_equal": self.same / max(self.positions, 1),
                "samples_equal": self.samples_same / max(self.n, 1)}
