"""--exclude-sensitive: keep the most sensitive layers in fp32 until a target is met.

Greedy: starting from the fully quantized model, each step tries the next few candidates,
keeps the one whose exclusion helps most on the held-back images, and stops as soon as the
target holds (or the cap is reached). The candidates are the top of the sensitivity ranking
(each layer alone in int8), re-ordered by what excluding each one alone gains on the fully
quantized model: the two differ where a layer's noise adds to, or cancels, the others'. The readers
of the noisiest activation quantizers (quantizer_noise.py) join the candidates, all the readers of one
tensor as one candidate (its quantizer goes only when they all do): a quantizer that costs little in
an fp32 model can cost much among the others, which the ranking of layers alone does not see.
Where the output is a distribution over its last axis (samples.distribution_output: a CTC
recognizer's [N, T, C]), agreement and KL are per position, each image's KL the mean of its
positions'. "Helps most" is the lowest softmax KL divergence from fp32: like top-1 agreement it weighs
the error on the few classes that carry the probability, where output SQNR weighs all
logits alike; unlike a count of flips it is smooth on a few dozen images. Top-1 agreement
is judged both as counted and as predicted from the logit margins (metrics.predicted_
agreement): a count over a few dozen images cannot tell 99.5 % from 100 %.
A CTC recognizer's output (verify.judge_for: top-1 paths that look like CTC) is judged by what it reads
instead: the agreement is the share of samples whose text after greedy decoding is fp32's, the error each
sample's squared int8 error on the gap between fp32's top two classes (verify.Judge.error), and a step stays
by verify.decide (texts first, by a sign test; that error where they tie). Per-position agreement and KL,
with almost every position a blank, called 0.990 agreement on PP-OCRv2's recognizer where 91 crops of 255
read otherwise than fp32 (issue 45).
Beside single layers, blocks are tried whole: the first k int8 layers in graph order and the k most
sensitive ones (BLOCKS). The noise of int8 layers does not add up: on PP-OCRv2's recognizer each of its
first eight convolutions kept fp32 alone made the all-int8 model worse (117-163 held-out crops read of 255,
against 166 all int8), the first eight together read 206 (fp32 208). A layer kept fp32 still receives the
noise of the int8 layers before it.
An encoder's output (encoder_judge.py: token states or pooled vectors) is judged as vectors instead: the
agreement is the nearest-neighbour agreement over the check samples, the second figure each sample's cosine
to fp32 (mean), the error 1 - cosine; the target holds where both reach it.
A step's exclusion stays only if it helps: a better score than the best model so far, no worse
agreement or SQNR than the all-int8 model, and a gain beyond the images' noise (the per-image
KL difference, paired on the same images, above SIGNIFICANCE standard errors).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx

from qtool.ortsession import session
from qtool.metrics import (kl_each, kl_softmax_each, position_agreement, position_top1_agreement, predicted_agreement,
                           sqnr_db, top1_agreement, wilson)
from qtool.quantize.context import QuantizeContext
from qtool.quantize.encoder_judge import encoder_judge
from qtool.quantize.method_choice import texts_judge as recognizer_judge
from qtool.quantize.samples import SampleSet, distribution_output
from qtool.quantize.verify import TEXTS, Figures, Judge, decide

CANDIDATES_PER_STEP = 2
POOL = 8  # layers from the top of the sensitivity ranking whose leave-one-out gain is measured
# and the readers of the noisiest activation quantizers, NOISY_BELOW dB or more under the median one's,
# at most this many groups of at most GROUP_MAX layers (all the readers of one tensor, so that it
# stays fp32)
NOISY_GROUPS = 4
NOISY_BELOW = 10.0
GROUP_MAX = 3
# an exclusion is kept only if its gain, per image against the best model so far, exceeds this many
# standard errors of that paired difference: on 100 images a lower mean KL alone can be the noise of
# a few images (each step picks the better of two candidates, which favours a lucky one)
SIGNIFICANCE = 1.0
# the search stops after this many steps in a row in which no candidate helped: the ranking's next
# layers help less still, and without it a model where nothing helps tried every layer (PP-OCRv5's
# recognizer: 73 layers, 37 steps, 10 minutes)
MAX_MISSES = 2
# models are scored one after another (on every thread) where each output over the check images is
# larger than this: side by side, two of them were held at once (PP-OCRv5's recognizer: 634 MB each)
SIDE_BY_SIDE_BYTES = 256 << 20
# sizes of the blocks tried whole (the first k int8 layers, the k most sensitive), up to --max-excluded
BLOCKS = (2, 4, 8)


@dataclass
class TradeoffPoint:
    excluded: list
    agreement: float  # counted on the check images (an encoder's: nearest-neighbour agreement)
    predicted_agreement: float  # (an encoder's: its mean cosine to fp32; ExclusionResult.figures names them)
    sqnr_db: float
    accuracy_drop_pt: float | None
    ort_int8_ms: float | None
    added: str = ""  # the layer this step kept in fp32
    kl: float = 0.0  # mean softmax KL divergence from fp32 (nats), or what ExclusionResult.error names
    agreement_95: tuple = (0.0, 1.0)  # Wilson interval of the counted agreement
    images: int = 0
    kept: bool = True  # this step's exclusion stayed (it helped on the held-back images)
    gain_se: float | None = None  # its per-image gain on the best model so far, in standard errors
    undone: str = ""  # why this step's exclusion did not stay


@dataclass
class ExclusionResult:
    excluded: dict  # node name -> reason
    curve: list = field(default_factory=list)  # TradeoffPoint per step
    reached: bool = False
    target: str = ""
    error: str = "KL"  # what TradeoffPoint.kl holds: "KL" (nats), "1-cosine" (an encoder's), or "-SQNR" (dB)
    figures: tuple = ("agreement", "predicted")  # what TradeoffPoint.agreement and .predicted_agreement are
    model: onnx.ModelProto | None = None
    leave_one_out: dict = field(default_factory=dict)  # layer -> the fully quantized model with it alone fp32
    check_images: int = 0  # images the target was checked on
    check_held_back: bool = True  # ... held back from the sensitivity analysis (else the same images)

    def to_dict(self):
        return {"excluded": self.excluded, "reached": self.reached, "target": self.target, "error": self.error,
                "figures": list(self.figures), "curve": [asdict(p) for p in self.curve],
                "leave_one_out": self.leave_one_out}


def per_image_error(ref: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each image's distance from fp32: softmax KL for a classifier's [N, classes], else the squared
    error over its output values, relative to the reference's mean energy."""
    r, o = np.asarray(ref, np.float64).reshape(len(ref), -1), np.asarray(y, np.float64).reshape(len(y), -1)
    if np.asarray(y).ndim == 2:
        return kl_softmax_each(r, o)
    return ((o - r) ** 2).sum(axis=1) / max(float((r ** 2).sum(axis=1).mean()), 1e-30)


