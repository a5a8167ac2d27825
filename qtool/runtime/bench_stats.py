"""The statistics of `qtool bench`: engines timed in interleaved rounds, their speed ratio with a
bootstrap interval over the rounds, and the rule that calls a ratio a tie.

A round times every engine once, one block each; the order alternates from round to round
(forward, then reversed), so no engine always runs right after the same other one. Within a
round the engines share the machine's state, so the ratio of their block medians is a paired
measurement: slow periods of the host move both sides of it. The interval resamples the rounds
(with replacement) and takes the median of the resampled per-round ratios, from a fixed seed:
the same timings always give the same interval. A round in which other processes kept a quarter
of a CPU or more busy (the bench measures it from /proc/stat) is left out, as long as at least half
of the rounds remain: one engine of such a round shared its cores and the other may not have.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
RESAMPLES = 4000
SEED = 0
BUSY_LIMIT = 0.25  # CPUs other processes may keep busy in a round that counts


def rounds_to_use(others_cpus, limit: float = BUSY_LIMIT) -> list:
    """Indices of the rounds the figures come from: those in which other processes kept fewer than
    `limit` CPUs busy (None: not measured, counts as quiet), when they are at least half of the
    rounds and at least 3 (or all, when fewer rounds were run); else every round (the machine was
    busy throughout, and the bench says so)."""
    quiet = [i for i, b in enumerate(others_cpus) if b is None or b < limit]
    n = len(others_cpus)
    return quiet if len(quiet) >= max(min(3, n), (n + 1) // 2) else list(range(n))


def round_order(engines, r: int) -> list:
    """The engines' order in round r: as given in even rounds, reversed in odd ones."""
    engines = list(engines)
    return engines if r % 2 == 0 else engines[::-1]


@dataclass
class Ratio:
    """ratio = median over rounds of base_time / other_time (above 1: `base` is faster), with the
    bootstrap interval [lo, hi] at `level`; a tie when the interval holds 1.0."""
    ratio: float
    lo: float
    hi: float
    level: float
    rounds: int

    @property
    def tie(self) -> bool:
        return is_tie(self.lo, self.hi)

    @property
    def half_width(self) -> float:
        """The interval's larger distance from the ratio, as a fraction of it (0.05 = +-5 %)."""
        return max(self.hi / self.ratio - 1.0, 1.0 - self.lo / self.ratio) if self.ratio > 0 else float("inf")

    def as_dict(self) -> dict:
        return {"ratio": self.ratio, "lo": self.lo, "hi": self.hi, "level": self.level, "rounds": self.rounds,
                "half_width": self.half_width, "tie": self.tie}

    def text(self) -> str:
        span = f"95 % {self.lo:.2f}-{self.hi:.2f}" if self.level == LEVEL else \
            f"{100 * self.level:g} % {self.lo:.2f}-{self.hi:.2f}"
        return f"{'tie, ' if self.tie else ''}{self.ratio:.2f}x, {span}"


def is_tie(lo: float, hi: float) -> bool:
    """A ratio whose interval straddles 1.0 says neither engine is faster."""
    return lo <= 1.0 <= hi


def paired_ratios(other_ms, base_ms) -> np.ndarray:
    """Per-round ratios other / base (one value per round for each engine, same rounds)."""
    o, b = np.asarray(other_ms, dtype=np.float64), np.asarray(base_ms, dtype=np.float64)
    if o.shape != b.shape or o.ndim != 1 or len(o) == 0:
        raise ValueError(f"paired_ratios: need one time per round for both engines, got {o.shape} and {b.shape}")
    if (o <= 0).any() or (b <= 0).any():
        raise ValueError("paired_ratios: times must be positive")
    return o / b


def ratio_interval(other_ms, base_ms, level: float = LEVEL, resamples: int = RESAMPLES,
                   seed: int = SEED) -> Ratio:
    """How much faster `base` is than `other` (other's time / base's time) over paired rounds:
    the median of the per-round ratios and its percentile bootstrap interval over the rounds.
    One round gives an interval of zero width (nothing to resample): use several."""
    r = paired_ratios(other_ms, base_ms)
    point = float(np.median(r))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(r), size=(resamples, len(r)))
    meds = np.median(r[idx], axis=1)
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(meds, [a, 1.0 - a])
    return Ratio(point, float(lo), float(hi), level, len(r))
