"""Vectors along the last axis (an embedding's, a token's, a recurrent state's): the cosine of fp32's and
int8's. Where fp32's vectors all have length 1 (a face's or a sentence's normalized embedding), the output is
an embedding: its cosine says it, and no argmax over it means anything (classifier and sequence decline)."""
from __future__ import annotations

import numpy as np

from qtool.metrics import UNIT_ROWS_MIN, is_distribution


def _has_vectors(a: np.ndarray) -> bool:
    return a.ndim >= 2 and a.shape[-1] >= 2


def unit_rows(a: np.ndarray) -> bool:
    """fp32's vectors all of length 1, at least UNIT_ROWS_MIN long (a confident softmax's rows are near
    length 1 too: probabilities are classes)."""
    if not (_has_vectors(a) and a.size):
        return False
    va = a.reshape(-1, a.shape[-1])
    na = np.sqrt((va * va).sum(1))
    return a.shape[-1] >= UNIT_ROWS_MIN and bool(np.abs(na - 1).max() <= 1e-2) and not is_distribution(a)


class Vectors:
    per_class = False

    @staticmethod
    def recognises(first) -> bool:
        return _has_vectors(first.values) and first.task != "encoder"  # (an encoder's: kinds/encoder.py)

    def __init__(self, first):
        self.unit_rows = first.unit_rows
        self.cos_sum, self.cos_n, self.cos_min = 0.0, 0, 1.0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        if not (_has_vectors(a) and a.size):
            return
        va, vb = a.reshape(-1, a.shape[-1]), b.reshape(-1, a.shape[-1])
        na, nb = np.sqrt((va * va).sum(1)), np.sqrt((vb * vb).sum(1))
        ok = (na > 0) & (nb > 0)
        if ok.any():
            cos = (va[ok] * vb[ok]).sum(1) / (na[ok] * nb[ok])
            self.cos_sum += float(cos.sum())
            self.cos_n += int(ok.sum())
            self.cos_min = min(self.cos_min, float(cos.min()))

    def result(self) -> dict:
        if not self.cos_n:
            return {}
        return {"cosine": {"mean": self.cos_sum / self.cos_n, "min": self.cos_min, "vectors": self.cos_n,
                           "unit_length": self.unit_rows}}