def latency_ms(model: onnx.ModelProto, feed: dict, repeats: int = 15) -> float:
    s = session(model, 0)
    s.run(None, feed)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        s.run(None, feed)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1000


def _deployed(ctx: QuantizeContext, scored, excl: dict):
    """The model as it will be written (a scoring model may store its weights otherwise)."""
    return ctx.build(excl).model if ctx.exact_storage else scored.model


def with_group(excl: dict, group: tuple, why: str = "leave-one-out") -> dict:
    """`excl` and the layers of `group` it does not hold yet, kept fp32 for `why` (a block or a quantizer's
    readers may overlap what an earlier step kept: those keep their own reason)."""
    return dict(excl, **{n: why for n in group if n not in excl})


def noisy_groups(noisy: list, rank: dict, excl: dict, pool: list, max_excluded: int) -> list:
    """[(group, reason)]: the int8 readers of each of the NOISY_GROUPS noisiest quantizers (noisy:
    [QuantizerNoise], noisiest first) whose noise stands out (NOISY_BELOW dB under the median), where
    they are layers of the ranking, at most GROUP_MAX and not already a candidate."""
    if not noisy:
        return []
    median = float(np.median([q.sqnr_db for q in noisy]))
    out, seen = [], set(pool)
    for q in noisy:
        if len(out) == NOISY_GROUPS or q.sqnr_db > median - NOISY_BELOW:
            break
        g = tuple(n for n in q.readers if n not in excl)
        if not g or g in seen or len(g) > min(GROUP_MAX, max_excluded) or any(n not in rank for n in g):
            continue
        seen.add(g)
        out.append((g, f"kept fp32 by --exclude-sensitive (reads {q.tensor}, whose quantizer alone gives "
                       f"{q.sqnr_db:.1f} dB there)"))
    return out


