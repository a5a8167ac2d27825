"""What a calibration pass keeps of the tensors it observes (Observed: histograms, per-channel sums and
ranges, NaN/inf counts, the output watch) and how one run's outputs fold into it (observe). Every statistic
merges exactly, so workers, shards and machines each keep their own and the driver adds them up."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qtool.calibrate.checks import OutputWatch
from qtool.calibrate.histogram import Histogram, scan


MEAN_SAMPLES = 128  # per-channel means (for bias correction): 128 images x every pixel settle them
NONFINITE_NAMED = 10  # samples named per tensor with NaN/inf values (the count covers them all)


@dataclass
class Observed:
    histograms: dict = field(default_factory=dict)  # tensor -> Histogram
    channel_sums: dict = field(default_factory=dict)  # tensor -> float64 [C], of finite values
    channel_counts: dict = field(default_factory=dict)  # tensor -> int64 [C], finite values summed per channel
    channel_min: dict = field(default_factory=dict)  # tensor -> float64 [C] (the `ranged` tensors, axis 1)
    channel_max: dict = field(default_factory=dict)
    n_samples: int = 0
    watch: OutputWatch | None = None  # the first model output, summarised (checks.py)
    # NaN and inf are excluded from every statistic (min, max, histogram, channel means) and counted:
    nonfinite: dict = field(default_factory=dict)  # tensor -> number of NaN/inf values seen
    nonfinite_samples: dict = field(default_factory=dict)  # tensor -> sorted indices of the first samples holding them
    # how the pass ran, for a sharded pass (sharded.py) to cut and fold its shards as one process would:
    per_sample_bytes: int | None = None  # observed bytes per sample, as the first run measured them
    lanes: int = 1  # workers the samples were dealt to in turn (each sums its own channel sums: merge order)

    def channel_means(self) -> dict:
        return {t: (s / np.maximum(self.channel_counts[t], 1)).tolist() for t, s in self.channel_sums.items()}

    def add_channel_range(self, t: str, lo: np.ndarray, hi: np.ndarray) -> None:
        if t in self.channel_min:
            lo, hi = np.minimum(self.channel_min[t], lo), np.maximum(self.channel_max[t], hi)
        self.channel_min[t], self.channel_max[t] = lo, hi

    def channel_ranges(self) -> dict:
        return {t: [self.channel_min[t].tolist(), self.channel_max[t].tolist()] for t in self.channel_min}

    def add_nonfinite(self, t: str, count: int, samples) -> None:
        self.nonfinite[t] = self.nonfinite.get(t, 0) + int(count)
        self.nonfinite_samples[t] = sorted(set(self.nonfinite_samples.get(t, [])) | set(samples))[:NONFINITE_NAMED]

    def no_finite_value(self) -> list:
        """Tensors that held NaN/inf and not one finite value."""
        return [t for t in self.nonfinite if t in self.histograms and self.histograms[t].e is None]

    def merge(self, other: "Observed") -> None:
        """Add another worker's observations of the same tensors."""
        for t, h in other.histograms.items():
            self.histograms[t].merge(h)
        for t, sums in other.channel_sums.items():
            if t in self.channel_sums:
                self.channel_sums[t] = self.channel_sums[t] + sums
                self.channel_counts[t] = self.channel_counts[t] + other.channel_counts[t]
            else:
                self.channel_sums[t], self.channel_counts[t] = sums.copy(), other.channel_counts[t].copy()
        for t, c in other.nonfinite.items():
            self.add_nonfinite(t, c, other.nonfinite_samples.get(t, []))
        for t in other.channel_min:
            self.add_channel_range(t, other.channel_min[t], other.channel_max[t])
        self.n_samples += other.n_samples
        self.per_sample_bytes = self.per_sample_bytes or other.per_sample_bytes
        if self.watch is not None and other.watch is not None:
            self.watch.merge(other.watch)


