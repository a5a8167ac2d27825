"""A step that changes the model stays only where it measures better on samples it was not fitted on.

Output-aware rounding fits each layer's weights to its output on calibration samples, method choice
picks the range method that measures best on a few of them, channel balancing moves scales by what
they measure: on those samples each wins by construction. On others it may lose: PP-OCRv4's
recognizer read 0.925 / 0.890 / 0.883 of its crops with the fitted rounding where nearest rounding
read 0.936 (issue 45). So each such step is measured again, the model with it against the model
without it, on calibration samples no fitting step saw (run.SampleSplit.verify), by what the output
means, as eval judges it (evaluate.output_kind, one place):

- a sequence recognizer (top-1 paths that look like CTC: metrics.ctc_blank): its texts after greedy
  CTC decoding (metrics.ctc_collapse), each sample read as fp32 reads it or not;
- a classifier, or classes at each position: each sample's top-1 (all its positions) as fp32's or not;
- an encoder (encoder_judge.py: token states mean-pooled over the mask, or pooled vectors; or the user's
  --task encoder): each sample's vector's cosine to fp32's, never per-position classes;
- a normalized embedding: each vector's cosine to fp32's;
- anything else: each sample's squared error (SQNR), where nothing above applies.

A counted figure decides first, by a sign test over the samples the two models read differently: the
step wins (or loses) where the samples it alone reads right outnumber the others by more than
SIGNIFICANCE standard deviations of that count. Where neither wins, a continuous figure of the same
meaning decides (each sample's squared int8 error on the gap between fp32's top two classes, the noise
that flips a top-1; or 1 - cosine; or squared error), paired on the same samples as a ratio (log), the
step kept only for a mean gain beyond SIGNIFICANCE standard errors. Otherwise the step falls back
(nearest rounding, the unclipped method, no balancing).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from qtool.metrics import UNIT_ROWS_MIN, _top2, cosine_each, ctc_blank, ctc_collapse, is_distribution, output_kind
from qtool.quantize.encoder_judge import encoder_judge

SIGNIFICANCE = 1.0  # standard deviations (a count's) or standard errors (a mean's) a gain must exceed
ENCODER = "cosine of the pooled vectors"
TEXTS = "texts (greedy CTC)"  # a CTC recognizer's figure: each sample's text after greedy decoding


@dataclass
class Judge:
    kind: str  # TEXTS, "top-1", "top-1 at every position", ENCODER, "cosine", "SQNR"
    blank: int | None = None  # the CTC blank
    encoder: object = None  # an ENCODER's encoder_judge.EncoderJudge: how its output becomes a vector per sample

    def counted(self, ref: np.ndarray, y: np.ndarray) -> np.ndarray | None:
        """Each sample read as fp32 reads it (bool [N]), or None where the figure is no count."""
        if self.kind == TEXTS:
            real = _real_rows(ref)  # (a sample shorter than others: its padding read by neither)
            pr, py = ref.argmax(-1), y.argmax(-1)
            return np.array([ctc_collapse(a[k], self.blank) == ctc_collapse(b[k], self.blank)
                             for a, b, k in zip(pr, py, real)])
        if self.kind in ("top-1", "top-1 at every position"):
            eq = ref.argmax(-1) == y.argmax(-1)
            return eq.reshape(len(eq), -1).all(axis=1)
        return None

    def error(self, ref: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Each sample's distance from fp32 (float [N]; lower is better): for classes (a classifier's, or at
        each position) the squared int8 error on the gap between fp32's winner and runner-up, the noise that
        flips a top-1 (metrics.predicted_agreement's model), averaged over the positions; 1 - cosine for an
        embedding; else the squared error relative to the reference's mean energy."""
        if self.kind in (TEXTS, "top-1", "top-1 at every position"):
            c = ref.shape[-1]
            r, o = ref.reshape(-1, c), y.reshape(-1, c)
            i1, i2 = _top2(r)
            k = np.arange(len(r))
            d = (o[k, i1].astype(np.float64) - r[k, i1]) - (o[k, i2].astype(np.float64) - r[k, i2])
            return (d ** 2).reshape(len(ref), -1).mean(axis=1)
        if self.kind == ENCODER:
            return 1 - cosine_each(self.encoder.vectors(ref), self.encoder.vectors(y))
        r, o = ref.reshape(len(ref), -1).astype(np.float64), y.reshape(len(y), -1).astype(np.float64)
        if self.kind == "cosine":
            c = ref.shape[-1]
            a, b = r.reshape(-1, c), o.reshape(-1, c)
            cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
            return (1 - cos).reshape(len(ref), -1).mean(axis=1)
        return ((o - r) ** 2).sum(axis=1) / max(float((r ** 2).sum(axis=1).mean()), 1e-30)


