"""The distinct values of a float model input over the calibration samples, while they are few: what
qtool.lattice.find_lattice reads to tell an input on an 8-bit lattice (an image normalised from pixels).

Calibrate's main thread sees every batch once, so the set is kept as a hash set of bit patterns (the
native `distinct`, one probe per value; numpy's sort of a batch of four ImageNet images took 9-16 ms),
and read as floats, where +0 and -0 are one value: the same set as np.unique over every batch."""
from __future__ import annotations

import numpy as np

from qtool.lattice import MAX_DISTINCT, Lattice, find_lattice

try:  # the hash set in C (src/histogram.c); numpy's unique below is the reference and the fallback
    from qtool.calibrate import _histogram as _native
except ImportError:  # pragma: no cover - exercised when the extension is not built
    _native = None

SLOTS = 1 << 14  # the hash set's slots: past MAX_DISTINCT + 1 patterns it gives up, at a quarter full


class DistinctValues:
    """The distinct values of one float input over the calibration samples, while they are few."""

    def __init__(self, native: bool | None = None):
        self.given_up = False
        self._native = _native is not None if native is None else native
        self._table = np.full(SLOTS, 0xFFFFFFFF, np.uint32) if self._native else None
        self._values = np.zeros(0, np.float64)

    @property
    def values(self) -> np.ndarray:
        """The distinct values seen, float64, sorted."""
        if self._table is not None:
            bits = self._table[self._table != 0xFFFFFFFF]
            return np.unique(bits.view(np.float32)).astype(np.float64)  # (+0 and -0: one value)
        return self._values

    def add(self, x: np.ndarray) -> None:
        if self.given_up:
            return
        x = np.asarray(x)
        if x.dtype.kind != "f":
            self.given_up = True
            return
        flat = np.ascontiguousarray(x).reshape(-1)
        if self._table is not None and flat.dtype == np.float32:
            # (+1: +0 and -0 are two patterns of one value; the float count is checked below)
            got = _native.distinct(flat, self._table, MAX_DISTINCT + 1)
            self.given_up = got < 0 or (got > MAX_DISTINCT and self.values.size > MAX_DISTINCT)
            return
        if self._table is not None:  # another float type: the patterns so far join the numpy set
            self._values, self._table = self.values, None
        u = np.unique(flat)
        if u.size > MAX_DISTINCT or not np.all(np.isfinite(u)):
            self.given_up = True
            return
        self._values = np.union1d(self._values, u.astype(np.float64))
        if self._values.size > MAX_DISTINCT:
            self.given_up = True

    def merge(self, other: "DistinctValues") -> None:
        """Add the values another share of the samples held (a shard's, sharded.py): the same set as
        if this one had seen them."""
        if other.given_up:
            self.given_up = True
        elif not self.given_up and other.values.size:
            self.add(other.values.astype(np.float32) if other._table is not None else other.values)

    def lattice(self) -> Lattice | None:
        return None if self.given_up else find_lattice(self.values)
