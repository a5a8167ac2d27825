"""One step of `quantize`'s pipeline (pipeline.py): what it is called, when it runs, which calibration
samples it reads, and what the model gets if it fails.

A step with a `fallback` is optional: the runner times and contains it (optional.py): should `run`
raise, `undo` puts back what the model had, the fallback is recorded and warned about, and the
pipeline goes on. `before` and `after` run outside that containment: what the user must see whatever
the step does (a note, a labels file read), and what follows from its result (its verification on
held-out samples, which is contained as a step of its own). A step without a fallback is required:
its error is the command's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def always(run) -> bool:
    """always"""
    return True


def no_samples(run) -> tuple:
    """-"""
    return ()


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable  # (QuantizeRun) -> None: writes what it finds into the run
    when: Callable = always  # (QuantizeRun) -> bool; its docstring says when, in the pipeline's table
    samples: Callable = no_samples  # (QuantizeRun) -> parts of the SampleSplit it reads (split.PARTS); docstring
    fallback: str | None = None  # what the model gets if it fails; None: a required step
    undo: Callable | None = None  # (QuantizeRun) -> None: the fallback put in place
    before: Callable | None = None
    after: Callable | None = None
    layer_fallback: str | None = None  # a layer's fallback, for a step that goes on without that layer
    budgeted: bool = True  # its samples count in the budget (steps/budget.py)

    def execute(self, run) -> None:
        if self.before is not None:
            self.before(run)
        if self.fallback is None:
            self.run(run)
        else:
            run.steps.run(self.name, self.run, run, fallback=lambda: self.undo(run) if self.undo else None)
        if self.after is not None:
            self.after(run)


def first_line(fn) -> str:
    """The first line of a function's docstring (what the pipeline's table says of it)."""
    return (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
