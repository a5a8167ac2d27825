"""What a numeric output's kinds are read from: fp32's first batch of it, and what the graph says of it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool.metrics import output_kind
from qtool.evaluate.kinds.embeddings import unit_rows


@dataclass(frozen=True)
class First:
    values: np.ndarray  # fp32's first batch, float64 (samples first)
    state: bool  # a recurrent layer's last state (states.recurrent_states): vectors, no classes
    agreement: str | None  # metrics.output_kind's agreement kind: "class", "position" or None
    layout: str | None  # a detector head's layout ("rows", "columns") or None
    unit_rows: bool  # fp32's vectors all of length 1: an embedding
    top_rows: tuple  # the k of the detector figures' top-k rows

    @classmethod
    def of(cls, a64: np.ndarray, state: bool, top_rows: tuple) -> "First":
        agreement, layout = output_kind(a64)
        return cls(a64, state, agreement, layout, unit_rows(a64), top_rows)
