"""Model inputs whose values sit on a lattice: quantized so that every lattice point is exact.

An image normalised from 8-bit pixels takes at most 256 values, a + k d. A uint8 quantizer with
scale d reproduces them exactly when the lattice's offset is a whole number of steps from zero; the
range a calibration method picks rarely has that scale, and for the common [-1, 1] normalisations,
(p / 255 - 0.5) / 0.5 (PaddleOCR) and p / 127.5 - 1 (TensorFlow's "tf" mode), no integer zero point
can: the points are the odd multiples of 1/255, half a step off any uint8 grid of scale 2/255, so
every pixel is quantized at the worst error there is (measured: PP-OCRv5's recognizer, int8 output
15.2 dB from fp32). Adding a constant shift before the quantizer puts the points on the grid (15.9
dB), and the layers that read the input take the shift back out of their bias, exactly but at
zero-padded borders (where the padding reads as -shift, at most half a step).

Off-lattice values (a crop right-padded with 0.0 after normalisation) are allowed while they are a
few of the distinct values: they are quantized to within half a step, as by any quantizer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_DISTINCT = 4096  # more distinct values than this: not an 8-bit lattice, stop looking
MIN_DISTINCT = 16  # fewer: too little to tell a lattice from chance
ON_LATTICE = 0.9  # at least this share of the distinct values on it
TOL = 1e-3  # of a step: float32 normalisation leaves ~1e-5
LEVELS = 255  # uint8 steps


@dataclass
class Lattice:
    spacing: float  # d
    offset: float  # a mod d, in [0, d)
    lo: float  # the lowest and highest lattice point seen
    hi: float
    off: int = 0  # distinct values seen off the lattice

    @property
    def steps(self) -> int:
        return int(round((self.hi - self.lo) / self.spacing))

    @property
    def shift(self) -> float:
        """What to add so that every point is a whole number of steps from zero: 0, or the nearer
        of -offset and spacing - offset."""
        f = self.offset / self.spacing
        if min(f, 1 - f) < TOL:
            return 0.0
        return -self.offset if f <= 0.5 else self.spacing - self.offset

    def to_dict(self) -> dict:
        return {"spacing": self.spacing, "offset": self.offset, "lo": self.lo, "hi": self.hi, "off": self.off}

    @classmethod
    def from_dict(cls, d) -> "Lattice | None":
        """The lattice a table records, or None for anything else (not a dict, a missing or non-finite field)."""
        try:
            lat = cls(float(d["spacing"]), float(d["offset"]), float(d["lo"]), float(d["hi"]), int(d.get("off", 0)))
        except (KeyError, TypeError, ValueError):
            return None
        ok = all(np.isfinite([lat.spacing, lat.offset, lat.lo, lat.hi])) and lat.spacing > 0 and lat.lo <= lat.hi
        return lat if ok else None


def find_lattice(values: np.ndarray) -> Lattice | None:
    """The lattice most of these sorted distinct values lie on, if it spans at most 255 steps."""
    v = np.asarray(values, np.float64)
    if v.size < MIN_DISTINCT:
        return None
    gaps = np.diff(v)
    d = float(np.median(gaps))  # an off-lattice value splits one gap; most gaps are one step
    if not d > 0:
        return None
    k = v / d
    frac = k - np.floor(k)
    # the offset most points share: the median of their fractions, taken around the circle from the
    # first point's so that fractions near 0 and near 1 (the same offset) do not split
    ref = frac[0]
    rel = (frac - ref + 0.5) % 1.0 - 0.5
    f = (ref + float(np.median(rel))) % 1.0
    err = np.abs((frac - f + 0.5) % 1.0 - 0.5)
    on = err < TOL
    if on.sum() < ON_LATTICE * v.size:
        return None
    pts = v[on]
    lat = Lattice(d, float(f * d), float(pts.min()), float(pts.max()), int((~on).sum()))
    return lat if lat.steps <= LEVELS else None


def lattice_qparams(lat: Lattice, lo: float, hi: float):
    """(scale, zero point, shift) that quantize every lattice point exactly after adding `shift`, with
    the calibrated range [lo, hi] (to within half a step: its ends are rounded into the grid, as
    rounding would) and 0 inside the grid; None where no uint8 grid holds them."""
    s = lat.shift
    d = lat.spacing
    j_lo = min(int(round((lat.lo + s) / d)), math.ceil((lo + s) / d - 0.5), 0)  # (0 representable: padding)
    j_hi = max(int(round((lat.hi + s) / d)), math.floor((hi + s) / d + 0.5), 0)
    if j_hi - j_lo > LEVELS:
        return None
    z_min, z_max = -j_lo, LEVELS - j_hi  # every point inside [0, 255]
    zp = min(max(-j_lo + (LEVELS - (j_hi - j_lo)) // 2, z_min), z_max)
    return float(np.float32(d)), int(zp), float(np.float32(s))