def judge_of(fused, samples, task: str | None = None) -> Judge:
    """What the output of `fused` over `samples` (a SampleSet) means: an encoder's vectors where the graph, the
    values or the user's `task` say it is one (encoder_judge.py, as --exclude-sensitive and eval judge it),
    else judge_for(its reference)."""
    enc = encoder_judge(fused, samples, task)
    return Judge(ENCODER, encoder=enc) if enc is not None else judge_for(samples.reference)


def judge_for(reference: np.ndarray) -> Judge:
    """What the output means, from fp32's output over the samples ([N, ...], samples first), as eval
    reads it (evaluate.output_kind)."""
    # (read in its own precision, never copied whole to float64: PP-OCRv5's 228 check crops are 240 MB
    # of probabilities, and a float64 copy doubled that on the default path)
    ref = np.asarray(reference)
    if ref.ndim < 2 or not ref.size or not np.issubdtype(ref.dtype, np.floating):
        return Judge("SQNR")
    if ref.shape[-1] >= UNIT_ROWS_MIN and _unit_rows(ref.reshape(-1, ref.shape[-1])) and not is_distribution(ref):
        return Judge("cosine")
    real = _real_rows(ref) if ref.ndim == 3 else None
    if real is not None and not all(k.all() for k in real):
        # samples of several lengths, joined zero-padded to the longest (samples.py): the kind is that of
        # their real positions (a padded row is no distribution), laid end to end as one sequence
        rows = np.concatenate([r[k] for r, k in zip(ref, real)])
        kind, layout = output_kind(rows[None]) if len(rows) else (None, None)
        paths = [r[k].argmax(-1) for r, k in zip(ref, real)]
    else:
        kind, layout = output_kind(ref)
        paths = list(ref.argmax(-1))
    if kind is None or layout is not None:
        return Judge("SQNR")
    if kind == "position":
        blank = ctc_blank(paths)
        if blank is not None:
            return Judge(TEXTS, blank)
        return Judge("top-1 at every position")
    return Judge("top-1")


