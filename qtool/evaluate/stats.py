"""One output of the model, int8 against fp32, compared batch by batch: what it is (kinds/) decides its figures.
Only the figures are kept, never the outputs."""
from __future__ import annotations

import numpy as np

from qtool.evaluate.kinds import EQUAL, First, equal_kind, numeric_kinds
from qtool.evaluate.kinds.maps import Magnitude
from qtool.evaluate.meaning import Meaning


class OutputStats:
    """Streaming comparison of one output: SQNR, max abs error, and the figures of its kinds."""

    def __init__(self, name: str, top_rows=(1, 10, 100), state: bool = False, meaning: Meaning | None = None):
        """`state`: a recurrent layer's last hidden or cell state (recurrent_states), vectors and no classes.
        `meaning`: what the graph and the user say the output is (meaning.output_meanings; it holds `state`)."""
        self.name, self.top_rows = name, top_rows
        self.meaning = meaning or Meaning(state=state)
        self.first = None  # what the first batch showed (kinds.First): the task it is judged as
        self.n = 0
        self.shape = None
        self.equal: dict = {}  # kind -> accumulator, for strings and ids (compared by equality)
        self.magnitude = Magnitude()
        self.kinds: list = []  # what the output is: decided on the first batch (kinds.numeric_kinds)
        self.mismatch = 0  # batches whose int8 output has another shape than fp32's (not compared)
        self.mismatch_shapes = None
        self.not_finite = self.finite_differs = 0  # positions NaN/inf in either; in one only

    def add(self, a: np.ndarray, b: np.ndarray, samples: int | None = None, mask=None) -> None:
        """`samples`: how many samples the batch holds, where known: a [T, N, C] output (sequence
        first, as many CRNN exports write) is then read as N sequences of T positions. `mask`: the batch's
        attention mask [N, T], where the model takes one (an encoder's token states are pooled over it)."""
        if isinstance(a, list) or isinstance(b, list):  # a sequence output: its tensors' values, end to end
            a, b = (np.concatenate([np.ravel(x) for x in v]) if len(v) else np.zeros(0, np.float32) for v in (a, b))
        a, b = np.asarray(a), np.asarray(b)
        by_equality = equal_kind(a, b)
        if by_equality is not None:
            self.equal.setdefault(by_equality, by_equality()).add(a, b)
            return
        if a.shape != b.shape:
            # never broadcast one on the other (a figure for a broken graph); a detector's count of boxes
            # may differ honestly, so this is counted and said, not an error
            self.mismatch += 1
            self.mismatch_shapes = self.mismatch_shapes or (list(a.shape), list(b.shape))
            return
        if samples is not None and a.ndim == 3 and a.shape[0] != samples and a.shape[1] == samples:
            a, b = a.swapaxes(0, 1), b.swapaxes(0, 1)
        a64, b64 = self._finite(np.asarray(a, np.float64), np.asarray(b, np.float64))
        self._track_shape(a.shape)
        self.magnitude.add(a64, b64)
        if not self.n:
            self.first = First.of(a64, self.meaning.state, self.top_rows, self.meaning)
            self.kinds = numeric_kinds(self.first)
        self.n += len(a64) if a64.ndim else 1
        for kind in self.kinds:
            if getattr(kind, "reads_mask", False):
                kind.add(a64, b64, mask)
            else:
                kind.add(a64, b64)

    def _finite(self, a64: np.ndarray, b64: np.ndarray) -> tuple:
        """NaN where the model masks an entry by design (caustic-nmr's shifts of atoms a residue lacks):
        compared where both are finite, and counted; a NaN made the noise NaN, reported as exact."""
        fa, fb = np.isfinite(a64), np.isfinite(b64)
        if fa.all() and fb.all():
            return a64, b64
        both = fa & fb
        self.not_finite += int(both.size - both.sum())
        self.finite_differs += int((fa != fb).sum())
        return np.where(both, a64, 0.0), np.where(both, b64, 0.0)

    def _track_shape(self, shape: tuple) -> None:
        """A size that changes between samples is a length ("?"), never a set of classes."""
        if self.shape is not None and len(self.shape) == len(shape):
            self.shape = [d if d == e or k == 0 else "?" for k, (d, e) in enumerate(zip(self.shape, shape))]
            if self.shape and self.shape[-1] == "?":
                self.kinds = [k for k in self.kinds if not k.per_class]
        else:
            self.shape = list(shape)

    def result(self) -> dict:
        for kind in EQUAL:  # (strings before ids)
            if kind in self.equal:
                return self.equal[kind].result()
        r = {"shape": self.shape, **self.magnitude.result(self.shape is not None)}
        if self.first is not None:  # (what it was judged as, and why: the guess, or the user's --task)
            r["task"], r["task_from"] = self.first.task, self.first.why
        if self.mismatch:
            r["shape_mismatch"] = {"batches": self.mismatch, "fp32": self.mismatch_shapes[0],
                                   "int8": self.mismatch_shapes[1]}
        if self.not_finite:
            r["not_finite"] = {"positions": self.not_finite, "finite_in_one_only": self.finite_differs}
        for kind in self.kinds:
            r.update(kind.result())
        return r


def headline(results: list) -> dict:
    """The output whose figures head the report: the first numeric one. A model that only writes text
    gets an SQNR of inf when every string matched and NaN when not (strings have no error size)."""
    for r in results:
        if "sqnr_db" in r:
            return r
    same = all(r.get("equal_fraction", r.get("labels_equal")) == 1.0 for r in results)
    head = {"sqnr_db": float("inf") if same else float("nan"), "max_abs_error": 0.0}
    ids = next((r for r in results if "labels_equal" in r), None)
    if ids is not None:  # (a tagger that writes only its tags: how many it keeps is its top-1 agreement)
        head["top1_agreement"] = ids["labels_equal"]
    return head
