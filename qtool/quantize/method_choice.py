"""Choosing a range method by measurement: the int8 output each method gives, against fp32.

Meant for calibration samples, so the choice never looks at evaluation data. Where the output is a
distribution over its last axis (a Softmax there: a classifier's probabilities, a CTC recognizer's
or a tagger's per position), what it means is the class it picks: methods are ranked by how often
each position keeps fp32's class (predicted, so a few samples still rank them), and SQNR decides
among those within AGREEMENT_TIE of the best. SQNR on probabilities misleads there: on PP-OCRv5's
recognizer it ranked minmax last of four on calibration crops, where minmax read the most words.
A CTC recognizer (verify.judge_for) is judged first by its texts, as eval reads it (issue 45): a
method whose samples read as fp32 reads them fall short of the best's by more than TEXTS_SIGNIFICANCE
standard deviations of that count (verify.count_gain) is out of the running; per position, with nearly
every position a blank, a model may agree at 0.99 while most of its texts change.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool.calibrate.methods import METHODS
from qtool.calibrate.table import range_candidates
from qtool.metrics import position_agreement, sqnr_db
from qtool.quantize.context import QuantizeContext
from qtool.quantize.progress import bar
from qtool.quantize.samples import SampleSet, distribution_output
from qtool.quantize.verify import TEXTS, Judge, count_gain, judge_for

AGREEMENT_TIE = 0.0005  # predicted agreement (per position) within this of the best: a tie, SQNR decides
# standard deviations of the sign test by which a recognizer's method must read fewer texts than the best's to be
# out: on 8 samples, 5 of 8 against 0 (PP-OCRv2's LSTM: entropy and mse read none). At one standard deviation,
# PP-OCRv5's recognizer on text-samples crops dropped minmax on 5 of 8 against entropy's 8 and, through the
# balancing choices that follow, read 201 of 255 held-out crops where the model chosen as before reads 213
TEXTS_SIGNIFICANCE = 2.0
# An output SQNR above this is float32 arithmetic's own noise (ORT's kernels against the fp32 graph), not
# the int8 grid's: on such samples every range gives the same output and nothing can be earned by a clip.
# oww-hey-jarvis's calibration clips (saturated sigmoid scores) gave 117.4 dB for minmax and 118.6 for mse;
# mse chosen on that read 71.6 dB on the evaluation clips, minmax 72.0.
EXACT_DB = 90.0


@dataclass(frozen=True)
class Measure:
    """One int8 model against fp32 on a choice's samples: output SQNR (dB); where the output is a
    distribution, its predicted per-position agreement; for a CTC recognizer, which samples' texts
    read as fp32's (bool [N])."""
    db: float
    agreement: float | None = None
    read: np.ndarray | None = None

    @property
    def texts(self) -> int | None:
        return None if self.read is None else int(self.read.sum())

    def label(self) -> str:
        return (f"{self.db:.1f} dB" + (f" / {100 * self.agreement:.2f} % agreed" if self.agreement is not None else "")
                + (f" / {self.texts} of {len(self.read)} texts" if self.read is not None else ""))


def measurer(fused, samples: SampleSet):
    """A function of an int8 output over `samples` (first output) -> its Measure against their reference."""
    ref = samples.reference
    dist = distribution_output(fused, samples) is not None
    judge = _texts_of(ref) if dist else None
    return lambda y: Measure(sqnr_db(ref, y), position_agreement(ref, y) if dist else None,
                             judge.counted(ref, y) if judge is not None else None)


def texts_judge(fused, samples: SampleSet) -> Judge | None:
    """The judge of a CTC recognizer's output over `samples` (a distribution at each position whose top-1
    paths look like CTC: verify.judge_for), else None. Method choice, the choices after it and
    --exclude-sensitive all ask this one question."""
    if not len(samples) or distribution_output(fused, samples) is None:
        return None
    return _texts_of(samples.reference)


def _texts_of(reference) -> Judge | None:
    judge = judge_for(reference)
    return judge if judge.kind == TEXTS else None


def method_measures(ctx: QuantizeContext, samples: SampleSet, methods=None, progress=None) -> dict:
    """{method: Measure} of the int8 model each range method gives, against the fused fp32 graph, over
    `samples` ("pick what measures best", per model); `progress(1)` after each."""
    measure, out = measurer(ctx.fused, samples), {}
    for m in methods or METHODS:
        out[m] = measure(ctx.score(samples, method=m, ranges=None)[0])
        if progress:
            progress(1)
    return out