def _unit_rows(rows: np.ndarray, chunk: int = 1 << 20) -> bool:
    """Whether every row of a 2-D array has length 1 (within 1e-2), in float64 about `chunk` values at a time."""
    step = max(1, chunk // max(rows.shape[1], 1))
    for s in range(0, len(rows), step):
        r = rows[s:s + step].astype(np.float64)
        if np.abs(np.sqrt((r * r).sum(axis=1)) - 1).max() > 1e-2:
            return False
    return True


def _real_rows(ref: np.ndarray) -> list:
    """Per sample of a [N, T, C] output, its positions that are not all zero (bool [T]): a sample shorter than
    the longest is joined zero-padded (samples.py), and a real score row (a distribution, logits) never is."""
    r = np.asarray(ref)
    return [np.abs(x.reshape(len(x), -1)).sum(1) > 0 for x in r] if r.ndim == 3 else [slice(None)] * len(r)


@dataclass
class Verdict:
    step: str
    kept: bool
    judge: str
    samples: int
    read_with: int | None  # samples read as fp32 reads them, with the step (a counted figure)
    read_without: int | None
    error_with: float  # mean continuous error (the top-1 gap's squared error, 1 - cosine, or relative squared error)
    error_without: float
    decided_by: str  # "count" or "continuous"
    fallback: str  # what the model got where the step was not kept
    margin: float = 0.0  # the deciding figure's gain in its standard deviations (count) or standard errors (mean)

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        fig = (f"{self.read_with}/{self.samples} read as fp32 with it, {self.read_without}/{self.samples} without"
               if self.read_with is not None else "")
        err = f"error {self.error_with:.4g} with it, {self.error_without:.4g} without"
        what = "kept" if self.kept else f"not better beyond the noise: {self.fallback} instead"
        return (f"verified {self.step} on {self.samples} held-out calibration samples by {self.judge} "
                f"({'; '.join(x for x in (fig, err) if x)}): {what}")


@dataclass
class Figures:
    """A model's figures on each sample, by a Judge: read as fp32 reads it (bool [N], None where the figure is
    no count) and its continuous error (float [N]). Figures of other samples add (+) to judge them together."""
    read: np.ndarray | None
    error: np.ndarray

    @classmethod
    def of(cls, judge: Judge, ref: np.ndarray, y: np.ndarray) -> "Figures":
        ref = np.asarray(ref)
        return cls(judge.counted(ref, y), np.asarray(judge.error(ref, y), np.float64))

    def __add__(self, other: "Figures") -> "Figures":
        read = None if self.read is None or other.read is None else np.concatenate([self.read, other.read])
        return Figures(read, np.concatenate([self.error, other.error]))

    def __len__(self):
        return len(self.error)


def verdict(step: str, judge: Judge, ref: np.ndarray, y_with: np.ndarray, y_without: np.ndarray,
            fallback: str) -> Verdict:
    """Whether the model with `step` (its output y_with over the held-out samples) measures better than
    without it (y_without), by `judge` (decide())."""
    return decide(step, judge.kind, Figures.of(judge, ref, y_with), Figures.of(judge, ref, y_without), fallback)


def decide(step: str, kind: str, with_: Figures, without: Figures, fallback: str,
           significance: float = SIGNIFICANCE) -> Verdict:
    """Whether the model with `step` measures better than without it, on the same samples judged by `kind`: a
    count first (sign test), then the continuous figure (paired), each beyond `significance` standard
    deviations (the count's) or standard errors (the mean's)."""
    a, b = with_.read, without.read
    kept, by, margin = None, "continuous", 0.0
    if a is not None and b is not None:
        margin = count_gain(a, b)
        if margin > significance:
            kept, by = True, "count"
        elif margin < -significance:
            kept, by = False, "count"
    if kept is None:
        # each sample's gain as a ratio (log): a sample whose output is ten times louder than the others' is one
        # sample, not the whole verdict (orinet: one held-out page decided a mean of squared errors alone)
        e1, e0 = with_.error, without.error
        floor = 1e-12 * max(float(np.nanmean(e0)), float(np.nanmean(e1)), 1e-300)
        gain = np.log(e0 + floor) - np.log(e1 + floor)
        gain = gain[np.isfinite(gain)]
        se = float(gain.std(ddof=1) / np.sqrt(len(gain))) if len(gain) > 1 else float("inf")
        kept = bool(len(gain) and gain.mean() > 0 and gain.mean() > significance * se)
        margin = float(gain.mean() / se) if len(gain) and se > 0 else 0.0
    return Verdict(step, kept, kind, len(with_), None if a is None else int(a.sum()),
                   None if b is None else int(b.sum()), float(np.nanmean(with_.error)),
                   float(np.nanmean(without.error)), by, fallback, round(float(margin), 3))


def count_gain(a: np.ndarray, b: np.ndarray) -> float:
    """By how many standard deviations of their count the samples only `a` reads as fp32 reads them outnumber
    those only `b` reads (bool [N] each; a sign test over the samples the two read apart; 0 where none)."""
    wins, losses = int((a & ~b).sum()), int((b & ~a).sum())
    return (wins - losses) / max(np.sqrt(wins + losses), 1.0)


def verify_step(ctx, samples, step: str, fallback: str, say=print, without=None, exclude: dict | None = None,
                **over) -> Verdict:
    """verdict() of ctx's model (with `step`; `exclude`: the layers the step keeps fp32) against the model
    without it, on held-out `samples` (a SampleSet): `without`, a context of its own (a method choice or
    balancing undone), else ctx's model built with `over` (hessians=None: nearest rounding). Says its one line."""
    y_with = ctx.score(samples, exclude)[0]
    y_without = (without.score(samples) if without is not None else ctx.score(samples, **over))[0]
    v = verdict(step, judge_of(ctx.fused, samples, ctx.task), samples.reference, y_with, y_without, fallback)
    say(v.line())
    return v
