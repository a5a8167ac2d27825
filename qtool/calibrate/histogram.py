"""A streaming histogram whose memory does not grow with the number of images.

Bins sit on a grid anchored at 0 with a power-of-two width w = 2**e: bin k holds
[k*w, (k+1)*w). When new data falls outside the window of NBINS bins, the width doubles
and pairs of bins merge exactly, so the histogram of all data seen so far is always
exact at its current resolution (at least NBINS/2 bins over the data's span). x / w is
an exact float operation, so bin assignment is exact too. min and max are kept exactly.
Every calibration method (qtool/calibrate/methods/) answers from this one accumulator.
"""
from __future__ import annotations

import math

import numpy as np

NBINS = 4096
# Histograms count a systematic sample of at most this many values per sample (image) of a
# tensor; min and max always see every value. 2^15 values per image and tensor put about
# 330 values beyond a 99.999th percentile over 1000 images (33 over 100), while keeping the
# histogram pass a fraction of the inference that produced the tensor.
SAMPLE_PER_IMAGE = 1 << 15

try:  # the native one-pass update; numpy below is the reference and the fallback
    from qtool.calibrate import _histogram as _native
except ImportError:  # pragma: no cover - exercised when the extension is not built
    _native = None


class Histogram:
    def __init__(self, nbins: int = NBINS):
        self.nbins = nbins
        self.counts = np.zeros(nbins, np.int64)
        self.k0 = 0  # global index of counts[0]
        self.e = None  # width exponent, None until data arrives
        self.min = math.inf
        self.max = -math.inf
        self.n = 0  # values counted in the histogram
        self.n_observed = 0  # observe() calls

    # -- accumulation -------------------------------------------------------------
    @property
    def width(self) -> float:
        return math.ldexp(1.0, self.e)

    def _fits(self, e: int, lo: float, hi: float) -> bool:
        w = math.ldexp(1.0, e)
        return math.floor(hi / w) - math.floor(lo / w) < self.nbins

    def _rebin(self, e_new: int, lo: float) -> None:
        w_new = math.ldexp(1.0, e_new)
        k0_new = math.floor(lo / w_new)
        if self.e is not None and self.n:
            shift = e_new - self.e
            k = np.arange(self.k0, self.k0 + self.nbins, dtype=np.int64) >> shift
            counts = np.bincount(k - k0_new, weights=self.counts, minlength=self.nbins)
            self.counts = np.rint(counts[: self.nbins]).astype(np.int64)
        self.e, self.k0 = e_new, k0_new

    def observe(self, x: np.ndarray, samples: int = 1, scanned: tuple | None = None,
                first_sample: int | None = None) -> None:
        """Add a tensor holding `samples` samples (its batch size) to the histogram.
        `scanned`: what scan(x) returned, when the caller already read x for other reasons.
        `first_sample`: the index of x's first sample in the whole stream. With it, which blocks
        of sample j are counted depends on j alone, so the histogram is the same however the
        stream was cut into batches or dealt to workers; without it, the offset rotates per call."""
        shape = np.shape(x)
        x = np.ascontiguousarray(x, np.float32).ravel()
        if x.size == 0:
            return
        mn, mx, finite = scanned if scanned is not None else scan(x)
        if not finite:
            x = x[np.isfinite(x)]
            if x.size == 0:
                return
            mn, mx = float(x.min()), float(x.max())
        lo, hi = min(mn, self.min), max(mx, self.max)
        if self.e is None:
            span = max(hi - lo, abs(hi), abs(lo), 1e-30)
            e = math.frexp(span / (self.nbins - 2))[1]
            # never finer than float32 can tell apart around the data (a constant tensor fits any width)
            e_min = math.frexp(max(abs(lo), abs(hi), 1e-30))[1] - 24
            while e > e_min and self._fits(e - 1, lo, hi):
                e -= 1
            while not self._fits(e, lo, hi):
                e += 1
            self._rebin(e, lo)
        elif not (self._window_has(lo) and self._window_has(hi)):
            e = self.e
            while not self._fits(e, lo, hi):
                e += 1
            self._rebin(e, lo)
        self.min, self.max = lo, hi
        self.n_observed += 1
        if first_sample is None or not finite or samples <= 1 or not shape or shape[0] != samples:
            # one run of blocks over all of x; the offset rotates, so every block is counted over time
            step = max(1, -(-x.size // (SAMPLE_PER_IMAGE * max(samples, 1))))
            offset = (self.n_observed - 1 if first_sample is None else first_sample) % step
            self._accumulate(x, offset, step)
            return
        per = x.size // samples
        step = max(1, -(-per // SAMPLE_PER_IMAGE))
        for j in range(samples):
            self._accumulate(x[j * per:(j + 1) * per], (first_sample + j) % step, step)

    def _accumulate(self, x: np.ndarray, offset: int, step: int) -> None:
        self.n += _sampled_size(x.size, offset, step)
        if _native is not None:
            _native.accumulate(x, self.counts, self.e, self.k0, offset, step)
        else:
            self.counts += accumulate_reference(sampled_blocks(x, offset, step), self.nbins, self.e, self.k0)

    def merge(self, other: "Histogram") -> None:
        """Add another histogram of the same tensor (another worker's share of the samples).
        Both grids are anchored at 0 with power-of-two widths, so coarsening either one is
        exact: the result is the histogram of all values at the finest width that spans them."""
        if other.nbins != self.nbins:
            raise ValueError("histograms with different bin counts")
        if other.e is None:
            return
        if self.e is None:
            self.counts, self.k0, self.e = other.counts.copy(), other.k0, other.e
            self.min, self.max, self.n, self.n_observed = other.min, other.max, other.n, other.n_observed
            return
        lo, hi = min(self.min, other.min), max(self.max, other.max)
        e = max(self.e, other.e)
        while not self._fits(e, lo, hi):
            e += 1
        self._rebin(e, lo)
        k = (np.arange(other.k0, other.k0 + other.nbins, dtype=np.int64) >> (e - other.e)) - self.k0
        nz = other.counts != 0
        np.add.at(self.counts, k[nz], other.counts[nz])
        self.min, self.max = lo, hi
        self.n += other.n
        self.n_observed += other.n_observed

    def _window_has(self, v: float) -> bool:
        k = math.floor(v / self.width)
        return self.k0 <= k < self.k0 + self.nbins

    # -- answers -------------------------------------------------------------------
    def edges(self) -> np.ndarray:
        return (np.arange(self.k0, self.k0 + self.nbins + 1, dtype=np.float64)) * self.width

    def centers(self) -> np.ndarray:
        e = self.edges()
        return (e[:-1] + e[1:]) / 2

    def to_dict(self) -> dict:
        nz = np.nonzero(self.counts)[0]
        first, last = (int(nz[0]), int(nz[-1]) + 1) if nz.size else (0, 0)
        finite = math.isfinite(self.min) and math.isfinite(self.max)  # (not before data: JSON has no inf)
        return {"nbins": self.nbins, "e": self.e, "k0": self.k0 + first, "min": self.min if finite else None,
                "max": self.max if finite else None,
                "n": self.n, "n_observed": self.n_observed, "counts": self.counts[first:last].tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "Histogram":
        h = cls(int(d["nbins"]))
        h.e, h.k0, h.n, h.n_observed = d["e"], int(d["k0"]), int(d["n"]), int(d.get("n_observed", 0))
        h.min = math.inf if d["min"] is None else float(d["min"])
        h.max = -math.inf if d["max"] is None else float(d["max"])
        c = np.asarray(d["counts"], np.int64)
        h.counts[: c.size] = c
        return h


def scan(x: np.ndarray, inner: int = 0, sums: np.ndarray | None = None) -> tuple:
    """(min, max, finite) of a float32 tensor in one read. With `sums` (float64 [C]), the sum of
    each run of `inner` values is also added to sums[run % C]: an NCHW tensor's channel sums
    when inner = H*W. min and max are exact; the sums are float64 like the reference's, equal
    to it up to the order of summation. When finite is False (NaN or inf present), min and max are not to be used."""
    x = np.ascontiguousarray(x, np.float32).ravel()
    if _native is not None:
        mn, mx, has_nan = _native.scan(x, inner, sums) if sums is not None else _native.scan(x)
        return mn, mx, not has_nan and math.isfinite(mn) and math.isfinite(mx)
    return scan_reference(x, inner, sums)


def scan_reference(x: np.ndarray, inner: int = 0, sums: np.ndarray | None = None) -> tuple:
    x = np.ascontiguousarray(x, np.float32).ravel()
    if sums is not None:
        sums += x.reshape(-1, sums.size, inner).sum(axis=2, dtype=np.float64).sum(axis=0)
    if x.size == 0:
        return math.inf, -math.inf, True
    fin = np.isfinite(x)
    ok = bool(fin.all())
    v = x if ok else x[~np.isnan(x)]
    if v.size == 0:
        return math.inf, -math.inf, False
    return float(v.min()), float(v.max()), ok


BLOCK = 16  # values per sampled block: one 64-byte cache line of float32


def sampled_blocks(x: np.ndarray, offset: int, step: int) -> np.ndarray:
    """Every step-th block of BLOCK values from block `offset`: what the native update counts."""
    if step == 1 and offset == 0:
        return x
    nblocks = -(-x.size // BLOCK)
    starts = np.arange(offset, nblocks, step) * BLOCK
    idx = (starts[:, None] + np.arange(BLOCK)[None, :]).ravel()
    return x[idx[idx < x.size]]


def _sampled_size(size: int, offset: int, step: int) -> int:
    nblocks = -(-size // BLOCK)
    starts = range(offset, nblocks, step)
    if not starts:
        return 0
    last = starts[-1] * BLOCK
    return (len(starts) - 1) * BLOCK + min(BLOCK, size - last)


def accumulate_reference(x: np.ndarray, nbins: int, e: int, k0: int) -> np.ndarray:
    """Counts of x per bin k - k0 of width 2**e; the spec the native update must match."""
    k = np.floor(np.ldexp(x.astype(np.float64), -e)).astype(np.int64) - k0
    return np.bincount(np.clip(k, 0, nbins - 1), minlength=nbins)
