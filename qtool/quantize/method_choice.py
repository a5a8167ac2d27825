"""Choosing a range method by measurement: the int8 output each method gives, against fp32.

Meant for calibration samples, so the choice never looks at evaluation data. Where the output is a
distribution over its last axis (a Softmax there: a classifier's probabilities, a CTC recognizer's
or a tagger's per position), what it means is the class it picks: methods are ranked by how often
each position keeps fp32's class (predicted, so a few samples still rank them), and SQNR decides
among those within AGREEMENT_TIE of the best. SQNR on probabilities misleads there: on PP-OCRv5's
recognizer it ranked minmax last of four on calibration crops, where minmax read the most words.
"""
from __future__ import annotations

from qtool.calibrate.methods import METHODS
from qtool.calibrate.table import range_candidates
from qtool.metrics import position_agreement, sqnr_db
from qtool.quantize.context import QuantizeContext
from qtool.quantize.progress import bar
from qtool.quantize.samples import SampleSet, distribution_output

AGREEMENT_TIE = 0.0005  # predicted agreement (per position) within this of the best: a tie, SQNR decides
# An output SQNR above this is float32 arithmetic's own noise (ORT's kernels against the fp32 graph), not
# the int8 grid's: on such samples every range gives the same output and nothing can be earned by a clip.
# oww-hey-jarvis's calibration clips (saturated sigmoid scores) gave 117.4 dB for minmax and 118.6 for mse;
# mse chosen on that read 71.6 dB on the evaluation clips, minmax 72.0.
EXACT_DB = 90.0


def method_scores(ctx: QuantizeContext, samples: SampleSet, methods=None, progress=None, agreement: dict | None = None
                  ) -> dict:
    """Output SQNR (dB, first output, over `samples`) of the int8 model each range method gives,
    against the fused fp32 graph ("pick what measures best", per model); `progress(1)` after each.
    `agreement` (a dict) gets each method's position_agreement where the output is a distribution."""
    scores = {}
    classes = distribution_output(ctx.fused, samples)
    for m in methods or METHODS:
        y = ctx.score(samples, method=m, ranges=None)[0]
        scores[m] = sqnr_db(samples.reference, y)
        if classes and agreement is not None:
            agreement[m] = position_agreement(samples.reference, y)
        if progress:
            progress(1)
    return scores


def choose(scores: dict, agreement: dict, plain: str, clip_gain_db: float) -> str:
    """The method to use: the best SQNR among those tied on agreement (all where it was not measured),
    but the unclipped `plain` method unless a clipping one beats it by clip_gain_db."""
    names = list(scores)
    tied = [names[i] for i in _tied([agreement.get(m) if agreement else None for m in names])]
    best = max(tied, key=scores.get)
    plain = plain if plain in tied else best
    if scores[plain] >= EXACT_DB:
        return plain
    # (a clipping method must earn its clip: within noise, the unclipped ranges hold better on data unlike
    # the calibration's: FSMN-VAD's streaming chunks, mse 0.3 dB ahead on 8 calibration samples, 3.5 dB
    # behind minmax on the evaluation ones)
    return plain if scores[best] < scores[plain] + clip_gain_db else best


def best_option(options: list) -> int:
    """The index of the best of (SQNR dB, agreement or None) pairs: by agreement where every one has
    it (within AGREEMENT_TIE: a tie), then by SQNR."""
    return max(_tied([a for _, a in options]), key=lambda i: options[i][0])


def _tied(agreements: list) -> list:
    """Indices within AGREEMENT_TIE of the best agreement, where every one was measured (else all)."""
    if not agreements or any(a is None for a in agreements):
        return list(range(len(agreements)))
    top = max(agreements)
    return [i for i, a in enumerate(agreements) if a >= top - AGREEMENT_TIE]


def pick_method(ctx: QuantizeContext, samples: SampleSet, say=print, show_progress: bool = True):
    """The range method whose int8 model measures best on a few calibration samples (never the
    evaluation data): (method, {method: dB}, {method: agreement} or None)."""
    if not len(samples):
        say(f"note: --method auto has no calibration sample to compare the methods on (none recorded, or none of its "
            f"samples among those quantize could run together: see the warnings above); using {ctx.table.range_method}")
        return ctx.table.range_method, None, None
    candidates = range_candidates(ctx.table)
    agreement = {}
    with bar(len(candidates), "method", "method choice", show_progress) as pb:
        scores = method_scores(ctx, samples, candidates, progress=pb.update, agreement=agreement)
    best = choose(scores, agreement, ctx.table.range_method, CLIP_GAIN_DB)
    if len(samples) < MIN_CHOICE_SAMPLES and best != ctx.table.range_method:
        say(f"note: {best} measured best on only {len(samples)} calibration sample{'s' if len(samples) > 1 else ''}; "
            f"too few to trust a clip measured on the samples that set it: "
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
