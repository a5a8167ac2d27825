"""A detector's rows [N, R, K] (or [N, K, R]; metrics.detector_like): how many of fp32's top-scoring rows
int8 also ranks top (top-1, 10, 100), and the max |error| within fp32's top 10 rows."""
from __future__ import annotations

import numpy as np


def row_scores(rows: np.ndarray, objectness: bool = True) -> np.ndarray:
    """Each row's score: objectness (column 4) times the best class score (columns 5...) in the YOLOv5
    convention; the best class score (columns 4...) without objectness (YOLOv8)."""
    if not objectness:
        return rows[:, 4:].max(1)
    return rows[:, 4] * rows[:, 5:].max(1) if rows.shape[1] > 5 else rows[:, 4]


class Rows:
    per_class = False

    @staticmethod
    def recognises(first) -> bool:
        return first.task == "detector" and first.layout is not None

    def __init__(self, first):
        self.layout, self.top_rows = first.layout, first.top_rows
        self.rows: dict = {}  # k -> fraction of fp32's top-k rows also in int8's top-k, per sample
        self.row_err: list = []

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        for x, y in zip(a, b):
            if self.layout == "columns":
                x, y = x.T, y.T
            sf, sq = row_scores(x, objectness=self.layout == "rows"), row_scores(y, objectness=self.layout == "rows")
            for k in sorted({min(k, len(sf)) for k in self.top_rows}):  # top-k over at most R rows
                tf, tq = np.argsort(-sf)[:k], np.argsort(-sq)[:k]
                self.rows.setdefault(k, []).append(len(set(tf) & set(tq)) / k)
            top = np.argsort(-sf)[:min(10, len(sf))]
            self.row_err.append(float(np.abs(x[top] - y[top]).max()))

    def result(self) -> dict:
        if not any(self.rows.values()):
            return {}
        return {"top_rows_agreement": {f"top{k}": float(np.mean(v)) for k, v in self.rows.items() if v},
                "top10_rows_max_abs_error": float(max(self.row_err))}
