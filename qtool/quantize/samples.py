"""Calibration samples decoded once, with their fp32 outputs computed once, for every step of quantize.

Method choice, rounding, range tuning, sensitivity and the exclusion check each use a subset of
the calibration samples; a SampleSet holds the inputs of those samples and the fp32 model's first
output for each, and hands out subsets without decoding an image or running fp32 again.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np

BATCH = 16


@dataclass
class SampleSet:
    names: list  # file (or sample) names, one per sample
    inputs: dict  # input name -> array [N, ...]
    reference: np.ndarray  # the fp32 model's first output, [N, ...]
    batch: int = BATCH
    fixed_batch: bool = False  # the model's batch dimension is fixed: every feed has exactly `batch`

    def __len__(self):
        return len(self.names)

    @property
    def feeds(self) -> list:
        n = len(self.names)
        return [{k: v[a:a + self.batch] for k, v in self.inputs.items()} for a in range(0, n, self.batch)]

    def subset(self, index) -> "SampleSet":
        """The samples at `index`; for a model with a fixed batch, whole batches of them only (the
        rest left out), so every feed, output and reference row lines up."""
        idx = np.asarray(index, np.int64)
        if self.fixed_batch:
            idx = idx[:len(idx) - len(idx) % self.batch]
        return SampleSet([self.names[i] for i in idx], {k: v[idx] for k, v in self.inputs.items()},
                         self.reference[idx] if len(self.reference) else self.reference, self.batch, self.fixed_batch)

    def pick(self, names: list) -> "SampleSet":
        pos = {n: i for i, n in enumerate(self.names)}
        return self.subset([pos[n] for n in names if n in pos])


def load_samples(fused, table, files: list, threads: int = 0, progress=None) -> SampleSet:
    """Decode `files` with the calibration's preprocessing and run the fp32 graph on them once;
    `progress(k)` is told of k more samples decoded, then of k more run."""
    from qtool.data.config import config_from_any
    from qtool.data.sources import ImageData

    if not files:
        return SampleSet([], {}, np.zeros((0,)))
    data = ImageData(os.path.dirname(files[0]), config_from_any(table.config), fused, table.model_path,
                     batch=BATCH, files=files)
    by_shape = {}  # a dynamic model's samples may differ in size: (each sample's input shapes) -> (names, parts)
    for n, f in data.batches():
        names, parts = by_shape.setdefault(tuple((k, v.shape[1:]) for k, v in sorted(f.items())), ([], {}))
        names.extend(n)
        for k, v in f.items():
            parts.setdefault(k, []).append(v)
        if progress:
            progress(len(n))
    names, parts = max(by_shape.values(), key=lambda np_: len(np_[0]), default=([], {}))
    if len(by_shape) > 1:
        warnings.warn(f"the calibration samples come in {len(by_shape)} input sizes; the {len(names)} of the most "
                      f"common size are used for method choice, rounding, range tuning and sensitivity "
                      f"(calibration saw them all)", stacklevel=2)
    skipped = len(files) - sum(len(ns) for ns, _ in by_shape.values())
    if not names:
        warnings.warn(f"none of the {len(files)} calibration samples can be read now (first: {files[0]}); the steps "
                      f"that need them are skipped", stacklevel=2)
        return SampleSet([], {}, np.zeros((0,)))
    if skipped:
        warnings.warn(f"{skipped} of {len(files)} calibration samples can no longer be read; using the other "
                      f"{len(names)}", stacklevel=2)
    inputs = {k: np.concatenate(v) for k, v in parts.items()}
    from qtool import graph as G
    fixed = [d[0] for d in (G.input_dims(i) for i in G.real_inputs(fused)) if d and isinstance(d[0], int)]
    s = SampleSet(names, inputs, np.zeros((0,)), fixed[0] if fixed else BATCH, bool(fixed))
    s = s.subset(range(len(names)))  # (a fixed batch: whole batches only)
    if not len(s):
        warnings.warn(f"the model takes exactly {s.batch} samples at a time and only {len(names)} calibration "
                      f"samples are here; the steps that need them are skipped", stacklevel=2)
        return s
    from qtool.ortsession import session
    sess = session(fused, threads, where=f"{table.model_path} (fused)")
    out = sess.get_outputs()[0].name
    ys = []
    for f in s.feeds:
        ys.append(sess.run([out], f)[0])
        if progress:
            progress(len(next(iter(f.values()))))
    s.reference = np.concatenate(ys)
    return _finite_only(s)


def _finite_only(s: SampleSet) -> SampleSet:
    """The samples whose inputs and fp32 output are all finite: a NaN/inf sample would make every
    SQNR and agreement NaN (calibration left its values out of the ranges the same way)."""
    ok = np.ones(len(s.names), bool)
    for v in list(s.inputs.values()) + [s.reference]:
        if np.issubdtype(v.dtype, np.floating):
            ok &= np.isfinite(v.reshape(len(v), -1)).all(axis=1)
    if ok.all():
        return s
    bad = [s.names[i] for i in np.flatnonzero(~ok)]
    warnings.warn(f"{len(bad)} calibration sample{'s' if len(bad) > 1 else ''} with NaN/inf in the input or the fp32 "
                  f"output left out: {', '.join(os.path.basename(str(b)) for b in bad[:5])}"
                  f"{', ...' if len(bad) > 5 else ''}", stacklevel=3)
    return s.subset(np.flatnonzero(ok))