def choose(measures: dict, plain: str, clip_gain_db: float) -> str:
    """The method to use: the best SQNR among those tied on texts and agreement (tied(); all where neither
    was measured), but the unclipped `plain` method unless a clipping one beats it by clip_gain_db."""
    names = list(measures)
    tied = [names[i] for i in _tied([measures[m] for m in names])]
    best = max(tied, key=lambda m: measures[m].db)
    plain = plain if plain in tied else best
    if measures[plain].db >= EXACT_DB:
        return plain
    # (a clipping method must earn its clip: within noise, the unclipped ranges hold better on data unlike
    # the calibration's: FSMN-VAD's streaming chunks, mse 0.3 dB ahead on 8 calibration samples, 3.5 dB
    # behind minmax on the evaluation ones)
    return plain if measures[best].db < measures[plain].db + clip_gain_db else best


def best_option(options: list) -> int:
    """The index of the best of a list of Measures: by texts and agreement where every one has them
    (_tied), then by SQNR."""
    return max(_tied(options), key=lambda i: options[i].db)


def _tied(measures: list) -> list:
    """Indices of the measures still in the running: where every one counted texts, those that read no
    fewer than the most-read one beyond TEXTS_SIGNIFICANCE standard deviations (a sign test on the samples
    they read apart); of those, where every one has an agreement, those within AGREEMENT_TIE of the best."""
    idx = list(range(len(measures)))
    if idx and all(m.read is not None for m in measures):
        top = max(idx, key=lambda i: measures[i].texts)
        idx = [i for i in idx if count_gain(measures[top].read, measures[i].read) <= TEXTS_SIGNIFICANCE]
    if idx and all(measures[i].agreement is not None for i in idx):
        best = max(measures[i].agreement for i in idx)
        idx = [i for i in idx if measures[i].agreement >= best - AGREEMENT_TIE]
    return idx


def pick_method(ctx: QuantizeContext, samples: SampleSet, say=print, show_progress: bool = True):
    """The range method whose int8 model measures best on a few calibration samples (never the
    evaluation data): (method, {method: Measure} or None)."""
    if not len(samples):
        say(f"note: --method auto has no calibration sample to compare the methods on (none recorded, or none of its "
            f"samples among those quantize could run together: see the warnings above); using {ctx.table.range_method}")
        return ctx.table.range_method, None
    candidates = range_candidates(ctx.table)
    with bar(len(candidates), "method", "method choice", show_progress) as pb:
        measures = method_measures(ctx, samples, candidates, progress=pb.update)
    best = choose(measures, ctx.table.range_method, CLIP_GAIN_DB)
    if len(samples) < MIN_CHOICE_SAMPLES and best != ctx.table.range_method:
        say(f"note: {best} measured best on only {len(samples)} calibration sample{'s' if len(samples) > 1 else ''}; "
            f"too few to trust a clip measured on the samples that set it: "
            f"{ctx.table.range_method} instead")
        best = ctx.table.range_method
    say(f"method auto: {best} (output SQNR on {len(samples)} calibration samples: "
        + ", ".join(f"{m} {v.label()}" for m, v in measures.items()) + ")")
    return best, measures


def report(measures: dict | None) -> dict:
    """quantize.json's figures of a method choice: method_scores_db, method_agreement, method_texts (None
    where not measured)."""
    m = measures or {}
    return {"method_scores_db": {k: v.db for k, v in m.items()} or None,
            "method_agreement": {k: v.agreement for k, v in m.items() if v.agreement is not None} or None,
            "method_texts": {k: v.texts for k, v in m.items() if v.texts is not None} or None}


CLIP_GAIN_DB = 0.5  # what a clipping range method must gain over minmax, on the calibration samples
# fewer samples than this choose the unclipped method: wired-table-rec's line segmenter (tables of 10 sizes, one
# of the most common) measured mse 39.2 dB against minmax 27.8 on its one sample, and on 16 other tables mse gave
# 26.4 dB and line IoU 0.85 where minmax gave 29.5 dB and 0.94 (ONNX Runtime's MinMax 0.93). Not 4: the zoo's
# MiniLM (sentences of many lengths, 3 of the most common) chose entropy there, 9.3 dB on its evaluation sentences
# where minmax reads 6.7; PLCMOS on 2 clips: mse 23.5 dB, minmax 23.1
MIN_CHOICE_SAMPLES = 2