def blocks(ranking: list, excl: dict, max_excluded: int) -> list:
    """[(group, reason)]: the first k int8 layers of the ranking in graph order, and its k most sensitive, for
    each k of BLOCKS up to max_excluded, each set once (a block the other already is, or a single layer, not
    again)."""
    def names(key):
        return [s.name for s in sorted(ranking, key=key) if s.name not in excl]
    first, top = names(lambda s: s.order), names(lambda s: s.rank)
    out, seen = [], set()
    for k in (k for k in BLOCKS if k <= max_excluded):
        for g, what in ((first[:k], f"one of the first {k} int8 layers"), (top[:k], f"one of the {k} most sensitive")):
            if len(g) == k and frozenset(g) not in seen:
                seen.add(frozenset(g))
                out.append((tuple(g), f"kept fp32 by --exclude-sensitive ({what}, kept fp32 together)"))
    return out


def new_layers(group: tuple, excl: dict) -> int:
    """How many of `group`'s layers `excl` does not hold yet (what keeping it fp32 adds)."""
    return sum(1 for n in group if n not in excl)


@dataclass(frozen=True)
class Target:
    """When the search stops: top-1 agreement with fp32 of at least `agreement` (counted and predicted),
    or, with `labels` (one class per check image, -1: unknown), an accuracy drop of at most `max_drop`
    points; at most `max_excluded` layers kept fp32 beside the user's. `task`: what the output means where
    the user says (qtool.tasks; "encoder": judged as vectors, encoder_judge.py), else guessed."""
    agreement: float = 0.995
    max_drop: float | None = None
    max_excluded: int = 5
    labels: list | None = None
    task: str | None = None


def texts_judge(fused, samples: SampleSet, encoder) -> Judge | None:
    """A CTC recognizer's judge (method_choice.texts_judge), else None (an `encoder`, from encoder_judge, is
    judged as one)."""
    return None if encoder is not None else recognizer_judge(fused, samples)


def target_words(target: Target, encoder: bool, labelled: bool, texts: bool = False) -> str:
    """The target as the command says it."""
    if encoder:
        return f"cosine to fp32 and nearest-neighbour agreement >= {target.agreement}"
    if texts:
        return f"texts read as fp32 reads them, and top-1 at every position, >= {target.agreement}"
    if target.max_drop is not None and labelled:
        return f"accuracy drop <= {target.max_drop} pt"
    return f"top-1 agreement >= {target.agreement}"


