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
# Not a method of its own: `quantize` measures each method's int8 output against fp32 on calibration
# samples and takes the best (quantize/method_choice.py). The default: which method clips best differs
# from model to model (a detector's heads lose 4 dB to minmax, an OCR classifier 3 dB to mse).
AUTO = "auto"
DEFAULT_METHOD = AUTO
FALLBACK = "minmax"  # the ranges an `auto` table answers with before quantize has chosen
