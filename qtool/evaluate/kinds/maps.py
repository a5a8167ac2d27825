"""Dense maps and features (a text detector's probability map, a segmentation, a gain mask, a spectrogram):
judged by their magnitude alone, SQNR and max |error|; the figures every numeric output gets."""
from __future__ import annotations

import numpy as np


class Magnitude:
    def __init__(self):
        self.sig = self.noise = self.maxerr = 0.0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        self.sig += float((a ** 2).sum())
        self.noise += float(((a - b) ** 2).sum())
        self.maxerr = max(self.maxerr, float(np.abs(a - b).max()) if a.size else 0.0)

    def result(self, seen: bool) -> dict:
        """`seen`: whether any batch was compared (else no SQNR: every batch's shapes differed)."""
        return {"sqnr_db": float(10 * np.log10(self.sig / self.noise)) if self.noise > 0
                else (float("inf") if seen else None), "max_abs_error": self.maxerr}
