"""Output-aware rounding checked where it was not fitted, by what the output means.

The rounding of each layer minimises dw^T H dw on the covariance H of the tuning samples (rounding.py):
on those samples it never does worse than nearest rounding, by construction. On others it may: on
PP-OCRv4's recognizer it read 234 held-out crops of 255 where nearest rounding read 237, on PP-OCRv2's
LSTM 69 of 100 against 73 (issue 45). So it is judged against nearest rounding, by verify.py's figures
(texts after greedy CTC for a recognizer, top-1 for a classifier, an encoder's vectors, cosine, else SQNR),
on samples no rounding saw:
- the tuning samples, cut in two halves: the model is rounded on the covariances of one half and run on
  the other, then the halves swap;
- other calibration samples no step fits on (split.check, as many as the budget affords, up to 256), run by
  the model rounded on every tuning sample, the one quantize writes.

The two roundings are read by what the output means first: where nearest rounding reads (or classifies)
more samples as fp32 does beyond COUNT_SIGNIFICANCE standard deviations of the sign test, it replaces the
fitted one: that figure is the one a user sees. A continuous figure (the error on the top-1 gap, 1 - cosine,
squared error) is only a proxy of it: there nearest rounding must be better by HARM_SIGNIFICANCE standard
errors to overturn the long-measured default (as a keep-only-if-better rule on that proxy, --verify took
orinet 32.8 -> 27.4 dB). Where kept, the model is the one the unchecked rounding wrote, byte for byte.
Measured: on PP-OCRv4's 286 calibration crops nearest rounding alone read 8, the fitted one alone 4, where the
30 tuning samples' halves had shown 28 against 27.

Tried first, and not kept: the same halves judged layer by layer (each layer's dw^T H_B dw, the rounding
fitted on H_A against nearest's): on PP-OCRv4's recognizer every one of 41 layers measured better with
the fitted rounding on the half it did not see (0.18-0.84 of nearest's error), and the model still read
fewer crops. Each layer's own error does not tell what the errors do together.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool.quantize.context import ReportingCache
from qtool.quantize.rounding import layer_hessians
from qtool.quantize.verify import Figures, decide, judge_of

HALVES = 2  # folds of the tuning samples: fitted on one, judged on the other
MIN_HALF = 4  # samples in each half, at least: fewer tuning samples leave the rounding unchecked
STEP = "nearest rounding"  # the alternative judged: kept only where it measures better beyond the noise
# standard errors of the continuous figure by which nearest rounding must measure better to replace the
# fitted rounding: the conventional two, a one-sided false alarm of about 2 % per model where the two
# roundings are in truth alike. One would overturn the long-measured default on a proxy by chance alone on
# about one model in six
HARM_SIGNIFICANCE = 2.0
# standard deviations of the sign test by which nearest rounding must read more samples as fp32 does: verify.py's
# bar for every step, on the figure that means something
COUNT_SIGNIFICANCE = 1.0


@dataclass
class RoundingCheck:
    """What the check found: the verdict (verify.Verdict) of nearest rounding against the fitted rounding, over
    every tuning sample (each by the rounding fitted on the other half) and the check samples; None where not
    judged (and why)."""
    samples: int  # judged in all
    verdict: object = None  # verify.Verdict on STEP: kept = nearest rounding measured better
    why_not: str = ""
    halves: int = 0  # of them, tuning samples judged by the other half's rounding

    @property
    def nearest(self) -> bool:
        return self.verdict is not None and self.verdict.kept

    def line(self) -> str:
        if self.verdict is None:
            return f"output-aware rounding not cross-checked: {self.why_not}"
        v = self.verdict
        fig = (f"{v.read_without}/{v.samples} read as fp32 with the fitted rounding, {v.read_with}/{v.samples} with "
               f"nearest; " if v.read_with is not None else "")
        unit = "standard deviations of the count" if v.decided_by == "count" else "standard errors"
        need = COUNT_SIGNIFICANCE if v.decided_by == "count" else HARM_SIGNIFICANCE
        what = (f"nearest rounding instead ({v.margin:.1f} {unit} better)" if v.kept else
                f"kept (nearest {v.margin:+.1f} {unit}, {need:g} needed to replace it)")
        where = (f"{self.halves} tuning samples, each by a model rounded on the other half"
                 + (f", and {v.samples - self.halves} others" if v.samples > self.halves else ""))
        return (f"verified output-aware rounding on {where}, by {v.judge} against nearest rounding ({fig}error "
                f"{v.error_without:.4g} fitted, {v.error_with:.4g} nearest): {what}")

    def to_dict(self) -> dict:
        decision = "nearest" if self.nearest else "kept" if self.verdict is not None else "unchecked"
        d = {"samples": self.samples, "tuning_samples_by_halves": self.halves, "halves": HALVES,
             "significance": HARM_SIGNIFICANCE, "count_significance": COUNT_SIGNIFICANCE, "decision": decision,
             "why_not": self.why_not or None}
        if self.verdict is not None:
            d["verdict"] = self.verdict.to_dict()
            d["verdict"]["note"] = ("'with' is nearest rounding, 'without' the fitted rounding (on the other half, or "
                                    "on every tuning sample for the others); kept: nearest read more beyond "
                                    f"{COUNT_SIGNIFICANCE:g} standard deviations of the count, or measured better by "
                                    f"{HARM_SIGNIFICANCE:g} standard errors (margin)")
        return d


def halves(n: int) -> list:
    """Sample indices of each half: every other sample (the tuning samples are evenly spaced already)."""
    return [list(range(k, n, HALVES)) for k in range(HALVES)]


def check_rounding(ctx, samples, extra=None, progress=None) -> RoundingCheck:
    """Cross-fit output-aware rounding at ctx's ranges on `samples` (a SampleSet): each half run by the model
    rounded on the other half's covariances (a weight cache of its own: the context's keys a layer by
    whether it has a covariance, not by which), against nearest rounding, by verify.judge_of. `extra`:
    samples no step fitted on, run by ctx's model as rounded on all of `samples` (ctx.hessians) against
    nearest rounding; judged with the halves."""
    check = RoundingCheck(len(samples))
    order = halves(len(samples))
    parts = [samples.subset(idx) for idx in order]
    if min(len(p) for p in parts) < MIN_HALF:
        check.why_not = f"{len(samples)} tuning samples, fewer than {MIN_HALF} in each half"
        return check
    fitted = []
    for k in range(HALVES):
        h = layer_hessians(ctx.fused, parts[1 - k], progress=progress)
        if not h:
            check.why_not = "no layer had a covariance on half of the tuning samples"
            return check
        fitted.append(ctx.score(parts[k], hessians=h, weight_cache=ReportingCache(),
                                on_error=lambda layer, e: None)[0])  # (that layer: nearest, here)
        del h
    near = [ctx.score(p, hessians=None)[0] for p in parts]
    judged = [(p, y_near, y_fit) for p, y_near, y_fit in zip(parts, near, fitted)]
    if extra is not None and len(extra) and ctx.hessians:
        judged.append((extra, ctx.score(extra, hessians=None)[0], ctx.score(extra)[0]))
    # each set judged by itself (its samples in the order its outputs hold them, an encoder's mask with them),
    # the per-sample figures added up
    judges = [judge_of(ctx.fused, p, ctx.task) for p, _, _ in judged]
    if len({j.kind for j in judges}) > 1:
        check.why_not = f"the samples are judged differently ({', '.join(sorted({j.kind for j in judges}))})"
        return check
    with_ = without = None
    for judge, (p, y_near, y_fit) in zip(judges, judged):
        a, b = Figures.of(judge, p.reference, y_near), Figures.of(judge, p.reference, y_fit)
        with_, without = (a, b) if with_ is None else (with_ + a, without + b)
    check.halves, check.samples = sum(len(p) for p in parts), len(with_)
    check.verdict = decide(STEP, judges[0].kind, with_, without, "output-aware rounding", HARM_SIGNIFICANCE,
                           count_significance=COUNT_SIGNIFICANCE)
    return check
