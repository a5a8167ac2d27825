"""Calibration samples decoded once, with their fp32 outputs computed once, for every step of quantize.

Method choice, rounding, range tuning, sensitivity and the exclusion check each use a subset of
the calibration samples; a SampleSet holds the inputs of those samples and the fp32 model's first
output for each, and hands out subsets without decoding an image or running fp32 again.
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass

import numpy as np

from qtool import graph as G
from qtool.metrics import is_distribution, is_log_distribution, nonzero_rows

BATCH = 16
# a run's activations grow with its inputs: batches hold at most this many input bytes (8 images at
# 640x640; BATCH at 224x224), so that a 624x624 classifier's experiments, two at a time in one shared
# arena, do not hold 16 of its images' activations each (hx8: --exclude-sensitive at 4.1 GB on a 6.7 MB
# model; 2.45 GB in batches of 8, 1.98 in 4). Smaller batches cost time: PicoDet's quantize (800x608)
# 32.5 s in 16, 34.0 in 6, 36.8 in 3; YOLO26n 33.7 s in 1, 31.3 in 4
BATCH_BYTES = 8 * 3 * 640 * 640 * 4
# ... and the largest tensors a run holds for one sample, from the shapes at the samples' size, at most
# this many bytes a batch: an upscaler's activations outgrow its input (waifu2x's CUNet, 292 x 292 in and
# 64 channels at twice that: 10 samples in one run, quantize at 5.7 GB; its copy with a fixed batch of 1: 2.0)
ACT_BYTES = 256 << 20
LARGEST = 3  # tensors of the largest size alive at once (a U-Net's skip and the two around a convolution)


def _batch_for(inputs: dict, fused=None) -> int:
    per_sample = sum(v[0].nbytes for v in inputs.values() if len(v))
    size = max(1, min(BATCH, BATCH_BYTES // max(per_sample, 1)))
    if fused is not None and inputs:
        shapes = G.inferred_shapes(fused, {k: (1,) + v.shape[1:] for k, v in inputs.items()})
        sizes = sorted((int(np.prod(d)) for d in shapes.values() if d and all(isinstance(x, int) for x in d)),
                       reverse=True)
        act = 4 * sum(sizes[:LARGEST])
        if act:
            size = max(1, min(size, ACT_BYTES // act))
    return size


@dataclass
class SampleSet:
    names: list  # file (or sample) names, one per sample
    inputs: dict  # input name -> array [N, ...]
    reference: np.ndarray  # the fp32 model's first output, [N, ...]
    batch: int = BATCH
    fixed_batch: bool = False  # the model's batch dimension is fixed: every feed has exactly `batch`
    # where the samples lie in the reference output: on `axis` (sequence-first models write [T, N, C]),
    # `rows` entries each (a batch folded into the rows: [N * T, C]); reference and join() put them first
    axis: int = 0
    rows: int = 1
    # each sample is a whole feed of its own, as recorded (an input without a batch axis: a scalar sample
    # rate, a state [2, N, 128]): `inputs` hold them on a new axis 0, fed one at a time, outputs stacked
    stacked: bool = False
    seconds_per_sample: float = 0.0  # the fp32 pass that made `reference`, per sample (0: not measured)
    output: str | None = None  # the tensor `reference` holds (graph.reference_output of the fused graph)
    # samples of several input sizes (sentences of many lengths): each sample's size, ((input, shape past
    # axis 0), ...), its inputs zero-padded to the largest in `inputs`; the samples of one size lie together
    # (subset keeps them so) and every feed holds one size, cut back to it. None: one size
    sizes: list | None = None
    # outputs of several sizes (one entry per token): each sample's output shape, `reference` zero-padded to
    # the largest (a padded value is 0 in every output compared, so it adds no signal and no error). None: one
    out_shapes: list | None = None

    def __len__(self):
        return len(self.names)

    @classmethod
    def empty(cls) -> "SampleSet":
        return cls([], {}, np.zeros((0,)))

    @property
    def n_sizes(self) -> int:
        """How many input sizes the samples come in."""
        if self.sizes is not None:
            return len(set(self.sizes))
        if self.stacked:  # (each fed whole, as recorded: their sizes are their own)
            return len({tuple((k, np.shape(v[i])) for k, v in sorted(self.inputs.items())) for i in range(len(self))})
        return min(len(self), 1)

    def spans(self, size: int) -> list:
        """[(a, b)]: the samples in runs of at most `size`, none mixing input sizes."""
        n, out, a = len(self.names), [], 0
        while a < n:
            b = min(a + size, n)
            if self.sizes is not None:
                b = a + next((k for k in range(1, b - a) if self.sizes[a + k] != self.sizes[a]), b - a)
            out.append((a, b))
            a = b
        return out

    @property
    def feeds(self) -> list:
        return [self.feed(a, b) for a, b in self.spans(1 if self.stacked else self.batch)]

    def feed(self, a: int, b: int) -> dict:
        """The model inputs of samples a..b (b = a + 1 where samples are stacked), of one input size."""
        if self.sizes is not None and len(set(self.sizes[a:b])) > 1:
            raise ValueError(f"samples {a}..{b} come in {len(set(self.sizes[a:b]))} input sizes; a run takes one")
        cut = {} if self.sizes is None else dict(self.sizes[a])
        if self.stacked:
            return {k: _cut(v[a], cut.get(k), 1) for k, v in self.inputs.items()}
        return {k: _cut(v[a:b], cut.get(k), 1) for k, v in self.inputs.items()}

    def widest(self) -> dict:
        """A feed of one sample at the largest size of every input (feed(0, 1) where there is one size)."""
        if self.sizes is None:
            return self.feed(0, 1)
        return {k: v[0] if self.stacked else v[:1] for k, v in self.inputs.items()}

    def join(self, outputs: list) -> np.ndarray:
        """The reference output of each of self.feeds, joined as `reference` is: one entry per sample
        along axis 0 ([N, ...], or [N, rows, ...]); outputs of several sizes zero-padded to the
        reference's (ValueError where one is larger)."""
        if self.sizes is not None or self.out_shapes is not None:
            parts = [o[None] if self.stacked else np.moveaxis(o, self.axis, 0) for o in outputs]
            to = self.reference.shape[1:] if len(self.reference) == len(self) and self.reference.ndim > 1 else None
            return _padded(parts, to)
        if self.stacked:
            return np.stack(outputs)
        y = np.moveaxis(np.concatenate(outputs, axis=self.axis), self.axis, 0)
        return y if self.rows == 1 else y.reshape((len(y) // self.rows, self.rows) + y.shape[1:])

    def join_like_reference(self, outputs: list) -> tuple:
        """(join(outputs), how many samples were replaced): an output whose size differs from fp32's (a
        length that follows the values: a TTS model's duration predictor sets its audio's) cannot be
        compared, so it counts as wholly wrong: zeros in its place. Without this every experiment on
        Piper's VITS voice failed on the first sample whose int8 audio came out one frame longer."""
        if self.out_shapes is not None:
            return self._join_sized(outputs)
        if self.stacked:
            want = self.reference.shape[1:]
            bad = [i for i, y in enumerate(outputs) if y.shape != want]
            if bad:
                zero = np.zeros(want, self.reference.dtype)
                outputs = [zero if i in bad else y for i, y in enumerate(outputs)]
            return self.join(outputs), len(bad)
        try:
            y = self.join(outputs)
        except ValueError:  # (feeds whose outputs no longer line up)
            y = None
        if y is None or y.shape != self.reference.shape:
            return np.zeros_like(self.reference), len(self)
        return y, 0

    def _join_sized(self, outputs: list) -> tuple:
        """join_like_reference where the samples' outputs differ in size: an output whose size is not
        its samples' fp32 one is replaced by zeros of that size (each of its samples counted)."""
        fixed, at, bad = [], 0, 0
        for o in outputs:
            n = 1 if self.stacked else o.shape[self.axis] if o.ndim > self.axis else 1
            want = self.out_shapes[at] if at < len(self.out_shapes) else None
            got = o.shape if self.stacked else np.moveaxis(o, self.axis, 0).shape[1:] if o.ndim > self.axis else None
            if want is None or got != tuple(want):
                if want is None:
                    return np.zeros_like(self.reference), len(self)
                o = np.zeros(want if self.stacked else (n,) + tuple(want), self.reference.dtype)
                o = o if self.stacked else np.moveaxis(o, 0, self.axis)
                bad += n
            fixed.append(o)
            at += n
        try:
            return self.join(fixed), bad
        except ValueError:
            return np.zeros_like(self.reference), len(self)

    def outputs_of(self, model, threads: int = 0) -> tuple:
        """(`model`'s reference output over these samples, joined as `reference` is; how many samples
        changed its size), run in ONNX Runtime."""
        from qtool.ortsession import run_output
        return self.gather_like_reference(run_output(model, self.output or G.reference_output(model),
                                                     self.feeds_for(model), threads))

    def feeds_for(self, model) -> list:
        """self.feeds as `model` must take them: one sample a feed where its samples interact in a batch
        (G.samples_interact: a DynamicQuantizeLinear's range is the whole batch's, and each sample must be
        judged by what the model gives it alone, as eval and a user's single requests see it)."""
        return self.single_feeds() if G.samples_interact(model) else self.feeds

    def single_feeds(self) -> list:
        """One sample a feed; a model with a fixed batch gets its whole batches, as it can only be run."""
        if self.fixed_batch:
            return self.feeds
        return [self.feed(k, k + 1) for k in range(len(self))]

    def gather_like_reference(self, outputs) -> tuple:
        """join_like_reference of the outputs of self.feeds as they come (an iterable), each written into
        its rows of one array as it arrives where it lines up with the reference: one copy of the output
        held instead of the parts and their join (PP-OCRv5's recognizer on 226 crops: 634 MB each)."""
        if self.stacked or self.axis != 0 or self.rows != 1 or not self.reference.ndim or self.out_shapes is not None:
            return self.join_like_reference(list(outputs))
        y = np.empty(self.reference.shape, self.reference.dtype)
        at, rest = 0, []
        for o in outputs:
            if rest or o.dtype != y.dtype or o.shape[1:] != y.shape[1:] or at + len(o) > len(y):
                rest.append(o)  # (it does not line up: joined the ordinary way below)
                continue
            y[at:at + len(o)] = o
            at += len(o)
        if rest or at != len(y):
            return self.join_like_reference([y[:at]] + rest if at else rest)
        return y, 0

    def subset(self, index) -> "SampleSet":
        """The samples at `index` (those of one input size together, in the order of the sizes); for a
        model with a fixed batch, whole batches of them only (the rest left out), so every feed, output
        and reference row lines up."""
        idx = np.asarray(index, np.int64)
        if self.sizes is not None:
            idx = np.asarray(sorted(idx.tolist(), key=lambda i: self.sizes[i]), np.int64)  # (stable: in order)
        if self.fixed_batch:
            idx = idx[:len(idx) - len(idx) % self.batch]
        pick = (lambda xs: None if xs is None else [xs[i] for i in idx])  # noqa: E731
        return SampleSet([self.names[i] for i in idx], {k: v[idx] for k, v in self.inputs.items()},
                         self.reference[idx] if len(self.reference) else self.reference, self.batch, self.fixed_batch,
                         self.axis, self.rows, self.stacked, self.seconds_per_sample, self.output,
                         pick(self.sizes), pick(self.out_shapes))

    def pick(self, names: list) -> "SampleSet":
        pos = {n: i for i, n in enumerate(self.names)}
        return self.subset([pos[n] for n in names if n in pos])


def _cut(v: np.ndarray, shape, lead: int = 1) -> np.ndarray:
    """`v` with its axes past the first `lead` cut to `shape` (None: as it is)."""
    if shape is None or tuple(v.shape[lead:]) == tuple(shape):
        return v
    return v[(slice(None),) * lead + tuple(slice(0, d) for d in shape)]


def _padded(parts: list, to=None) -> np.ndarray:
    """Arrays [n, ...] of one rank, each zero-padded past axis 0 to `to` (None: their largest), joined
    on axis 0. ValueError where one is larger than `to` or the ranks differ."""
    if len({p.ndim for p in parts}) > 1:
        raise ValueError("outputs of different ranks")
    to = tuple(to) if to is not None else tuple(np.max([p.shape[1:] for p in parts], axis=0))
    if any(len(p.shape[1:]) != len(to) or any(d > t for d, t in zip(p.shape[1:], to)) for p in parts):
        raise ValueError(f"an output larger than {list(to)}")
    out = np.zeros((sum(len(p) for p in parts),) + to, parts[0].dtype)
    at = 0
    for p in parts:
        out[(slice(at, at + len(p)),) + tuple(slice(0, d) for d in p.shape[1:])] = p
        at += len(p)
    return out


def load_samples(fused, table, files: list, threads: int = 0, progress=None) -> SampleSet:
    """Decode `files` with the calibration's preprocessing and run the fp32 graph on them once;
    `progress(k)` is told of k more samples decoded, then of k more run."""
    if not files:
        return SampleSet.empty()
    s = _decoded(fused, table, files, progress)
    if not len(s):
        return s
    return _with_reference(s, fused, table, threads, progress)


def _decoded(fused, table, files: list, progress=None) -> SampleSet:
    """The samples of the most common input size, decoded (a fixed batch: whole batches only); none
    where none can be read, with a warning."""
    from qtool.data.config import config_from_any
    from qtool.data.sources import ImageData

    data = ImageData(os.path.dirname(files[0]), config_from_any(table.config), fused, table.model_path,
                     batch=BATCH, files=files)
    stacked = getattr(data, "kind", "") != "images" and data.batch == 1  # (each sample fed whole, as recorded)
    by_shape = {}  # a dynamic model's samples may differ in size: (each sample's input shapes) -> (names, parts)
    for n, f in data.batches():
        # samples fed whole need not share a size (graphs of different node counts, spectrograms of different
        # lengths): they are kept as they are, one object each
        key = () if stacked else tuple((k, v.shape[1:]) for k, v in sorted(f.items()))
        names, parts = by_shape.setdefault(key, ([], {}))
        names.extend(n)
        for k, v in f.items():
            parts.setdefault(k, []).append(v)
        if progress:
            progress(len(n))
    fixed = [d[0] for d in (G.input_dims(i) for i in G.real_inputs(fused)) if d and isinstance(d[0], int)]
    sizes = None
    if len(by_shape) > 1 and not fixed:  # every size, each run as its own batches
        names, parts, sizes = _all_sizes(by_shape)
    else:
        names, parts = max(by_shape.values(), key=lambda np_: len(np_[0]), default=([], {}))
    if len(by_shape) > 1 and fixed:
        warnings.warn(f"the calibration samples come in {len(by_shape)} input sizes and the model takes exactly "
                      f"{fixed[0]} at a time; the {len(names)} of the most common size are used for method choice, "
                      f"rounding, range tuning and sensitivity (calibration saw them all)", stacklevel=3)
    skipped = len(files) - sum(len(ns) for ns, _ in by_shape.values())
    if not names:
        warnings.warn(f"none of the {len(files)} calibration samples can be read now (first: {files[0]}); the steps "
                      f"that need them are skipped", stacklevel=3)
        return SampleSet.empty()
    if skipped:
        warnings.warn(f"{skipped} of {len(files)} calibration samples can no longer be read; using the other "
                      f"{len(names)}", stacklevel=3)
    if stacked:  # (tensors that cannot be stacked on axis 0)
        s = SampleSet(names, {k: _stack(v) for k, v in parts.items()}, np.zeros((0,)), 1, True, stacked=True)
    else:
        inputs = {k: np.concatenate(v) if sizes is None else _padded(v) for k, v in parts.items()}
        s = SampleSet(names, inputs, np.zeros((0,)), fixed[0] if fixed else _batch_for(inputs, fused), bool(fixed),
                      sizes=sizes)
    s = s.subset(range(len(names)))  # (a fixed batch: whole batches only; several sizes: each size together)
    if not len(s):
        warnings.warn(f"the model takes exactly {s.batch} samples at a time and only {len(names)} calibration "
                      f"samples are here; the steps that need them are skipped", stacklevel=3)
    return s


def _all_sizes(by_shape: dict) -> tuple:
    """(names, input name -> [arrays], each sample's size) of the samples of every size, in the order
    the sizes come (the samples of a size in the order read)."""
    names, parts, sizes = [], {}, []
    for key in sorted(by_shape):
        ns, ps = by_shape[key]
        names.extend(ns)
        sizes.extend([key] * len(ns))
        for k, v in ps.items():
            parts.setdefault(k, []).extend(v)
    return names, parts, sizes


def _with_reference(s: SampleSet, fused, table, threads: int, progress=None) -> SampleSet:
    """`s` with the fp32 graph's reference output of every sample, where it holds one entry per sample
    (else no sample: the steps that need them are skipped, with a warning); non-finite samples left out."""
    from qtool.ortsession import session, with_outputs
    out = s.output = G.reference_output(fused)
    for attempt in (0, 1):
        sess = session(with_outputs(fused, [out]), threads, where=f"{table.model_path} (fused)")
        s.axis, s.rows = _sample_axis(sess, out, s)
        ys = []
        t0 = time.perf_counter()
        for (a, b), f in zip(s.spans(1 if s.stacked else s.batch), s.feeds):
            ys.append(sess.run([out], f)[0])
            if progress and not attempt:
                progress(b - a)
        s.seconds_per_sample = (time.perf_counter() - t0) / len(s)
        if attempt or out == G.first_output(fused) or not all(_nowhere_finite(y) for y in ys):
            break
        # the tensor a final selection reads is -inf by design (a peak picker's padding, swift-f0): every
        # sample would be left out as non-finite; the output itself is the judge instead
        warnings.warn(f"'{out}', which the model's last selection reads, is not finite in any calibration sample; "
                      f"quantize judges by the output '{G.first_output(fused)}' instead", stacklevel=3)
        out = s.output = G.first_output(fused)
    if not s.stacked and not s.fixed_batch and not _joins(s, ys) \
            and all(len(v) == len(s) for v in s.inputs.values()):
        # an output whose length follows the whole batch (SLANet's Loop decodes until every sequence of the
        # batch has ended): the samples are run one at a time, each output its own
        _one_at_a_time(s)
        s.axis, s.rows = 0, 1
        ys = [sess.run([out], f)[0] for f in s.feeds]
    each = _output_shapes(s, ys)
    if len(set(each)) > 1:  # (one value per frame or token): compared zero-padded to the largest
        s.out_shapes = each
    try:
        s.reference = s.join(ys)
    except ValueError:  # (outputs of the feeds that cannot be joined: sizes that follow the data)
        s.reference = np.zeros((0,))
    if len(s.reference) != len(s):
        # a tensor whose rows do not follow the samples (candidates a threshold kept for the whole batch):
        # the steps cannot pair samples with it; they are skipped, quantize goes on
        warnings.warn(f"'{out}', which quantize judges the model by, does not hold one entry per calibration "
                      f"sample ({len(s.reference)} for {len(s)}); the steps that need samples are skipped",
                      stacklevel=3)
        return SampleSet.empty()
    return _finite_only(s)


def _output_shapes(s: SampleSet, ys: list) -> list:
    """Each sample's output shape (past the samples' axis), from the outputs of s.feeds."""
    if s.stacked:
        return [tuple(y.shape) for y in ys]
    each = []
    for y in ys:
        if y.ndim <= s.axis:
            return []
        one = np.moveaxis(y, s.axis, 0).shape
        each += [one[1:]] * one[0]
    return each


def _stack(arrays: list) -> np.ndarray:
    """[N, ...] when the arrays share a shape; else an object array of them, which subset() and feed()
    index the same way."""
    if len({a.shape for a in arrays}) == 1:
        return np.stack(arrays)
    out = np.empty(len(arrays), object)
    out[:] = [a for a in arrays]
    return out


def _sample_axis(sess, out: str, s: SampleSet) -> tuple:
    """(axis, rows): where the output holds the samples, found by running one sample and two: the
    one axis that grows with them (a CRNN's [T, N, C] output: axis 1), and its size for one sample
    (> 1 where the batch is folded into it). Axis 0, one row, where nothing tells."""
    if s.fixed_batch and not s.stacked and len(s):
        # a fixed batch B cannot be fed 1 and 2: the samples are on the axis of size B, axis 0 first (ddddocr's
        # CRNN, batch 1, writes [T, 1, C]: joined on axis 0 its rows were T per sample, not one)
        shape = sess.run([out], s.feed(0, s.batch))[0].shape
        axes = [a for a, d in enumerate(shape) if d == s.batch]
        return (axes[0] if axes else 0), 1
    if s.fixed_batch or s.stacked or len(s) < 2:
        return 0, 1  # (one sample whose output holds no entry for it, a scalar: load_samples runs it alone)
    from qtool.errors import QtoolError
    # (samples of several sizes: the first one twice for two, a batch of one size)
    two = s.feed(0, 2) if s.sizes is None else {k: np.concatenate([v, v]) for k, v in s.feed(0, 1).items()}
    try:
        one, two = (sess.run([out], f)[0].shape for f in (s.feed(0, 1), two))
    except QtoolError:
        # a batch dimension declared free that the graph does not honour (khmersm: a Reshape to one
        # sentence): every step runs the samples one at a time, each fed whole
        if all(len(v) == len(s.names) for v in s.inputs.values()):
            _one_at_a_time(s)
            return 0, 1
        raise
    grown = [a for a, (p, q) in enumerate(zip(one, two)) if p != q]
    if one == two and all(len(v) == len(s.names) for v in s.inputs.values()):
        # nothing grows with the batch: the output sums over it (a quality score written as one scalar,
        # speechmos' PLCMOS with its batch declared free): the samples are fed one at a time
        _one_at_a_time(s)
        return 0, 1
    if len(one) != len(two) or len(grown) != 1 or two[grown[0]] != 2 * one[grown[0]]:
        return 0, 1
    if one[grown[0]] > 1 and s.sizes is not None:
        # a batch folded into rows whose number follows the size: one sample at a time, each output its own
        _one_at_a_time(s)
        return 0, 1
    return grown[0], one[grown[0]]


def _joins(s: SampleSet, ys: list) -> bool:
    """Whether the outputs of s's feeds join into one entry per sample."""
    try:
        return len(s.join(ys)) == len(s)
    except ValueError:
        return False


def _one_at_a_time(s: SampleSet) -> None:
    s.inputs = {k: v[:, None] for k, v in s.inputs.items()}
    s.stacked, s.batch = True, 1


def _nowhere_finite(y) -> bool:
    """A float batch in which every sample holds a NaN/inf."""
    y = np.asarray(y)
    return bool(np.issubdtype(y.dtype, np.floating) and y.ndim and len(y)
                and not np.isfinite(y.reshape(len(y), -1)).all(axis=1).any())


def _finite_only(s: SampleSet) -> SampleSet:
    """The samples whose inputs and fp32 output are all finite: a NaN/inf sample would make every
    SQNR and agreement NaN (calibration left its values out of the ranges the same way)."""
    ok = np.ones(len(s.names), bool)
    for v in list(s.inputs.values()) + [s.reference]:
        if np.issubdtype(v.dtype, np.floating) and v.ndim and len(v) == len(ok):
            ok &= np.isfinite(v.reshape(len(v), -1)).all(axis=1)
    if ok.all():
        return s
    bad = [s.names[i] for i in np.flatnonzero(~ok)]
    warnings.warn(f"{len(bad)} calibration sample{'s' if len(bad) > 1 else ''} with NaN/inf in the input or the fp32 "
                  f"output left out: {', '.join(os.path.basename(str(b)) for b in bad[:5])}"
                  f"{', ...' if len(bad) > 5 else ''}", stacklevel=4)
    return s.subset(np.flatnonzero(ok))


def _rows_are(ref: np.ndarray, op: str, chunk: int = 1 << 20) -> bool:
    """Whether every row on the last axis of `ref` that is not all zero (a shorter sample's padding) is a
    distribution (op "Softmax") or log-probabilities ("LogSoftmax"), about `chunk` values at a time."""
    rows = ref.reshape(-1, ref.shape[-1]) if ref.size else ref.reshape(0, 1)
    test = is_distribution if op == "Softmax" else is_log_distribution
    step, seen = max(1, chunk // max(rows.shape[1], 1)), False
    for s in range(0, len(rows), step):
        r = rows[s:s + step]
        r = r[nonzero_rows(r)]
        if len(r) and not test(r):
            return False
        seen = seen or bool(len(r))
    return seen


ROW_MOVES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")  # ops between a Softmax and the output that
# only regroup its rows


def distribution_output(fused, samples: SampleSet) -> str | None:
    """"Softmax" or "LogSoftmax" where the samples' reference output is one over its last axis (a
    classifier's probabilities, a CTC recognizer's or a tagger's per position): what it means is the
    class each position picks. None otherwise."""
    name = samples.output or (G.reference_output(fused) if fused.graph.output else None)
    producers = G.producers(fused)
    node = producers.get(name) if name else None
    moved = False
    while node is not None and node.op_type in ROW_MOVES and node.input:
        node, moved = producers.get(node.input[0]), True
    if node is None or node.op_type not in ("Softmax", "LogSoftmax") or samples.reference.ndim < 2:
        return None
    if moved:
        # Paddle2ONNX writes a recognizer's Softmax over [N * T, C] between a Flatten and a Reshape back to
        # [N, T, C] (RapidOCR's PP-OCRv4): whether its rows are the output's last axis, the values say (every
        # row of that axis a distribution); method choice judged PP-OCRv4 by SQNR alone, where its texts apply
        return node.op_type if _rows_are(samples.reference, node.op_type) else None
    axis = G.attr(node, "axis", -1 if G.opset(fused) >= 13 else 1)
    # (samples.reference moved the sample axis first: a positive axis is the last only where nothing moved)
    last = axis == -1 or (axis == samples.reference.ndim - 1 and samples.axis == 0 and samples.rows == 1
                          and not samples.stacked)
    return node.op_type if last else None
