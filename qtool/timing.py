"""Seconds per phase of a run, for `-v` and `--json`: where a command's time goes. Read by people
only: no decision of qtool ever depends on them (the same inputs give the same int8 model)."""
from __future__ import annotations

import contextlib
import time


class Phases:
    """`with phases("fuse"): ...` times a block; `phases.lap("write")` ends the phase running (if any)
    and starts another, for steps that follow one another in a function; `stop()` ends the last."""

    def __init__(self):
        self.seconds: dict = {}  # phase -> seconds, in the order first met (a phase met again adds up)
        self._open = None  # (name, start) of the phase lap() started

    def _add(self, name: str, t: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self._add(name, t)

    def lap(self, name: str) -> None:
        self.stop()
        self._open = (name, time.perf_counter())

    def stop(self) -> dict:
        if self._open is not None:
            self._add(*self._open)
            self._open = None
        return self.seconds
