"""A classifier's [N, C] (C > 1) scores: top-1 agreement over samples."""
from __future__ import annotations

import numpy as np


class Classes:
    per_class = True

    @staticmethod
    def recognises(first) -> bool:
        return first.task == "classifier" and first.agreement == "class"

    def __init__(self, first):
        self.same = self.positions = 0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        eq = a.argmax(-1) == b.argmax(-1)
        self.same += int(eq.sum())
        self.positions += eq.size

    def result(self) -> dict:
        return {"top1_agreement": self.same / max(self.positions, 1), "agreement_over": "samples"}


def topk(logits: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-logits, axis=1)[:, :k]


def top5_overlap(lf: np.ndarray, lq: np.ndarray) -> float | None:
    """Share of fp32's top-5 classes also in int8's top-5, over samples (None under 5 classes)."""
    if lf.shape[1] < 5:
        return None
    return float(np.mean([len(set(p) & set(q)) / 5 for p, q in zip(topk(lf, 5), topk(lq, 5))]))


def accuracy(lf: np.ndarray, lq: np.ndarray, truth: list) -> dict:
    """Top-1 and top-5 accuracy of fp32's (`lf`) and int8's (`lq`) scores where a sample has a label
    (`truth`: a class index or None per sample); {} with no label or a single class."""
    have = [t is not None for t in truth]
    if not any(have) or lf.shape[1] <= 1:
        return {}
    m = np.array(have)
    yt = np.array([t for t in truth if t is not None])
    res = {"n_labelled": int(m.sum())}
    for key, logits in (("fp32", lf), ("int8", lq)):
        top = topk(logits[m], 5)
        res[key] = {"top1": float((top[:, 0] == yt).mean()), "top5": float((top == yt[:, None]).any(1).mean())}
    res["top1_delta_pt"] = 100 * (res["int8"]["top1"] - res["fp32"]["top1"])
    res["top5_delta_pt"] = 100 * (res["int8"]["top5"] - res["fp32"]["top5"])
    return res
