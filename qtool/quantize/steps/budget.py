"""The calibration samples each step can afford (budget.py): the work of one fp32 pass counted at the
first sample's shapes; a heavy model gets fewer samples per step, or a step skipped, and one note."""
from __future__ import annotations

from dataclasses import dataclass, field

from qtool.calibrate.table import range_candidates
from qtool.quantize.budget import (METHOD_CHOICE_PASSES, ROUNDING_PASSES, SENSITIVITY_PASSES, TARGET_COST_PASSES,
                                  Budget)
from qtool.quantize.rounding import fetch_groups, rounding_layers
from qtool.quantize.samples import load_samples
from qtool.quantize.sensitivity import quantizable_layers
from qtool.quantize.split import MIN_VERIFY_SAMPLES, SampleSplit, _evenly, sensitivity_samples
from qtool.quantize.step import Step

MIN_BUDGET_TUNE_SAMPLES = 4  # covariances on fewer are mostly their diagonal: nearest rounding instead
# fp32 passes per held-out sample verification takes: the model with and without a step, for about three steps
VERIFY_PASSES = 6.0


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


def afford(run, need: list) -> Afforded | None:
    """Count the work of one fp32 pass at the first needed sample's shapes and give each optional step the
    samples it can afford (budget.py); None where no sample could be read. A number of sensitivity samples
    the user chose is kept; --verify's held-out samples are budgeted too."""
    fused, table, split, on, verify = run.inputs.fused, run.inputs.table, run.split, run.on, run.options.verify
    auto, rounding, sensitivity = on.auto, on.rounding, on.sensitivity
    probe = load_samples(fused, table, need[:1])
    if not len(probe):
        return None
    b = Budget.of(fused, probe)
    n_auto = b.samples(METHOD_CHOICE_PASSES * len(range_candidates(table)), len(split.auto), 1) if auto else len(split.auto)
    n_sens, per_sens = len(split.sensitivity), SENSITIVITY_PASSES * len(quantizable_layers(fused))
    if sensitivity and run.options.sensitivity.samples is None:
        n_sens = b.samples(per_sens, n_sens, 1)
    n_tune, per_tune = len(split.tune), TARGET_COST_PASSES
    if rounding:
        names = sorted({x for x, _, _ in rounding_layers(fused)[0].values()})
        per_tune += ROUNDING_PASSES * (len(fetch_groups(fused, names, probe.widest())) if names else 0)
        n_tune = b.samples(per_tune, n_tune, MIN_BUDGET_TUNE_SAMPLES)
    n_verify = b.samples(VERIFY_PASSES, len(split.verify), MIN_VERIFY_SAMPLES) \
        if verify and split.verify and (auto or rounding) else len(split.verify)
    if (n_auto, n_sens, n_tune, n_verify) == (len(split.auto), len(split.sensitivity), len(split.tune),
                                              len(split.verify)):
        return Afforded(split, auto, rounding, sensitivity, b, fp32_seconds_per_sample=probe.seconds_per_sample)
    sens_wanted = run.options.sensitivity.samples or sensitivity_samples(fused)
    new = SampleSplit.of(run.files, n_sens if n_sens < len(split.sensitivity) else sens_wanted,
                         n_tune if rounding else None, n_auto if auto else None, verify=verify)
    new.verify = _evenly(new.verify, n_verify)
    notes = []
    for step, wanted, old, now, passes, least in (
            ("method choice", auto, split.auto, new.auto, METHOD_CHOICE_PASSES * len(range_candidates(table)), 1),
            ("sensitivity", sensitivity, split.sensitivity, new.sensitivity, per_sens, 1),
            ("output-aware rounding", rounding, split.tune, new.tune, per_tune, MIN_BUDGET_TUNE_SAMPLES),
            ("verification", verify and (auto or rounding), split.verify, new.verify, VERIFY_PASSES, MIN_VERIFY_SAMPLES)):
        if wanted and len(now) < len(old):
            notes.append(f"{step} on {len(now)} of {len(old)} samples" if now else
                         f"{step} skipped (about {b.seconds(passes, least):.0f} s for {least} sample"
                         f"{'s' if least > 1 else ''})")
    run.say(f"note: one fp32 pass counted at {b.macs_per_sample / 1e9:.1f} GMAC per sample (taken as "
            f"{b.seconds_per_sample:.2f} s): " + "; ".join(notes))
    return Afforded(new, auto and n_auto > 0, rounding and n_tune > 0, sensitivity and n_sens > 0, b, notes,
                    probe.seconds_per_sample)


def when(run) -> bool:
    """a step the budget counts reads calibration samples"""
    return bool(run.wanted(budgeted=True))


def apply(run) -> None:
    run.afforded = afford(run, run.wanted(budgeted=True))
    if run.afforded is not None:
        a, on = run.afforded, run.on
        run.split, on.auto, on.rounding, on.sensitivity = a.split, a.auto, a.rounding, a.sensitivity
        on.exclusion = on.exclusion and on.sensitivity


STEP = Step("calibration samples", apply, when, fallback="no calibration samples: the steps below skipped")
