"""Percentile: clip the rarest tails, keeping PERCENTILE % of the values on each side."""
import numpy as np

PERCENTILE = 99.999


def compute(hist, percentile: float = PERCENTILE):
    c = np.cumsum(hist.counts)
    n = c[-1]
    if n == 0:
        return 0.0, 0.0
    edges = hist.edges()
    q = percentile / 100.0
    i_hi = int(np.searchsorted(c, q * n, side="left"))
    i_lo = int(np.searchsorted(c, (1 - q) * n, side="right"))
    hi = min(float(edges[i_hi + 1]), hist.max)
    lo = max(float(edges[i_lo]), hist.min)
    return (lo if hist.min < 0 else hist.min), (hi if hist.max > 0 else hist.max)
