"""Entropy (KL divergence), as TensorRT calibrates: the clipping threshold T whose
quantized distribution loses the least information about the observed one.

For a tensor with no negative values the search runs over [0, T] with 256 levels (uint8),
leaving out the bin of exact zeros;
otherwise over |x| with 128 levels and the range is [-T, T] cut to the data.
"""
import numpy as np


def _kl_threshold(counts: np.ndarray, levels: int) -> int:
    """Index (exclusive) of the best threshold bin."""
    n = counts.size
    nz = np.nonzero(counts)[0]
    if nz.size == 0:
        return n
    last = int(nz[-1]) + 1
    if last <= levels:
        return last
    candidates = np.unique(np.linspace(levels, last, num=min(256, last - levels + 1)).astype(int))
    best, best_kl = last, np.inf
    for i in candidates:
        p = counts[:i].astype(np.float64).copy()
        p[i - 1] += counts[i:].sum()
        # quantize the first i bins into `levels` groups, spreading each group over its non-zero bins
        groups = np.minimum((np.arange(i) * levels) // i, levels - 1)
        ref = counts[:i].astype(np.float64)
        gsum = np.bincount(groups, weights=ref, minlength=levels)
        gnz = np.bincount(groups, weights=(ref > 0).astype(np.float64), minlength=levels)
        q = np.where(ref > 0, gsum[groups] / np.maximum(gnz[groups], 1), 0.0)
        mask = p > 0
        ps, qs = p.sum(), q.sum()
        if qs == 0:
            continue
        pn, qn = p[mask] / ps, q[mask] / qs
        kl = np.sum(pn * np.log(pn / np.maximum(qn, 1e-12)))
        if kl < best_kl:
            best, best_kl = int(i), kl
    return best


def _from_zero(hist, fold: bool):
    """Counts of x (or |x| with fold) in bins from 0 up, at most 2 * NBINS of them.

    Data far from zero at a fine width would need a bin per width from 0: bins merge by
    powers of two until the span from 0 fits, keeping the memory bounded."""
    k = np.arange(hist.k0, hist.k0 + hist.nbins, dtype=np.int64)
    nz = hist.counts > 0
    k, c = k[nz], hist.counts[nz]
    if fold:
        k = np.where(k >= 0, k, -k - 1)  # global bin k < 0 holds |x| of bin -k-1
    else:
        k, c = k[k >= 0], c[k >= 0]
    shift = 0
    top = int(k.max()) if k.size else 0
    while (top >> shift) + 1 > 2 * hist.nbins:
        shift += 1
    counts = np.bincount(k >> shift, weights=c, minlength=(top >> shift) + 1).astype(np.int64)
    return counts, hist.width * (1 << shift)


def compute(hist):
    if hist.n == 0:
        return 0.0, 0.0
    if hist.min >= 0:
        counts, w = _from_zero(hist, fold=False)
        # the exact zeros a Relu makes are represented exactly by the zero point; left in,
        # their spike dominates the divergence and drags the threshold towards 0
        counts[0] = 0
        t = _kl_threshold(counts, 256) * w
        return float(hist.min), float(min(hist.max, max(t, hist.min)))
    counts, w = _from_zero(hist, fold=True)
    t = _kl_threshold(counts, 128) * w
    return float(max(hist.min, -t)), float(min(hist.max, t))
