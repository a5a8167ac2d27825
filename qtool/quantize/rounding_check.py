"""Output-aware rounding checked where it was not fitted (cross-fitting), by what the output means.

The rounding of each layer minimises dw^T H dw on the covariance H of the tuning samples (rounding.py):
on those samples it never does worse than nearest rounding, by construction. On others it may: on
PP-OCRv4's recognizer it read 234 held-out crops of 255 where nearest rounding read 237, on PP-OCRv2's
LSTM 69 of 100 against 73 (issue 45). So the tuning samples are cut in two halves; the model is rounded
on the covariances of one half and run on the other, then the halves swap: every tuning sample is judged
once, by a model whose rounding never saw it, against the model with nearest rounding, by verify.py's
figures (texts after greedy CTC for a recognizer, top-1 for a classifier, an encoder's pooled vectors,
cosine, else SQNR). Each half is judged by itself (its samples in the order its output holds them, an
encoder's mask with them) and the per-sample figures are added up.

The burden is on showing harm: the fitted rounding is the long-measured default, and on 8-32 samples a
real gain seldom shows beyond the noise (as a keep-only-if-better rule, --verify took orinet 32.8 -> 27.4
dB). So nearest rounding replaces it only where it measures better by HARM_SIGNIFICANCE standard errors
(verify.decide with the roles swapped); where kept, the rounding is fitted on all the tuning samples as
before, and the model is the one the unchecked rounding wrote, byte for byte.

Tried and not kept: judging also on up to 256 calibration samples no step fits on, run by the model rounded
on every tuning sample, nearest replacing the fitted rounding beyond one standard deviation of the count.
The differences it had to find are a few crops in a hundred, and the calibration samples disagreed with the
held-out ones on two recognizers of three: PP-OCRv4's (148 judged: nearest read 142, fitted 139; held out,
237 against 234: agreed), the captcha CRNN (29: nearest 29, fitted 27; held out, 47 of 49 against 48) and
PP-OCRv2's LSTM (32: nearest 21, fitted 22; held out, 73 of 100 against 69). Each rule moved as many
models the wrong way as the right one. Also tried first: the same halves judged layer by layer (each
layer's dw^T H_B dw, the rounding fitted on H_A against nearest's): on PP-OCRv4's recognizer every one of
41 layers measured better with the fitted rounding on the half it did not see (0.18-0.84 of nearest's
error), and the model still read fewer crops. Each layer's own error does not tell what the errors do
together.
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
# standard errors (or a count's standard deviations) by which nearest rounding must measure better to replace
# the fitted rounding: the conventional two, a one-sided false alarm of about 2 % per model where the two
# roundings are in truth alike. One (verify.py's bar for keeping a step) would overturn the long-measured
# default by chance alone on about one model in six
HARM_SIGNIFICANCE = 2.0


@dataclass
class RoundingCheck:
    """What the cross-fitted check found: the verdict (verify.Verdict) of nearest rounding against the
    rounding fitted on the other half, over every tuning sample; None where not judged (and why)."""
    samples: int
    verdict: object = None  # verify.Verdict on STEP: kept = nearest rounding measured better
    why_not: str = ""

    @property
    def nearest(self) -> bool:
        return self.verdict is not None and self.verdict.kept

    def line(self) -> str:
        if self.verdict is None:
            return f"output-aware rounding not cross-checked: {self.why_not}"
        v = self.verdict
        fig = (f"{v.read_without}/{v.samples} read as fp32 with the fitted rounding, {v.read_with}/{v.samples} with "
               f"nearest; " if v.read_with is not None else "")
        what = (f"nearest rounding instead ({v.margin:.1f} standard errors better)" if v.kept else
                f"kept (nearest {v.margin:+.1f} standard errors, {HARM_SIGNIFICANCE:g} needed to replace it)")
        return (f"verified output-aware rounding on {v.samples} tuning samples, each by a model rounded on the "
                f"other half, by {v.judge} against nearest rounding ({fig}error {v.error_without:.4g} fitted, "
                f"{v.error_with:.4g} nearest): {what}")

    def to_dict(self) -> dict:
        decision = "nearest" if self.nearest else "kept" if self.verdict is not None else "unchecked"
        d = {"samples": self.samples, "halves": HALVES, "significance": HARM_SIGNIFICANCE, "decision": decision,
             "why_not": self.why_not or None}
        if self.verdict is not None:
            d["verdict"] = self.verdict.to_dict()
            d["verdict"]["note"] = ("'with' is nearest rounding, 'without' the rounding fitted on the other half; "
                                    f"kept: nearest measured better by {HARM_SIGNIFICANCE:g} standard errors (margin)")
        return d


def halves(n: int) -> list:
    """Sample indices of each half: every other sample (the tuning samples are evenly spaced already)."""
    return [list(range(k, n, HALVES)) for k in range(HALVES)]


def check_rounding(ctx, samples, progress=None) -> RoundingCheck:
    """Cross-fit output-aware rounding at ctx's ranges on `samples` (a SampleSet): each half run by the model
    rounded on the other half's covariances (a weight cache of its own: the context's keys a layer by
    whether it has a covariance, not by which), against nearest rounding, by verify.judge_of."""
    check = RoundingCheck(len(samples))
    parts = [samples.subset(idx) for idx in halves(len(samples))]
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
    # each half judged by itself (a subset keeps each input size together: its own order and mask), the
    # per-sample figures added up
    judges = [judge_of(ctx.fused, p, ctx.task) for p in parts]
    if len({j.kind for j in judges}) > 1:
        check.why_not = f"the halves are judged differently ({', '.join(sorted({j.kind for j in judges}))})"
        return check
    with_ = without = None
    for judge, p, y_near, y_fit in zip(judges, parts, near, fitted):
        a, b = Figures.of(judge, p.reference, y_near), Figures.of(judge, p.reference, y_fit)
        with_, without = (a, b) if with_ is None else (with_ + a, without + b)
    check.verdict = decide(STEP, judges[0].kind, with_, without, "output-aware rounding", HARM_SIGNIFICANCE)
    return check
