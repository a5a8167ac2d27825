"""MinMax: the exact smallest and largest value seen."""


def compute(hist):
    if hist.n == 0:
        return 0.0, 0.0
    return float(hist.min), float(hist.max)