def observe(obs: Observed, values: dict, range_tensors: list, mean_tensors: list, n: int, first: int,
             pool=None) -> None:
    """Fold one run's outputs (samples first .. first + n - 1 of the stream) into the histograms
    and, while first < MEAN_SAMPLES, the channel sums. Tensors are independent, so `pool` may
    fold several at once: the native code releases the GIL."""
    means = set(mean_tensors) if first < MEAN_SAMPLES else set()
    todo = list(dict.fromkeys([t for t in range_tensors] + [t for t in mean_tensors if t in means]))
    todo.sort(key=lambda t: -np.size(values[t]))  # largest first: the workers finish together
    axes = as_axes(mean_tensors)
    jobs = [(obs.histograms.get(t), t, values[t], n, axes[t] if t in means else None, first) for t in todo]
    for t, sums, count, bad in (pool.map(_observe_one, *zip(*jobs)) if pool and jobs else
                                (_observe_one(*j) for j in jobs)):
        if bad is not None:
            obs.add_nonfinite(t, *bad)
        if sums is None:
            continue
        if t not in obs.channel_sums:
            obs.channel_sums[t] = np.zeros(sums.size, np.float64)
            obs.channel_counts[t] = np.zeros(sums.size, np.int64)
        obs.channel_sums[t] += sums
        obs.channel_counts[t] += count


def channel_range(v: np.ndarray) -> tuple:
    """(min, max) per channel (axis 1) of the finite values, float64 [C] each."""
    v = np.asarray(v, np.float32)
    axes = tuple(k for k in range(v.ndim) if k != 1)
    lo, hi = v.min(axis=axes).astype(np.float64), v.max(axis=axes).astype(np.float64)
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        fin = np.isfinite(v)
        lo = np.where(fin, v, np.inf).min(axis=axes).astype(np.float64)
        hi = np.where(fin, v, -np.inf).max(axis=axes).astype(np.float64)
        lo, hi = np.where(np.isfinite(lo), lo, 0.0), np.where(np.isfinite(hi), hi, 0.0)
    return lo, hi


def as_axes(mean_tensors) -> dict:
    """{tensor: channel axis} of mean tensors given as that dict or as a plain list (axis 1)."""
    return dict(mean_tensors) if isinstance(mean_tensors, dict) else {t: 1 for t in mean_tensors}


def _observe_one(hist: Histogram | None, t: str, v, n: int, axis: int | None, first: int):
    """One tensor: a single read gives min, max and (when asked: the channel `axis`, 1 or -1) the
    channel sums; then the histogram counts its sampled blocks. NaN and inf (rare: the read says whether
    there are any) are counted, with the samples they are in, and left out of the sums and the histogram.
    -> (t, channel sums, finite values per channel, (NaN/inf count, sample indices) or None)"""
    v = np.ascontiguousarray(v, np.float32)
    sums = count = bad = None
    if axis is not None and v.ndim >= 2 and v.size:
        c = v.shape[axis]
        sums = np.zeros(c, np.float64)
        count = np.full(c, v.size // c, np.int64)
        # each run of `inner` contiguous values belongs to one channel, channels in turn
        scanned = scan(v, 1 if axis in (-1, v.ndim - 1) else v.size // (v.shape[0] * c), sums)
    else:
        scanned = scan(v)
    if not scanned[2] and v.size:
        fin = np.isfinite(v)
        per = (~fin).reshape(n, -1).sum(axis=1) if v.ndim and v.shape[0] == n and n else None
        where = [first + int(j) for j in np.flatnonzero(per)] if per is not None else [first]
        bad = (int(v.size - np.count_nonzero(fin)), where)
        if sums is not None:  # the sums again, of the finite values only
            c = v.shape[axis]
            fv = np.moveaxis(np.where(fin, v, np.float32(0)), axis, -1).reshape(-1, c)
            sums = fv.sum(axis=0, dtype=np.float64)
            count = np.moveaxis(fin, axis, -1).reshape(-1, c).sum(axis=0).astype(np.int64)
    if hist is not None:
        hist.observe(v, n, scanned, first_sample=first)
    return t, sums, count, bad
