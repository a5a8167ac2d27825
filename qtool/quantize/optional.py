"""The optional steps of `quantize`, run in one place that times them and contains their failures.

Method choice, output-aware rounding, range tuning, sensitivity, exclusion and the target's cost
each make an int8 model better, or explain it; none is needed to write one. A failure inside one
(a bug of ours on a graph nobody tried, ONNX Runtime refusing an experiment's graph, memory) must
cost the user that improvement, not the model: the step falls back (each step says to what), one
warning line names the step, the layer and the error, and quantize.json records it. `strict`
(--strict, the test suite, `make zoo`) makes such a failure an error instead, so that no bug hides
behind a fallback. Errors in the user's input are found before these steps run and stay errors.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass

from qtool.errors import QtoolError


class StepError(QtoolError):
    """An optional step failed under --strict: a bug in qtool, not bad input (exit 70)."""

    exit_code = 70


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    if len(text) > 240:
        text = text[:237] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@dataclass
class Fallback:
    step: str
    error: str  # one line: the exception's type and message
    fallback: str  # what the model got instead
    layer: str | None = None

    def line(self) -> str:
        at = f" at layer {self.layer!r}" if self.layer else ""
        return f"{self.step} failed{at} ({self.error}); using {self.fallback}"

    def to_dict(self) -> dict:
        return asdict(self)


class OptionalSteps:
    """Runs the optional steps of one quantize run: `run` a whole step, `failed` for one layer of a
    step that goes on. Records each step's seconds and every fallback."""

    def __init__(self, fallbacks: dict, layer_fallbacks: dict | None = None, strict: bool = False, warn=None):
        """`fallbacks`: step -> what the model gets when it fails (pipeline.FALLBACKS); `layer_fallbacks`:
        step -> a layer's, for a step that goes on without that layer."""
        self.texts, self.layer_texts = fallbacks, layer_fallbacks or {}
        self.strict = strict
        self.warn = warn or (lambda text: warnings.warn(text, stacklevel=3))
        self.fallbacks: list = []
        self.seconds: dict = {}

    def run(self, step: str, fn, *args, fallback=None, **kwargs):
        """fn(*args, **kwargs), or `fallback` (a value, or a callable giving it) if it raises."""
        if step not in self.texts:
            raise ValueError(f"unknown optional step {step!r}")
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # (KeyboardInterrupt is no Exception: Ctrl-C still stops the run)
            self.failed(step, e)
            return fallback() if callable(fallback) else fallback
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - t0

    def failed(self, step: str, error: BaseException, layer: str | None = None) -> None:
        """Record (or, strict, raise) `step`'s failure; with `layer`, the step goes on without it."""
        if isinstance(error, StepError):
            raise error  # (already strict, from a layer inside this step)
        text = self.texts[step]
        f = Fallback(step, _one_line(error), self.layer_texts.get(step, text) if layer else text, layer)
        if self.strict:
            at = f" at layer {layer!r}" if layer else ""
            raise StepError(f"{step} failed{at} ({f.error}) and --strict is set (without it: {f.fallback}); "
                            f"this is a bug in qtool: please report it with the output of --debug") from error
        self.fallbacks.append(f)
        self.warn(f.line())

    def on_layer_error(self, step: str):
        """A callback (layer name, exception) for code that handles one layer at a time."""
        return lambda layer, error: self.failed(step, error, layer)

    def to_dict(self) -> dict:
        return {"fallbacks": [f.to_dict() for f in self.fallbacks],
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()}}
