"""Speed: each model's latency on ONNX Runtime (and on qtool's runtime), in ms for one sample."""
from __future__ import annotations

import time

import numpy as np

LATENCY_SECONDS = 5.0  # past this, three timed runs do (CRAFT at 960x1280: 5.5 s a run in fp32)


def latency_ms(run, x, repeats: int = 10, budget_s: float = LATENCY_SECONDS) -> float:
    """Median of up to `repeats` runs of `run(x)` after one warm-up, fewer past `budget_s` (at least three)."""
    run(x)
    ts = []
    while len(ts) < repeats and (len(ts) < 3 or sum(ts) < budget_s):
        t = time.perf_counter()
        run(x)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1000


def ort_latency(sf, sq, sample: dict) -> dict:
    """ONNX Runtime's fp32 (`sf`) and int8 (`sq`) sessions, timed on `sample`."""
    return {"ort_fp32": latency_ms(lambda x: sf.run(None, x), sample),
            "ort_int8": latency_ms(lambda x: sq.run(None, x), sample)}


class RunTimes:
    """Seconds each session took per evaluation run: at one sample a run, these are the latencies."""

    def __init__(self):
        self.runs = {"ort_fp32": [], "ort_int8": []}

    def run(self, key: str, sess, names: list, feeds: dict) -> list:
        t = time.perf_counter()
        out = sess.run(names, feeds)
        self.runs[key].append(time.perf_counter() - t)
        return out

    def enough(self) -> bool:
        return len(self.runs["ort_fp32"]) > 3

    def latency_ms(self) -> dict:
        """The median run, the first one (warm-up) left out."""
        return {k: float(np.median(v[1:])) * 1000 for k, v in self.runs.items()}
