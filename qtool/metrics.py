"""How far an int8 output is from its fp32 reference: one place for every comparison."""
from __future__ import annotations

import math

import numpy as np


def sqnr_db(ref: np.ndarray, out: np.ndarray) -> float:
    ref = np.asarray(ref, np.float64)
    noise = float(((ref - np.asarray(out, np.float64)) ** 2).sum())
    return float("inf") if noise == 0 else float(10 * np.log10(max(float((ref ** 2).sum()), 1e-300) / noise))


def top1_agreement(ref: np.ndarray, out: np.ndarray) -> float:
    return float((ref.reshape(len(ref), -1).argmax(1) == out.reshape(len(out), -1).argmax(1)).mean())


def _log_softmax(x):
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def kl_softmax_each(ref: np.ndarray, out: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(out)) of each sample, in nats."""
    lp = _log_softmax(np.asarray(ref, np.float64).reshape(len(ref), -1))
    lq = _log_softmax(np.asarray(out, np.float64).reshape(len(out), -1))
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


def kl_softmax(ref: np.ndarray, out: np.ndarray) -> float:
    """Mean KL(softmax(ref) || softmax(out)) over samples, in nats."""
    return float(kl_softmax_each(ref, out).mean())


def predicted_agreement(ref: np.ndarray, out: np.ndarray) -> float:
    """Expected top-1 agreement on images like these, smoother than counting flips on a few.

    The int8 error on the gap between the fp32 winner and runner-up is modelled as
    Gaussian with the spread measured on these samples; an image flips with probability
    Phi(-margin / sigma). On 64 images this ranks candidates where a raw count shows 64/64.
    """
    ref = np.asarray(ref, np.float64).reshape(len(ref), -1)
    out = np.asarray(out, np.float64).reshape(len(out), -1)
    if ref.shape[1] < 2:
        return 1.0
    order = np.argsort(-ref, axis=1)
    i1, i2 = order[:, 0], order[:, 1]
    rows = np.arange(len(ref))
    margin = ref[rows, i1] - ref[rows, i2]
    d = (out[rows, i1] - ref[rows, i1]) - (out[rows, i2] - ref[rows, i2])
    sigma = math.sqrt(float((d ** 2).mean())) if len(d) else 0.0
    if sigma == 0:
        return top1_agreement(ref, out)
    flip = 0.5 * np.array([math.erfc(m / (sigma * math.sqrt(2))) for m in margin])
    return float(1 - flip.mean())


def wilson(k: int, n: int, z: float = 1.96) -> tuple:
    """95 % interval of a proportion k / n: how much a count over n images can say."""
    if n == 0:
        return (0.0, 1.0)
    p, d = k / n, 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))
