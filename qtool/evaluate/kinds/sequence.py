"""A sequence of distributions [N, T, C] (a CTC recognizer, a tagger, a frame classifier): top-1 agreement
per position, the share of sequences equal at every position, and where the outputs look like CTC
(metrics.ctc_blank) the share whose greedy-decoded texts are equal."""
from __future__ import annotations

import numpy as np

from qtool.metrics import ctc_blank, ctc_collapse


def ctc_agreement(paths: list) -> dict:
    """Where the outputs look like CTC (metrics.ctc_blank), the share of sequences whose greedy-decoded
    texts are equal: what a reader of the text sees, where "equal at every position" also counts a blank
    moved by one step. {} where they do not."""
    blank = ctc_blank([p for p, _ in paths])
    if blank is None:
        return {}
    same = sum(ctc_collapse(p, blank) == ctc_collapse(q, blank) for p, q in paths)
    return {"ctc_text_agreement": same / len(paths), "ctc_blank": blank}


class Sequence:
    per_class = True

    @staticmethod
    def recognises(first) -> bool:
        # (classes at each position: a classifier's, told so by --task, are read the same way)
        return first.task in ("sequence", "classifier") and first.agreement == "position"

    def __init__(self, first):
        self.n = self.same = self.positions = self.seq_same = 0
        self.paths: list = []  # per sequence: (fp32's, int8's) top-1 class at each position (int32, small)

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        ia, ib = a.argmax(-1), b.argmax(-1)  # [N, T]
        eq = ia == ib
        self.n += len(a) if a.ndim else 1
        self.same += int(eq.sum())
        self.positions += eq.size
        self.seq_same += int(eq.all(axis=1).sum())
        self.paths += list(zip(ia.astype(np.int32), ib.astype(np.int32)))

    def result(self) -> dict:
        r = {"top1_agreement": self.same / max(self.positions, 1), "agreement_over": "positions",
             "sequence_agreement": self.seq_same / max(self.n, 1)}
        r.update(ctc_agreement(self.paths))
        return r
