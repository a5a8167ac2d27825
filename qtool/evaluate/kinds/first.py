"""What a numeric output's kinds are read from: fp32's first batch of it, what the graph says of it, and what
the user said it is (--task); the task it is judged as, and why."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool.metrics import detector_like, output_kind
from qtool.evaluate.kinds.embeddings import unit_rows
from qtool.evaluate.meaning import Meaning


@dataclass(frozen=True)
class First:
    values: np.ndarray  # fp32's first batch, float64 (samples first)
    state: bool  # a recurrent layer's last state (states.recurrent_states): vectors, no classes
    agreement: str | None  # metrics.output_kind's agreement kind: "class", "position" or None
    layout: str | None  # a detector head's layout ("rows", "columns") or None
    unit_rows: bool  # fp32's vectors all of length 1: an embedding
    top_rows: tuple  # the k of the detector figures' top-k rows
    task: str = "maps"  # what it is judged as (tasks.TASKS)
    why: str = ""  # ... and why: the user said so, or what the guess read
    encoder: str | None = None  # an encoder's "tokens" ([N, T, H], pooled over the mask) or "pooled" vectors
    mask: str | None = None  # the model's attention-mask input

    @classmethod
    def of(cls, a64: np.ndarray, state: bool, top_rows: tuple, meaning: Meaning | None = None) -> "First":
        meaning = meaning or Meaning(state=state)
        agreement, layout = output_kind(a64)
        unit = unit_rows(a64)
        if meaning.task is not None:
            task, why = meaning.task, "--task"
            agreement, layout = _as_told(task, a64.shape)
        else:
            task, why = _guess(a64, meaning, agreement, layout, unit)
            why = "guess: " + why
        encoder = None
        if task == "encoder" and a64.ndim >= 2:
            tokens = a64.ndim == 3 and (meaning.task is not None or unit or meaning.encoder.kind == "tokens")
            encoder = "tokens" if tokens else "pooled"
        return cls(a64, meaning.state, agreement, layout, unit, top_rows, task, why, encoder, meaning.mask)


def _guess(a64: np.ndarray, meaning: Meaning, agreement, layout, unit: bool) -> tuple:
    """(task, why) from the graph and fp32's values: an encoder's vectors where the graph shows them or every
    vector has length 1, else what output_kind reads from the shape and values."""
    if meaning.state:
        return "maps", "a recurrent layer's last state: vectors, no classes"
    if a64.ndim in (2, 3) and a64.shape[-1] >= 2:
        if meaning.encoder is not None:
            return "encoder", meaning.encoder.why
        if unit:
            return "encoder", "every vector has length 1: a normalized embedding"
    if layout is not None:
        return "detector", f"many rows of a few columns ({layout})"
    if agreement == "class":
        return "classifier", "scores over the last axis, one set per sample"
    if agreement == "position":
        return "sequence", "scores over the last axis at each position"
    return "maps", "no classes, rows or vectors the shape and values show"


def _as_told(task: str, shape: tuple) -> tuple:
    """(agreement, layout) of an output the user says is `task`, where its shape allows (else none: the task's
    figures are left out, the magnitude ones stay)."""
    nd = len(shape)
    if task == "classifier":
        return ("class" if nd == 2 else "position" if nd == 3 else None), None
    if task == "sequence":
        return ("position" if nd == 3 else None), None
    if task == "detector":
        return None, detector_like(shape) or ("rows" if nd == 3 else None)
    return None, None
