"""MinMax: the exact smallest and largest value seen."""


def compute(hist):
    return float(hist.min), float(hist.max)
