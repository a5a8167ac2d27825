"""What the steps of one `quantize` run share (the pipeline's one context): the options, the working
directory, the experiments' QuantizeContext, the samples, and what each step found so far."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from qtool.calibrate.table import range_candidates
from qtool.quantize import verify
from qtool.quantize.budget import METHOD_CHOICE_PASSES
from qtool.quantize.context import QuantizeContext
from qtool.quantize.method_choice import texts_judge
from qtool.quantize.optional import OptionalSteps
from qtool.quantize.options import QuantizeOptions
from qtool.quantize.samples import SampleSet
from qtool.quantize.split import SampleSplit, _evenly, choice_files, samples_for_values
from qtool.workdir import Workdir


@dataclass
class Switches:
    """Which of the steps that read calibration samples run: from the options and the model, then the
    budget (steps/budget.py), which may turn a step off."""
    auto: bool  # method choice
    rounding: bool  # output-aware rounding
    tune_ranges: bool
    sensitivity: bool
    exclusion: bool
    branch_exclusion: bool  # --exclude-sensitive goes on into the If branches (the main graph has no int8 layer)


@dataclass
class Tuning:
    """Output-aware weight rounding (rounding.py) and activation ranges (range_search.py)."""
    hessians: dict | None = None
    ranges: dict | None = None
    search: object = None  # RangeSearch
    seconds: float = 0.0
    samples: int = 0
    unrounded: dict = field(default_factory=dict)  # layer -> why output-aware rounding left it to nearest
    check: object = None  # rounding_check.RoundingCheck: the rounding cross-fitted, layer by layer


@dataclass
class QuantizeRun:
    options: QuantizeOptions
    wd: Workdir
    manifest: dict  # (read once)
    inputs: object  # inputs.Inputs
    ctx: QuantizeContext
    steps: OptionalSteps  # times and contains the optional steps
    say: object
    files: list  # the calibration files still there
    on: Switches
    split: SampleSplit
    method: str | None  # the method asked for (METHOD+flat resolved)
    main_int8: bool  # the main graph has an op that can run in int8
    plain: QuantizeContext | None = None  # --verify: the model before method choice and balancing
    afforded: object = None  # steps.budget.Afforded
    labels: dict | None = None  # {file: class} for --exclude-sensitive
    samples: SampleSet = field(default_factory=SampleSet.empty)
    verdicts: dict = field(default_factory=dict)  # step -> verify.Verdict
    method_measures: dict | None = None  # method -> method_choice.Measure, where --method auto measured them
    input_grid: dict | None = None
    encoding_reasons: dict = field(default_factory=dict)
    dynamic: dict | None = None  # the dynamic-input choice per layer, with its figures (steps/dynamic_inputs.py)
    tuning: Tuning = field(default_factory=Tuning)
    sensitivity: dict | None = None
    ranking: list | None = None
    check: SampleSet | None = None  # the exclusion check's samples
    check_held_back: bool = True  # (they were held back from the sensitivity analysis)
    noisy: list | None = None
    partial: list = field(default_factory=list)  # the exclusion search so far, should it fail
    exclusion: object = None
    final_exclude: dict = field(default_factory=dict)
    out: object = None  # the QuantizeOutput written
    branches: list = field(default_factory=list)
    path: str | None = None
    saved: object = None
    cost: dict | None = None
    ort_float: dict | None = None  # layers reported int8 that ONNX Runtime runs in float (steps/ort_graph.py)
    pipeline: tuple = ()  # the steps (pipeline.PIPELINE)
    quantize: object = None  # run.quantize: what the If branches are quantized with (steps/subgraphs.py)
    guarded: dict = field(default_factory=dict)  # layer -> why the guard keeps it fp32
    need: list = field(default_factory=list)  # the calibration files decoded

    @property
    def used(self) -> dict:
        """step -> calibration samples it measured on (quantize.json)."""
        return self.ctx.samples_used

    @property
    def progress(self) -> bool:
        return self.options.progress

    @cached_property
    def held_out(self) -> SampleSet:
        return self.samples.pick(self.split.verify)

    @cached_property
    def tune_samples(self) -> SampleSet:
        return self.samples.pick(self.split.tune)

    @cached_property
    def choice_samples(self) -> SampleSet:
        """The samples --method auto, and the balancing and input-grid choices after it, measure on: method
        choice's few; for a CTC recognizer the tuning samples too. A text is read as fp32 reads it or not, one
        count per sample, and 8 cannot tell models apart that 286 do: PP-OCRv5's recognizer calibrated on
        text-samples crops chose a model that changes 62 of those 286 crops' texts over one that changes 12,
        each reading 7 of the 8 (and 213 against 239 of 255 held-out crops)."""
        auto = self.samples.pick(self.split.auto)
        if texts_judge(self.ctx.fused, auto) is None:
            return auto
        affordable = None
        if self.afforded is not None:  # (the choices' passes per sample are method choice's: a heavy recognizer
            # measures on the samples its budget affords, as --method auto alone did)
            passes = METHOD_CHOICE_PASSES * len(range_candidates(self.inputs.table))
            affordable = self.afforded.budget.samples(passes, len(self.split.auto) + len(self.split.tune))
        return self.samples.pick(choice_files(self.split.auto, self.split.tune, affordable))

    @cached_property
    def sens_samples(self) -> SampleSet:
        sens = self.samples.pick(self.split.sensitivity)
        if self.options.sensitivity.samples is None and len(sens):  # a dynamic output's size is known now
            n = samples_for_values(int(np.prod(sens.reference.shape[1:], dtype=np.int64)))
            sens = sens.pick(_evenly(sens.names, n))
        return sens

    def wanted(self, budgeted: bool = False) -> list:
        """The calibration files the steps on in this run read (`budgeted`: of those the budget counts)."""
        parts = {p for s in self.pipeline if s.budgeted or not budgeted for p in s.samples(self)}
        return self.split.files(parts)

    def verify(self, step: str, fallback: str, **over):
        """The held-out verdict on `step` (verify.verify_step), contained as the verification step; kept in
        self.verdicts. None where it failed."""
        v = self.steps.run("verification", verify.verify_step, self.ctx, self.held_out, step, fallback, self.say,
                           fallback=None, **over)
        if v is not None:
            self.verdicts[v.step] = v
        return v