class Search:
    """The models measured on the check samples: each point of the trade-off, its per-image error, and
    whether it reaches the target."""

    def __init__(self, ctx: QuantizeContext, samples: SampleSet, target: Target, progress=None):
        self.ctx, self.samples, self.target, self.progress = ctx, samples, target, progress
        self.base_exclude = dict(ctx.exclude)
        self.reference = samples.reference
        self.dist = distribution_output(ctx.fused, samples)
        self.encoder = None if self.dist and target.task is None else encoder_judge(ctx.fused, samples, target.task)
        # (an encoder's vectors have no classes: labels say nothing of them)
        self.y_true = None if target.labels is None or self.encoder else np.asarray(target.labels)
        # one value per position, more than one position per sample: each value is a decision of its own (an
        # argmax over a sample's positions, as for a classifier's classes, means nothing there)
        ref = self.reference
        self.decisions = not self.dist and ref.ndim >= 2 and ref.shape[-1] == 1 and ref[0].size > 1
        self.texts = texts_judge(ctx.fused, samples, self.encoder)  # a CTC recognizer: by its texts
        self.errors = {}  # id(TradeoffPoint) -> its error on each image (KL, or squared error for other outputs)
        self.reads = {}  # id(TradeoffPoint) -> each sample read as fp32 reads it (texts), where judged by texts
        self.res = None
        self.there = None  # the models' scorer on a Ray cluster (ctx.experiments.scorer), made on first use

    def evaluate(self, excl: dict, threads: int | None = None, scored: tuple | None = None):
        """(the QuantizeOutput, its TradeoffPoint) of the model with `excl` kept fp32; `scored`: its
        ctx.score, computed already (on a Ray cluster: evaluate_all)."""
        reference, y_true, dist = self.reference, self.y_true, self.dist
        y, q = scored or self.ctx.score(self.samples, excl, threads)
        drop = None
        if y_true is not None:
            m = y_true >= 0
            drop = 100 * float((reference[m].argmax(1) == y_true[m]).mean() - (y.reshape(len(y), -1)[m].argmax(1) == y_true[m]).mean())
        db = sqnr_db(reference, y)
        if self.encoder is not None:  # vectors: neighbours kept, and each sample's cosine
            agree, cos = self.encoder.measure(y)
            count, predicted, err = len(cos), float(cos.mean()), 1 - cos
            kl = float(err.mean())
        elif self.texts is not None:  # what it reads: each sample's text as fp32's, and the top-2 gap's error
            read = self.texts.counted(reference, y)
            agree, count, predicted = float(read.mean()), len(read), position_agreement(reference, y)
            err = self.texts.error(reference, y)
            kl = float(err.mean())
        elif dist:  # what each position means is its class: agreement and KL per position
            agree, count = position_top1_agreement(reference, y), reference.size // reference.shape[-1]
            predicted = position_agreement(reference, y)
            err = kl_each(reference, y, log=dist == "LogSoftmax")
            kl = float(err.mean())
        else:
            # (decisions: a one-value decision at each position, [N, T, 1]: a word boundary per character)
            r1, y1 = (reference.reshape(-1, 1), y.reshape(-1, 1)) if self.decisions else (reference, y)
            agree, predicted, count = top1_agreement(r1, y1), predicted_agreement(r1, y1), len(r1)
            err = per_image_error(reference, y)
            kl = float(err.mean()) if y.ndim == 2 else -db  # (err: each image's KL there)
        pt = TradeoffPoint(sorted(n for n in excl if n not in self.base_exclude), agree, predicted, db, drop, None,
                           kl=kl, agreement_95=wilson(round(agree * count), count), images=len(y))
        self.errors[id(pt)] = err
        if self.texts is not None:
            self.reads[id(pt)] = read
        if self.progress:
            self.progress(1)
        return q, pt

    def evaluate_all(self, excls: list) -> list:
        """evaluate() of each, side by side with one ORT thread each: one model's graph is built (Python)
        while another runs, and one thread per session beats two on a model this size (simulate.py). With
        ctx.experiments (a Ray cluster: sharded.py) the models are built and run by its workers, each as here."""
        workers = min(len(excls), self.ctx.workers)
        alone = workers <= 1 or self.reference.nbytes > SIDE_BY_SIDE_BYTES
        if self.ctx.experiments is not None and len(excls) > 1:
            return [self.evaluate(e, scored=s) for e, s in zip(excls, self._scored_there(excls, self.ctx.workers if alone else 1))]
        if alone:
            return [self.evaluate(e) for e in excls]
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(lambda e: self.evaluate(e, 1), excls))

    def _scored_there(self, excls: list, threads) -> list:
        """ctx.score of each on the cluster's workers -> [(output, QuantizeOutput)]; what a build there
        told its QuantizeContext.on_error (a layer's rounding failed) is told to this one, in order."""
        if self.there is None:
            self.there = self.ctx.experiments.scorer(self.ctx, self.samples)
        out = []
        for y, resized, q, failed in self.there.score_all(excls, threads):
            self.ctx.resized = max(self.ctx.resized, resized)
            for layer, e in failed:
                if self.ctx.on_error is not None:
                    self.ctx.on_error(layer, e)
            out.append((y, q))
        return out

    def not_worse(self, pt: TradeoffPoint) -> bool:
        """Never give up a layer for a model whose agreement or SQNR is below the all-int8 one's (a recognizer:
        its texts; SQNR on its probabilities misleads, method_choice.py)."""
        base = self.res.curve[0]
        return pt.agreement >= base.agreement and (self.texts is not None or pt.sqnr_db >= base.sqnr_db)

    def good(self, pt: TradeoffPoint) -> bool:
        if self.target.max_drop is not None and pt.accuracy_drop_pt is not None:
            return pt.accuracy_drop_pt <= self.target.max_drop
        return min(pt.agreement, pt.predicted_agreement) >= self.target.agreement

    def score(self, pt: TradeoffPoint):
        # KL is smooth and well estimated on a few dozen images, where a count of top-1 flips
        # moves in steps of 1/N: it picks the candidate, the target decides when to stop
        if self.target.max_drop is not None and pt.accuracy_drop_pt is not None:
            return (-pt.accuracy_drop_pt, -pt.kl)
        if self.texts is not None:  # the error that flips texts (smooth), then the texts read
            return (-pt.kl, pt.agreement)
        return (-pt.kl, pt.sqnr_db)

    def why_undone(self, pt: TradeoffPoint, best_pt: TradeoffPoint) -> str:
        """Why a step's exclusion does not stay ("" where it does): it helps only with a better score than
        the best so far, no worse than the all-int8 model in agreement and SQNR on the held-back images,
        and by more than the images' own noise. A recognizer's: verify.decide against the best so far (its
        texts by a sign test, else the gap error), and no fewer texts read than all int8."""
        if self.texts is not None:  # verify.decide: the texts (sign test), then the error where they tie
            v = decide("exclusion", TEXTS, Figures(self.reads[id(pt)], self.errors[id(pt)]),
                       Figures(self.reads[id(best_pt)], self.errors[id(best_pt)]), "", SIGNIFICANCE)
            pt.gain_se = v.margin
            return ("texts read below the all-int8 model's" if not self.not_worse(pt) else "" if v.kept else
                    "no better than the best so far" if v.margin <= 0 else "no gain beyond noise")
        d = self.errors[id(best_pt)] - self.errors[id(pt)]
        pt.gain_se = float(d.mean() / max(d.std(ddof=1) / np.sqrt(len(d)), 1e-30)) if len(d) > 1 else 0.0
        return ("no better than the best so far" if not self.score(pt) > self.score(best_pt) else
                "agreement or SQNR below the all-int8 model's" if not self.not_worse(pt) else
                "no gain beyond noise" if not pt.gain_se > SIGNIFICANCE else "")


