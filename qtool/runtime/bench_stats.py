"""The statistics of `qtool bench`: engines timed in interleaved rounds, their speed ratio with a
bootstrap interval over the rounds, and the rule that calls a ratio a tie.

A round runs the engines in turn, one run each, again and again; the order alternates from round
to round (forward, then reversed), so no engine always runs right after the same other one. Within
a round the engines share the machine's state, so the ratio of their medians in it is a paired
measurement: slow periods of the host move both sides of it. The bootstrap resamples the rounds
(with replacement) and takes the median of the resampled per-round ratios, from a fixed seed:
the same timings always give the same interval. It gives two intervals: the confidence interval of
the median ratio (`ci_lo`, `ci_hi`), and the one printed (`lo`, `hi`), the range in which another
run's ratio falls with 95 % probability (the ratio of two independent resamples' medians): a 95 %
confidence interval holds another run's estimate only about 83 % of the time, since that estimate
has its own noise, and "figures that hold" means another run lands inside what this one printed. A round in which other processes kept a quarter
of a CPU or more busy (the bench measures it from /proc/stat) is left out, as long as at least half
of the rounds remain: one engine of such a round shared its cores and the other may not have.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
# The printed range also holds what the rounds of one run cannot see: what changes between processes
# and over minutes (where the code and the buffers land in memory, which host cores the two vCPUs get,
# what the host's other tenants do). Five consecutive runs on this project's 2-vCPU Zen 3 VM (Lite0 and
# ResNet-50, batch 1 and 8, VM idle, host not; 6448a46) put native's time 34-43 ms on ResNet-50 from
# one run to the next and the ORT int8 ratios' spread (sd) at 1.6-3.6 % between runs where each run's
# own bootstrap range was +-3.5-8.5 %: with the 3 % this constant held before, 13 of 20 ratios fell
# outside another run's range; with 7 %, none (the fp32 ratios, sd 3.4-6.3 % between runs, still 8 of
# 20). This share (at 95 %) is added to the bootstrap's in quadrature.
BETWEEN_RUNS = 0.07
RESAMPLES = 4000
SEED = 0
BUSY_LIMIT = 0.25  # CPUs other processes may keep busy in a round that counts
# `qtool bench` adds rounds while a ratio's range is wider than +-WIDTH (BETWEEN_RUNS included), up to MAX_ROUNDS rounds and
# MAX_SECONDS per batch size (ResNet-50 at batch 8, three engines: about 1.1 s a round here)
WIDTH = 0.10
MAX_ROUNDS = 40
MAX_SECONDS = 90.0


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
    """ratio = median over rounds of other_time / base_time (above 1: `base` is faster); [lo, hi]:
    where another run's ratio falls with probability `level`; [ci_lo, ci_hi]: the confidence
    interval of the median ratio. A tie when [lo, hi] holds 1.0."""
    ratio: float
    lo: float
    hi: float
    level: float
    rounds: int
    ci_lo: float | None = None
    ci_hi: float | None = None

    @property
    def tie(self) -> bool:
        return is_tie(self.lo, self.hi)

    @property
    def half_width(self) -> float:
        """The interval's larger distance from the ratio, as a fraction of it (0.05 = +-5 %)."""
        return max(self.hi / self.ratio - 1.0, 1.0 - self.lo / self.ratio) if self.ratio > 0 else float("inf")

    def as_dict(self) -> dict:
        return {"ratio": self.ratio, "lo": self.lo, "hi": self.hi, "level": self.level, "rounds": self.rounds,
                "ci_lo": self.ci_lo, "ci_hi": self.ci_hi, "half_width": self.half_width, "tie": self.tie}

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
                   seed: int = SEED, between: float = 0.0) -> Ratio:
    """How much faster `base` is than `other` (other's time / base's time) over paired rounds:
    the median of the per-round ratios, where another run's median falls (lo, hi: the spread of
    the ratio of two independent bootstrap medians, around this one) and the percentile bootstrap
    confidence interval of the median (ci_lo, ci_hi). One round gives intervals of zero width
    (nothing to resample): use several. `between` (a fraction, e.g. BETWEEN_RUNS): the spread between
    runs in separate processes, added to (lo, hi)'s relative widths in quadrature."""
    r = paired_ratios(other_ms, base_ms)
    point = float(np.median(r))
    rng = np.random.default_rng(seed)
    meds = np.median(r[rng.integers(0, len(r), size=(2, resamples, len(r)))], axis=2)
    a = (1.0 - level) / 2.0
    ci_lo, ci_hi = np.quantile(meds[0], [a, 1.0 - a])
    d_lo, d_hi = np.quantile(meds[0] / meds[1], [a, 1.0 - a])
    if between:
        d_lo = 1.0 - float(np.hypot(1.0 - d_lo, between))
        d_hi = 1.0 + float(np.hypot(d_hi - 1.0, between))
    return Ratio(point, float(point * d_lo), float(point * d_hi), level, len(r), float(ci_lo), float(ci_hi))
