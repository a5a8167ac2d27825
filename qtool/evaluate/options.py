"""How `qtool eval` evaluates: one frozen options object, built by the command and by qtool.api."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvalOptions:
    """`config`: preprocessing for images (a preset name, a TOML path or a config; None: calibrate's, else
    the model's metadata). `labels`: class names one per line (None: class folders, where there are).
    `limit`: at most this many samples. `runtime`: "ort", or "native"/"both" to run the int8 model on qtool's
    runtime too (images). `latency`: time both models on one sample. `check`: compare ONNX Runtime's int8
    output with the exact int8 arithmetic (exact.ExactCheck). `task`: what outputs mean where the guess is
    wrong, entries "TASK" (every output) or "OUTPUT=TASK" (qtool.tasks; the guess is printed). `ray`: the
    models' runs over the samples on a Ray cluster (None: here; "local", "auto" or an address:
    distributed/cluster.py), with the figures one process gets; the latency is timed here."""
    labels: str | None = None
    config: object = None
    limit: int | None = None
    threads: int = 2
    runtime: str = "ort"
    latency: bool = True
    check: bool = True
    task: tuple = ()
    ray: str | None = None