def _candidates(search: Search, ranking: list, excl: dict, noisy: list | None) -> tuple:
    """(the candidate groups in the order they are tried, {group: why it is kept fp32}). A candidate is a
    group of layers kept fp32 together: one layer, or every reader of a noisy quantizer."""
    res, max_excluded = search.res, search.target.max_excluded
    rank = {s.name: s.rank for s in ranking}
    reason = {(n,): f"kept fp32 by --exclude-sensitive (sensitivity rank {r})" for n, r in rank.items()}
    order = [(s.name,) for s in sorted(ranking, key=lambda s: s.rank) if s.name not in excl]
    if not res.reached and max_excluded > 0:
        # leave-one-out from the fully quantized model, for the top of the ranking and the readers of
        # the noisiest quantizers (quantizer_noise.py: what the ranking of layers alone misses)
        pool = order[:POOL]
        for g, why in noisy_groups(noisy or [], rank, excl, pool, max_excluded) + blocks(ranking, excl, max_excluded):
            if g in pool:
                continue
            pool.append(g)
            reason[g] = why
            if g in order:
                order.remove(g)
        alone = dict(zip(pool, (r[1] for r in search.evaluate_all([with_group(excl, g) for g in pool]))))
        order = sorted(pool, key=lambda g: search.score(alone[g]), reverse=True) + [g for g in order if g not in alone]
        res.leave_one_out = {"+".join(g): {"kl": p.kl, "sqnr_db": p.sqnr_db, "agreement": p.agreement}
                             for g, p in alone.items()}
    return order, reason


