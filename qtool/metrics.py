"""How far an int8 output is from its fp32 reference: one place for every comparison."""
from __future__ import annotations

import math

import numpy as np


def sqnr_db(ref: np.ndarray, out: np.ndarray, chunk: int = 1 << 22) -> float:
    """Signal to quantization noise, in dB (float64 sums, a chunk of values at a time)."""
    r, o = np.asarray(ref).reshape(-1), np.asarray(out).reshape(-1)
    if r.shape != o.shape:
        raise ValueError(f"sqnr_db: shapes {np.shape(ref)} and {np.shape(out)} differ")
    signal = noise = 0.0
    for s in range(0, len(r), chunk):
        a = r[s:s + chunk].astype(np.float64)
        signal += float((a * a).sum())
        noise += float(((a - o[s:s + chunk]) ** 2).sum())
    return float("inf") if noise == 0 else float(10 * np.log10(max(signal, 1e-300) / noise))


def top1_agreement(ref: np.ndarray, out: np.ndarray) -> float:
    r, o = ref.reshape(len(ref), -1), out.reshape(len(out), -1)
    if r.shape[1] == 1:
        # one value per sample: a binary decision (a VAD's speech probability), the same side of its
        # threshold; an argmax over one value always agreed (akiki's VAD: "target reached" at once, with
        # 9.7 % of its decisions flipped)
        t = decision_threshold(r)
        return float(((r[:, 0] > t) == (o[:, 0] > t)).mean())
    return float((r.argmax(1) == o.argmax(1)).mean())


def decision_threshold(ref: np.ndarray) -> float:
    """Where a one-value output decides: 0.5 for a probability (every value within [0, 1]), else 0 (a logit)."""
    return 0.5 if ref.size and float(ref.min()) >= 0.0 and float(ref.max()) <= 1.0 else 0.0


