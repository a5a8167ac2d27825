"""The calibration table: what `calibrate` hands to `quantize`, as one JSON file.

It names the model it was made for (sha256 of the original file and of the fused graph),
the preprocessing, the chosen method and, per observed tensor, the range every method
gives plus the histogram itself, so `quantize --method X` can change its mind later
without another pass over the images.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from qtool.calibrate.histogram import Histogram
from qtool.calibrate.methods import METHODS
from qtool.errors import QtoolError
from qtool.modelio import atomic_write_text

FORMAT = "qtool-calibration/1"


@dataclass
class CalibrationTable:
    model_path: str
    model_sha256: str
    fused_sha256: str
    method: str
    n_samples: int
    skipped: list = field(default_factory=list)
    config: dict = field(default_factory=dict)
    ranges: dict = field(default_factory=dict)  # method -> tensor -> [lo, hi]
    channel_means: dict = field(default_factory=dict)  # tensor -> [C] mean of the fp32 activation
    histograms: dict = field(default_factory=dict)  # tensor -> Histogram.to_dict()
    input_name: str = ""

    def range(self, tensor: str, method: str | None = None):
        return self.ranges[method or self.method].get(tensor)

    def histogram(self, tensor: str) -> Histogram:
        return Histogram.from_dict(self.histograms[tensor])

    def save(self, path: str) -> None:
        # shallow: asdict() would deep-copy every histogram's counts first
        d = {"format": FORMAT, **{f.name: getattr(self, f.name) for f in fields(self)}}
        atomic_write_text(path, json.dumps(d))


def ranges_for_all_methods(histograms: dict) -> dict:
    return {m: {t: list(fn(h)) for t, h in histograms.items()} for m, fn in METHODS.items()}


def load_table(path: str) -> CalibrationTable:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise QtoolError(f"{path}: no calibration table (run `qtool calibrate` first)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QtoolError(f"{path}: not a qtool calibration table ({e.__class__.__name__})") from None
    if not isinstance(d, dict) or d.pop("format", None) != FORMAT:
        raise QtoolError(f"{path}: not a qtool calibration table (format {FORMAT} expected)")
    try:
        return CalibrationTable(**d)
    except TypeError as e:
        raise QtoolError(f"{path}: calibration table is missing fields ({e})") from None