def _error_name(search: Search) -> str:
    if search.encoder is not None:
        return "1-cosine"
    if search.texts is not None:
        return "gap err"
    return "KL" if search.dist or search.reference.ndim == 2 else "-SQNR"


def exclude_sensitive(ctx: QuantizeContext, ranking: list, samples: SampleSet, target: Target = Target(),
                      progress=None, measure_latency: bool = True, partial: list | None = None,
                      noisy: list | None = None) -> ExclusionResult:
    """Layers kept fp32 on top of the user's (ctx.exclude), judged on `samples` (held back): search()."""
    return search_exclusions(Search(ctx, samples, target, progress), ranking, measure_latency, partial, noisy)


def search_exclusions(search: Search, ranking: list, measure_latency: bool = True, partial: list | None = None,
                      noisy: list | None = None) -> ExclusionResult:
    """The layers `search` keeps fp32 (a Search: its model, check samples and target, each judged once).
    `partial` gets the result as soon as it exists: what was kept so far, should a later step fail.
    `noisy` ([QuantizerNoise], quantizer_noise.py): the readers of the noisiest quantizers are
    candidates too, each group kept fp32 together."""
    ctx, samples, target = search.ctx, search.samples, search.target
    one = samples.feed(0, samples.batch if samples.fixed_batch else 1)  # (latency at batch 1)
    label = target_words(target, search.encoder is not None, search.y_true is not None, search.texts is not None)
    excl = dict(search.base_exclude)
    q, pt = search.evaluate(excl)
    if measure_latency:
        pt.ort_int8_ms = latency_ms(_deployed(ctx, q, excl), one)
    res = search.res = ExclusionResult(dict(excl), [pt], search.good(pt), label, model=q.model,
                                       error=_error_name(search))
    if search.encoder is not None:
        res.figures = ("neighbours", "cosine")
    elif search.texts is not None:
        res.figures = ("texts", "positions")
    if partial is not None:
        partial.append(res)
    best_q, best_pt = q, pt
    order, reason = _candidates(search, ranking, excl, noisy)
    misses = 0  # steps in a row whose exclusion did not stay
    while not res.reached and order and misses < MAX_MISSES:
        room = target.max_excluded - (len(excl) - len(search.base_exclude))
        order = [g for g in order if new_layers(g, excl)]  # (a block the model holds already: nothing to try)
        groups = [g for g in order if new_layers(g, excl) <= room][:CANDIDATES_PER_STEP]
        if not groups:
            break
        cands = [with_group(excl, g, reason[g]) for g in groups]
        tried = [(g, cand) + r for g, cand, r in zip(groups, cands, search.evaluate_all(cands))]
        group, cand, q, pt = max(tried, key=lambda t: search.score(t[3]))
        pt.added = "+".join(group)
        order.remove(group)
        pt.undone = search.why_undone(pt, best_pt)
        pt.kept = not pt.undone
        if measure_latency:
            pt.ort_int8_ms = latency_ms(_deployed(ctx, q, cand), one)
        res.curve.append(pt)
        if not pt.kept:
            misses += 1
            continue
        misses = 0
        excl = cand
        best_q, best_pt = q, pt
        res.excluded = dict(excl)
        res.reached = search.good(pt)
    res.model = best_q.model
    return res
