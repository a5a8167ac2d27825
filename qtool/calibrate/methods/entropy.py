"""Entropy (KL divergence), as TensorRT calibrates: the clipping threshold T whose
quantized distribution loses the least information about the observed one.

For a tensor with no negative values the search runs over [0, T] with 256 levels (uint8),
leaving out the bin of exact zeros;
otherwise over |x| with 128 levels and the range is [-T, T] cut to the data.
"""
import numpy as np


def _kl_threshold(counts: np.ndarray, levels: int) -> int:
    """Index (exclusive) of the best threshold bin.

    For each candidate threshold i: p is counts[:i] with everything beyond folded into bin
    i-1; q quantizes counts[:i] into `levels` groups of consecutive bins, each group's mass
    spread evenly over its non-zero bins. Within a group q is constant, so
    sum(p log(p/q)) over a group needs only the group's sum of c log c and its mass: every
    candidate is scored from prefix sums in O(levels), not O(bins)."""
    n = counts.size
    nz = np.nonzero(counts)[0]
    if nz.size == 0:
        return n
    last = int(nz[-1]) + 1
    if last <= levels:
        return last
    cand = np.unique(np.linspace(levels, last, num=min(256, last - levels + 1)).astype(np.int64))
    c = counts.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        clogc = np.where(c > 0, c * np.log(c), 0.0)
    csum = np.concatenate([[0.0], np.cumsum(c)])  # mass of bins [0, j)
    cl = np.concatenate([[0.0], np.cumsum(clogc)])
    cnz = np.concatenate([[0], np.cumsum(counts > 0)])  # non-zero bins among [0, j)
    total = csum[-1]
    # group g of threshold i holds bins [ceil(g*i/levels), ceil((g+1)*i/levels)); bin i-1 is in the last one
    bounds = -(-(np.arange(levels + 1)[None, :] * cand[:, None]) // levels)
    gsum = np.diff(csum[bounds], axis=1)
    gnz = np.diff(cnz[bounds], axis=1)
    qmass = csum[cand]  # q's total: all of counts[:i] sits on non-zero bins
    with np.errstate(divide="ignore", invalid="ignore"):
        logq = np.where(gnz > 0, np.log(gsum / np.maximum(gnz, 1)), 0.0)  # log of q on the group's bins
        lb = cand - 1
        mass = gsum.copy()
        mass[:, -1] -= c[lb]  # bins below i-1 only: bin i-1 is scored with the tail below
        below = csum[lb]
        kl = (cl[lb] - below * np.log(total) - (mass * logq).sum(axis=1) + below * np.log(qmass)) / total
        p_last = (c[lb] + (total - csum[cand])) / total
        q_last = np.where(c[lb] > 0, gsum[:, -1] / np.maximum(gnz[:, -1], 1), 0.0) / qmass
        kl += np.where(p_last > 0, p_last * np.log(p_last / np.maximum(q_last, 1e-12)), 0.0)
    kl[~(qmass > 0)] = np.inf
    if not np.isfinite(kl).any():
        return last
    return int(cand[int(np.argmin(kl))])


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
