"""One model's job: its three steps, each `python -m qtool STEP ...` in a process of its own under the
model's limits, one after another in its working folder; then its row of the table. Whatever happens
to the model (a corrupt file, a step that fails, a step killed past the memory limit) is the row's
status and one-line reason, never an exception: the batch goes on with the next model.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import threading
from dataclasses import dataclass

from qtool.batch.catalogue import Entry
from qtool.batch.watch import Bounds, run_watched

INT8 = "model.int8.onnx"  # quantize's default output in the working folder
EVAL_JSON = "eval.json"  # what eval writes there with --json (quantize writes quantize.json itself)
EVAL_FIGURES = ("output_sqnr_db", "top1_agreement", "max_abs_error")


@dataclass(frozen=True)
class Job:
    """A catalogue entry, the working folder its steps share (emptied first: a row is never made of an
    earlier run's files) and its steps' command lines: ((step, argv after `qtool`), ...)."""
    entry: Entry
    workdir: str
    lines: tuple


def new_row(job: Job) -> dict:
    """A row before its job runs: status ok until a step says otherwise."""
    return {"name": job.entry.name, "status": "ok", "step": None, "reason": "", "workdir": job.workdir, "int8": None,
            "memory_mb": job.entry.limits.memory_mb, "steps": {}, "size": None, "eval": None}


def run_job(job: Job, cancel: threading.Event | None = None) -> dict:
    e = job.entry
    row = new_row(job)
    try:
        shutil.rmtree(job.workdir, ignore_errors=True)
        os.makedirs(job.workdir)
    except OSError as err:  # (a read-only --out, a full disk: this model's row, the next may fare better)
        row.update(status="failed", reason=f"{job.workdir}: cannot make the working folder ({err.strerror or err})")
        return row
    bounds = Bounds(e.limits.memory_mb, e.limits.timeout_s, cancel)
    for step, argv in job.lines:
        run = run_watched([sys.executable, "-m", "qtool"] + argv, bounds)
        row["steps"][step] = run.record()
        row["steps"][step]["command"] = shlex.join(["qtool"] + argv)  # what a user would type
        if not run.ok:
            row.update(status="killed" if run.killed else "failed", step=step, reason=run.why())
            break
    row.update(size=size(job.workdir), eval=figures(job.workdir) if row["status"] == "ok" else None)
    if row["steps"].get("quantize", {}).get("rc") == 0:
        row["int8"] = os.path.join(job.workdir, INT8)
    return row


def _read(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def size(workdir: str) -> dict | None:
    """fp32 and int8 bytes, as quantize recorded them."""
    q = _read(os.path.join(workdir, "quantize.json")) or {}
    sb = q.get("size_bytes") or {}
    if not (sb.get("fp32") and sb.get("int8")):
        return None
    return {"fp32": sb["fp32"], "int8": sb["int8"], "ratio": sb["int8"] / sb["fp32"]}


def figures(workdir: str) -> dict | None:
    """The eval figures the table shows (eval.json in the working folder has them all)."""
    ev = _read(os.path.join(workdir, EVAL_JSON))
    if ev is None:
        return None
    out = {k: ev[k] for k in EVAL_FIGURES if ev.get(k) is not None}
    out["samples"] = ev.get("n_images", ev.get("n_samples"))
    for k in ("fp32", "int8"):
        if isinstance(ev.get(k), dict) and "top1" in ev[k]:
            out[f"{k}_top1"] = ev[k]["top1"]
    return out
