"""What an output is, and the figures that say how close int8 comes to fp32 on it: one module per kind.

Outputs of strings or of integers are compared by equality alone (EQUAL: the first kind that recognises a
batch by its dtypes). Every numeric output gets the magnitude figures (maps.Magnitude: SQNR, max |error|),
and the figures of each kind in KINDS that recognises fp32's first batch of it (a First), in this order. An
output may be of several kinds: a classifier's scores are vectors too (their cosine is reported beside
top-1 agreement), as a detector's rows are. A kind is a class with `recognises(first) -> bool`, made from the
First, with `add(a, b)` (fp32's and int8's batch, float64, finite where both are) and `result() -> dict`;
`per_class` kinds read an argmax over the last axis and are dropped when its size changes between samples;
`reads_mask` kinds get the batch's attention mask too (`add(a, b, mask)`). Which kinds recognise an output
follows the task it is judged as (First.task: the user's --task, else the guess; qtool.tasks names them).
Adding a kind is one module and one entry here.
"""
from __future__ import annotations

from qtool.evaluate.kinds import classifier, detector, embeddings, encoder, ids, sequence, text
from qtool.evaluate.kinds.first import First

EQUAL = (text.Text, ids.Ids)
KINDS = (embeddings.Vectors, encoder.Encoder, classifier.Classes, sequence.Sequence, detector.Rows)


def equal_kind(a, b):
    """The kind that compares this batch by equality (strings, ids), or None for numbers."""
    return next((k for k in EQUAL if k.recognises(a, b)), None)


def numeric_kinds(first: First) -> list:
    """An accumulator of each kind that recognises `first`."""
    return [k(first) for k in KINDS if k.recognises(first)]


__all__ = ["EQUAL", "KINDS", "First", "equal_kind", "numeric_kinds"]