def _log_softmax(x):
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def kl_softmax_each(ref: np.ndarray, out: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(out)) of each sample, in nats."""
    lp = _log_softmax(np.asarray(ref, np.float64).reshape(len(ref), -1))
    lq = _log_softmax(np.asarray(out, np.float64).reshape(len(out), -1))
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


def kl_softmax(ref: np.ndarray, out: np.ndarray) -> float:
    """Mean KL(softmax(ref) || softmax(out)) over samples, in nats."""
    return float(kl_softmax_each(ref, out).mean())


def _top2(a: np.ndarray, chunk: int = 1 << 22, rows: np.ndarray | None = None) -> tuple:
    """Each row's largest and second-largest entry's index (of `rows` only, where given), a few rows at a
    time (a CTC output holds millions of values: a full sort of them, and its int64 copy, cost gigabytes)."""
    rows = np.arange(len(a)) if rows is None else rows
    step = max(1, chunk // max(a.shape[1], 1))
    i1, i2 = np.empty(len(rows), np.int64), np.empty(len(rows), np.int64)
    for s in range(0, len(rows), step):
        part = np.asarray(a[rows[s:s + step]], np.float64)
        top = np.argpartition(-part, 1, axis=1)[:, :2]
        r = np.arange(len(part))
        swap = part[r, top[:, 1]] > part[r, top[:, 0]]
        i1[s:s + step] = np.where(swap, top[:, 1], top[:, 0])
        i2[s:s + step] = np.where(swap, top[:, 0], top[:, 1])
    return i1, i2


def predicted_agreement(ref: np.ndarray, out: np.ndarray, rows: np.ndarray | None = None) -> float:
    """Expected top-1 agreement on images like these, smoother than counting flips on a few.

    The int8 error on the gap between the fp32 winner and runner-up is modelled as
    Gaussian with the spread measured on these samples; an image flips with probability
    Phi(-margin / sigma). On 64 images this ranks candidates where a raw count shows 64/64.
    `rows`: only these rows count (indices; no copy of the others is made).
    """
    ref = np.asarray(ref).reshape(len(ref), -1)
    out = np.asarray(out).reshape(len(out), -1)
    if rows is not None and ref.shape[1] < 2:  # (one value a row: taken as they are)
        ref, out, rows = ref[rows], out[rows], None
    if ref.shape[1] < 2:  # (a binary decision: its margin is the distance to the threshold)
        if not ref.size:
            return 1.0
        margin = np.abs(ref[:, 0].astype(np.float64) - decision_threshold(ref))
        sigma = math.sqrt(float(((out[:, 0].astype(np.float64) - ref[:, 0]) ** 2).mean()))
        if sigma == 0:
            return top1_agreement(ref, out)
        return float(1 - (0.5 * np.array([math.erfc(m / (sigma * math.sqrt(2))) for m in margin])).mean())
    rows = np.arange(len(ref)) if rows is None else rows
    i1, i2 = _top2(ref, rows=rows)
    r1, r2 = ref[rows, i1].astype(np.float64), ref[rows, i2].astype(np.float64)
    margin = r1 - r2
    d = (out[rows, i1] - r1) - (out[rows, i2] - r2)
    sigma = math.sqrt(float((d ** 2).mean())) if len(d) else 0.0
    if sigma == 0:
        return _top1_of_rows(ref, out, rows)
    flip = 0.5 * np.array([math.erfc(m / (sigma * math.sqrt(2))) for m in margin])
    return float(1 - flip.mean())


def _top1_of_rows(ref: np.ndarray, out: np.ndarray, rows: np.ndarray, chunk: int = 1 << 22) -> float:
    """top1_agreement of `rows` of two [N, C] arrays, a few rows at a time."""
    if not len(rows):
        return 1.0
    step, same = max(1, chunk // max(ref.shape[1], 1)), 0
    for s in range(0, len(rows), step):
        k = rows[s:s + step]
        same += int((ref[k].argmax(1) == out[k].argmax(1)).sum())
    return same / len(rows)


def nonzero_rows(a: np.ndarray, chunk: int = 1 << 22) -> np.ndarray:
    """Whether each row of [N, C] `a` holds a value other than zero, a few rows at a time (no temporary as
    large as `a`): a row of zeros in a reference output is a shorter sample's padding (samples.py joins
    samples of several lengths zero-padded), not a distribution."""
    step = max(1, chunk // max(a.shape[1], 1))
    return np.concatenate([(a[s:s + step] != 0).any(axis=1) for s in range(0, len(a), step)]) if len(a) else \
        np.zeros(0, bool)


def position_agreement(ref, out) -> float:
    """Predicted top-1 agreement (predicted_agreement) over every position's distribution on
    the last axis: [N, C] a classifier's samples, [N, T, C] each sample's T positions. A row of
    zeros in `ref` is a shorter sample's padding (samples.py joins samples of several lengths
    zero-padded), no distribution: left out. As positions, they were ties (flipped with probability
    1/2) and their int8 noise set the spread (PP-OCRv4's recognizer: 0.944 for every method)."""
    c = ref.shape[-1]
    r, o = ref.reshape(-1, c), out.reshape(-1, c)
    real = nonzero_rows(r)
    if not real.any():
        return 1.0  # (nothing but padding: no position to disagree on)
    return predicted_agreement(r, o) if real.all() else predicted_agreement(r, o, rows=np.flatnonzero(real))


def position_top1_agreement(ref, out) -> float:
    """Top-1 agreement counted over every position's distribution on the last axis (as
    position_agreement, but counted)."""
    c = ref.shape[-1]
    return top1_agreement(ref.reshape(-1, c), out.reshape(-1, c))


def kl_each(ref: np.ndarray, out: np.ndarray, log: bool = False, chunk: int = 1 << 22) -> np.ndarray:
    """KL(ref || out) of each row of two distributions over the last axis ([N, C] or [N, T, C]:
    per sample, the mean over its T positions), given as probabilities (a Softmax's output) or as
    log-probabilities (`log`: a LogSoftmax's), in nats; a few rows at a time."""
    ref, out = np.asarray(ref), np.asarray(out)
    per = int(np.prod(ref.shape[1:-1], dtype=np.int64)) if ref.ndim > 2 else 1
    c = ref.shape[-1]
    r2, o2 = ref.reshape(-1, c), out.reshape(-1, c)
    kl = np.empty(len(r2))
    step = max(1, chunk // max(c, 1))
    for s in range(0, len(r2), step):
        a, b = np.asarray(r2[s:s + step], np.float64), np.asarray(o2[s:s + step], np.float64)
        la, lb = (a, b) if log else (np.log(np.clip(a, 1e-12, None)), np.log(np.clip(b, 1e-12, None)))
        kl[s:s + step] = (np.exp(la) * (la - lb)).sum(axis=1)
    return kl.reshape(len(ref), per).mean(axis=1)


def wilson(k: int, n: int, z: float = 1.96) -> tuple:
    """95 % interval of a proportion k / n: how much a count over n images can say."""
    if n == 0:
        return (0.0, 1.0)
    p, d = k / n, 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


# greedy CTC decoding, the one place it is done (eval's text agreement, quantize's verification)
CTC_MIN_BLANK_SHARE = 0.5  # a CTC recognizer's top-1 is its blank at most positions
# ... and each symbol is a spike of a step or two between blanks (fp32's mean run: PP-OCRv5 1.02, PP-OCRv2
# 1.08, a captcha CRNN 1.0), where a per-step classifier's background class frames events many steps long
# (a seizure detector's 0.5 s decisions, a VAD): collapsing those repeats would hide a moved onset
CTC_MAX_RUN = 2.0


def _mean_run(paths: list, blank: int) -> float:
    """Mean length of the runs of one non-blank class along fp32's top-1 paths (0 with none)."""
    lengths = []
    for p in paths:
        p = np.asarray(p)
        if not p.size:
            continue
        starts = np.flatnonzero(np.r_[True, p[1:] != p[:-1]])
        sizes = np.diff(np.r_[starts, len(p)])
        lengths.append(sizes[p[starts] != blank])
    lengths = np.concatenate(lengths) if lengths else np.zeros(0)
    return float(lengths.mean()) if lengths.size else 0.0


def ctc_blank(paths: list) -> int | None:
    """The blank of fp32's top-1 paths (one int array per sequence) where they look like CTC: one class
    is the top-1 at over half of all positions, and the others come as spikes (CTC_MAX_RUN); else None."""
    if not paths:
        return None
    ref = np.concatenate([np.asarray(p).ravel() for p in paths])
    if not ref.size:  # (empty sequences)
        return None
    counts = np.bincount(ref)
    blank = int(counts.argmax())
    if counts[blank] < CTC_MIN_BLANK_SHARE * len(ref):
        return None
    if _mean_run(paths, blank) > CTC_MAX_RUN:  # a frame classifier's events, not CTC's spikes
        return None
    return blank


def ctc_collapse(path: np.ndarray, blank: int) -> tuple:
    """Greedy CTC decoding of one top-1 path: repeats merged, then blanks dropped."""
    keep = np.ones(len(path), bool)
    keep[1:] = path[1:] != path[:-1]
    return tuple(int(c) for c in path[keep] if c != blank)


# what an output means, read from its shape and fp32's values (eval's figures, quantize's verification)
UNIT_ROWS_MIN = 16  # vectors this long or longer, all of length 1, are embeddings (not 2-4 probabilities)


def agreement_kind(shape) -> str | None:
    """What top-1 agreement means for an output of this shape: "class" ([N, C], C > 1: a classifier),
    "position" ([N, T, C], C > 1, not a detector's rows: a distribution at each position, as a CTC
    recognizer or a tagger writes), or None (maps, features, boxes)."""
    shape = tuple(shape)
    if len(shape) == 2 and shape[1] > 1:
        return "class"
    if len(shape) == 3 and shape[2] > 1 and not detector_like(shape):
        return "position"
    return None


def is_distribution(a: np.ndarray, tol: float = 1e-2) -> bool:
    """Whether every row along the last axis is a probability distribution (a softmax's output)."""
    return a.size > 0 and a.shape[-1] > 1 and bool(a.min() >= 0 and a.max() <= 1 + tol
                                                   and np.abs(a.sum(-1) - 1).max() <= tol)


def is_log_distribution(a: np.ndarray, tol: float = 1e-2) -> bool:
    """Whether every row along the last axis holds log-probabilities (a LogSoftmax's output)."""
    if a.size == 0 or a.shape[-1] < 2 or a.max() > tol:
        return False
    m = a.max(-1, keepdims=True)
    return bool(np.abs(np.log(np.exp(a - m).sum(-1)) + m[..., 0]).max() <= tol)


def output_kind(a: np.ndarray) -> tuple:
    """(agreement kind, detector layout) of an output from its shape and fp32 values: a [N, T, C] whose
    every row is a distribution (or log-probabilities) is a sequence of them (SLANet's 501 structure tokens x 30 classes would
    otherwise pass for a detector's rows); a few values per position that are not one (SLANet's 4 box
    coordinates) are no classes."""
    if a.ndim == 3 and (is_distribution(a) or is_log_distribution(a)):
        # (pyannote's segmentation: a LogSoftmax over 7 classes at each of 293 frames, no detector rows)
        return "position", None
    kind = agreement_kind(a.shape)
    if kind == "position" and a.shape[2] < 5:
        kind = None
    if kind == "position" and a.size and a.min() >= 0.0 and a.max() <= 1.0 and not is_distribution(a):
        # values in [0, 1] that are no distribution: independent gains or scores at each position (NSNet2's
        # suppression gain per frequency bin, [N, frames, 161]; a multi-label tagger), not one class each.
        # eval printed "sequences equal at every position 0.0000" for an enhancer as good as fp32
        kind = None
    if kind == "position" and a.shape[1] == 1 and not is_log_distribution(a):
        # one position of numbers that are no scores: a recurrent net's state [1, 1, 128] (its h and c)
        # or a decoder's hidden vector, where "top-1 per position" means nothing
        kind = None
    return kind, detector_like(a.shape)


def detector_like(shape) -> str | None:
    """"rows" for [N, R, K]: many rows (R >= 50) of a few columns (5 <= K <= 128), as YOLOv5/X heads
    write (x, y, w, h, objectness, class scores); "columns" for [N, K, R], the same transposed, as
    YOLOv8 and later write (x, y, w, h, class scores: no objectness); None otherwise."""
    if len(shape) != 3:
        return None
    if shape[1] >= 50 and 5 <= shape[2] <= 128:
        return "rows"
    if 5 <= shape[1] <= 128 and _anchor_count(shape[2]):
        return "columns"
    return None


def _anchor_count(r: int) -> bool:
    """Whether r cells fill the grids of strides 8, 16, 32 (and 64) of an image whose sides are multiples
    of the largest stride: a multi-scale detection head's anchors (2100 at 320x320, 8400 at 640x640),
    which a recognizer's class count (6625, 97) is not."""
    return r >= 21 and ((r * 1024) % 21 == 0 or (r * 4096) % 85 == 0)


# an encoder's vectors (a sentence's, an image's, a token's): judged as a search index would use them, over
# the whole evaluation set (an argmax over a vector's coordinates picks its largest feature, which means nothing)
PAIR_SAMPLES_MAX = 2000  # the rank correlation of pair similarities is taken over at most this many samples


def cosine_each(ref: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The cosine of each pair of rows along the last axis (float64, flattened over the other axes); 1 where
    both rows are zero, 0 where one is."""
    c = ref.shape[-1]
    a, b = np.asarray(ref, np.float64).reshape(-1, c), np.asarray(out, np.float64).reshape(-1, c)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    cos = (a * b).sum(1) / np.maximum(na * nb, 1e-300)
    return np.where((na == 0) & (nb == 0), 1.0, np.where((na == 0) | (nb == 0), 0.0, cos))


def mean_pool(states: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Token states [N, T, H] into one vector per sample [N, H]: the mean over the positions the mask ([N, T],
    nonzero: a real token) keeps, as sentence encoders pool; over every position without a mask."""
    s = np.asarray(states, np.float64)
    if mask is None:
        return s.mean(axis=1)
    m = (np.asarray(mask).reshape(s.shape[:2]) != 0).astype(np.float64)
    return (s * m[..., None]).sum(axis=1) / np.maximum(m.sum(axis=1), 1.0)[:, None]


def _unit(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, np.float64).reshape(len(v), -1)
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-300)


def nearest_others(vectors: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """Each sample's nearest other sample by cosine (index [N]; ties to the lower index), a block of rows at a
    time (10 000 samples: an N x N similarity matrix would take 800 MB)."""
    u = _unit(vectors)
    near = np.empty(len(u), np.int64)
    for s in range(0, len(u), chunk):
        sim = u[s:s + chunk] @ u.T
        sim[np.arange(len(sim)), np.arange(s, s + len(sim))] = -np.inf
        near[s:s + chunk] = sim.argmax(1)
    return near


def neighbour_agreement(ref: np.ndarray, out: np.ndarray) -> float:
    """The share of samples whose nearest other sample (by cosine, among the same model's vectors) is the one
    fp32's vectors say: what a search over int8 vectors returns first, unchanged (1.0 under 2 samples)."""
    if len(ref) < 2:
        return 1.0
    return float((nearest_others(ref) == nearest_others(out)).mean())


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 0, ties given their mean rank."""
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x), np.float64)
    r[order] = np.arange(len(x))
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    if len(counts) < len(x):
        r = (np.bincount(inv, weights=r) / counts)[inv]
    return r


def pair_spearman(ref: np.ndarray, out: np.ndarray) -> float | None:
    """Spearman rank correlation of the cosine similarities of every pair of samples (of the first
    PAIR_SAMPLES_MAX) under int8 against under fp32: whether int8 orders the whole set's pairs as fp32 does,
    where the nearest neighbour sees one pair per sample. None under 3 samples (fewer than 3 pairs)."""
    n = min(len(ref), PAIR_SAMPLES_MAX)
    if n < 3:
        return None
    a, b = _unit(ref[:n]), _unit(out[:n])
    upper = np.triu_indices(n, 1)
    ra, rb = _ranks((a @ a.T)[upper]), _ranks((b @ b.T)[upper])
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / den) if den > 0 else 1.0


def vector_figures(ref: np.ndarray, out: np.ndarray) -> dict:
    """An encoder's figures over a set of samples, one vector each ([N, H]): cosine to fp32 per sample (mean,
    worst), nearest-neighbour agreement, Spearman of all pair similarities, and SQNR as a secondary figure."""
    cos = cosine_each(ref, out)
    return {"cosine": {"mean": float(cos.mean()), "worst": float(cos.min())} if len(cos) else None,
            "neighbour_agreement": neighbour_agreement(ref, out), "pair_spearman": pair_spearman(ref, out),
            "sqnr_db": sqnr_db(ref, out), "samples": len(ref)}
