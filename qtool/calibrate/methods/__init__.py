"""Calibration methods: each turns one streaming Histogram into an activation range (lo, hi).

A method is one small module with `compute(hist) -> (lo, hi)`; METHODS maps the name the
CLI takes (`--method`) to it. All of them read the same accumulator, so one calibration
pass answers for every method.
"""
from qtool.calibrate.methods import entropy, minmax, mse, percentile

METHODS = {
    "minmax": minmax.compute,
    "percentile": percentile.compute,
    "entropy": entropy.compute,
    "mse": mse.compute,
}
