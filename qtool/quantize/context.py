"""What every step inside `qtool quantize` shares: the graph, the table, the choices made so far.

The steps (method choice, output-aware rounding, range tuning, sensitivity, exclusion, writing)
each read the context and add to it; every experiment among them is `ctx.build(...)` with a few
settings changed, and `ctx.score(...)` runs it on a SampleSet. Weights are quantized once per
layer and setting (`weight_cache`), and the QDQ graph written to disk is built once, at the end.

Experiments are scored with the arithmetic the target promises (the exact int8 result), whatever
CPU qtool runs on: where this machine's ONNX Runtime adds int8 weight pairs in a saturating int16
(qtool/arithmetic.py) and the target's weights are plain int8, the scoring models store the same
weights as uint8 + 128, which ORT computes exactly on every CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import onnx

from qtool.arithmetic import EXACT
from qtool.quantize.encoding import DEFAULT_TARGET, S8, TARGETS
from qtool.quantize.qdq import BuildOptions, QuantizeOutput, quantize_graph


class ReportingCache(dict):
    """A weight cache (node, settings) -> QuantizedWeight that tells `progress(node name)` of each
    layer put in it: rounding every layer by its output error takes a while, and a bar shows it."""

    def __init__(self, progress=None):
        super().__init__()
        self.progress = progress

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if self.progress:
            self.progress(key[0])


def exact_storage_needed(target: str) -> bool:
    """Whether scoring models must store int8 weights as uint8 to get exact sums from this ORT."""
    if TARGETS[target].encoding != S8:
        return False  # pair-safe and uint8 weights are exact on every ORT path
    from qtool.ort_arithmetic import ort_int8_arithmetic
    return ort_int8_arithmetic() != EXACT


@dataclass
class QuantizeContext:
    fused: onnx.ModelProto
    table: object  # calibrate.table.CalibrationTable
    method: str
    target: str = DEFAULT_TARGET
    bias_correction: bool = True
    exclude: dict = field(default_factory=dict)  # node -> reason: kept fp32 by the user
    ranges: dict | None = None  # tensor -> (lo, hi): activation ranges tuned at the output
    hessians: dict | None = None  # node -> input covariance: output-aware weight rounding
    weight_cache: dict = field(default_factory=ReportingCache)
    threads: int = 0
    exact_storage: bool | None = None  # None: decided from the target and this machine's ORT
    on_error: object = None  # (layer, exception): a layer's output-aware rounding failed (qdq.layer_weights)
    encodings: dict = field(default_factory=dict)  # node -> encoding where it is not the target's (encoding.py)
    dynamic: frozenset = frozenset()  # layers whose input is quantized at run time (dynamic.py chooses)
    input_grid: bool = False  # shift a lattice input onto its grid (input_grid.py chooses; off: as calibrated)
    resized: float = 0.0  # the largest share of samples an experiment's int8 output changed the size of
    samples_used: dict = field(default_factory=dict)  # step -> calibration samples it measured on (quantize.json)
    task: str | None = None  # what the output means, where the user said (qtool.tasks): the judges read it
    sizes_used: dict = field(default_factory=dict)  # step -> how many input sizes those samples come in
    experiments: object = None  # where simulated experiments run: None here, else sharded.py

    def record_samples(self, step: str, samples) -> None:
        """Step `step` measured on `samples` (a SampleSet): how many, of how many input sizes (quantize.json)."""
        self.samples_used[step] = len(samples)
        self.sizes_used[step] = samples.n_sizes

    def __post_init__(self):
        if self.target not in TARGETS:
            raise ValueError(f"unknown target {self.target!r}; choose one of {', '.join(TARGETS)}")
        if self.exact_storage is None:
            self.exact_storage = exact_storage_needed(self.target)

    def options(self, exclude: dict | None = None, *, scoring: bool = False, **over) -> BuildOptions:
        """The quantize_graph options of the context's settings; `exclude` adds to the user's exclusions and
        `over` replaces any other option (method, ranges, prune_excluded, ...)."""
        return replace(BuildOptions(
            method=self.method, exclude={**self.exclude, **(exclude or {})}, bias_correction=self.bias_correction,
            ranges=self.ranges, hessians=self.hessians, weight_cache=self.weight_cache, target=self.target,
            u8_storage=scoring and self.exact_storage, on_error=self.on_error, encodings=self.encodings,
            input_grid=self.input_grid, dynamic=self.dynamic), **over)

    def build(self, exclude: dict | None = None, *, scoring: bool = False, **over) -> QuantizeOutput:
        """The QDQ graph with the context's settings (options())."""
        return quantize_graph(self.fused, self.table, self.options(exclude, scoring=scoring, **over))

    @property
    def workers(self) -> int:
        """Experiments run side by side, one ORT thread each (ctx.threads, else the cores, up to 8)."""
        return self.threads or min(os.cpu_count() or 1, 8)

    def score(self, samples, exclude: dict | None = None, threads: int | None = None, **over) -> tuple:
        """(the int8 model's reference output over `samples` (a SampleSet: joined as its reference is),
        the QuantizeOutput it came from); `threads`: ONNX Runtime's for this run (None: the context's)."""
        q = self.build(exclude, scoring=True, **over)
        y, resized = samples.outputs_of(q.model, self.threads if threads is None else threads)
        self.resized = max(self.resized, resized / max(len(samples), 1))
        return y, q
