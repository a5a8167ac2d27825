"""Calibration samples of many lengths (sentences): every step that judges the int8 model measures on
all of them, each input size run as its own batches (samples.py), and says so in quantize.json.
(The same int8 bytes in two runs: test_deterministic.py's "many_lengths".)"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from helpers import calibrate_options, save, sequence_encoder, write_samples
from qtool.calibrate.run import calibrate
from qtool.quantize.options import ExclusionOptions, QuantizeOptions
from qtool.quantize.run import quantize
from qtool.quantize.samples import SampleSet

D = 16
LENGTHS = [5, 7, 9, 5, 12, 7, 9, 5, 12, 6, 7, 9, 5, 12, 6, 8]


def _quantized(folder, exclude=True):
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True, exist_ok=True)
    path = save(sequence_encoder(), folder / "m.onnx")
    data = write_samples(folder / "data", [{"x": rng.standard_normal((1, t, D)).astype(np.float32)} for t in LENGTHS])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (no "most common size" warning, nor any other)
        calibrate(path, data, calibrate_options(show_progress=False, threads=1), str(folder / "work"))
        return quantize(str(folder / "work"), QuantizeOptions(progress=False, strict=True,
                                                              exclusion=ExclusionOptions(enabled=exclude)))


def test_every_judging_step_uses_samples_of_every_length(tmp_path):
    q = _quantized(tmp_path)
    used = q.report["samples_used"]
    for step in ("method choice", "output-aware rounding", "sensitivity", "exclusion check"):
        assert step in used["steps"], used
    assert used["steps"]["output-aware rounding"] == used["steps"]["sensitivity"] == len(LENGTHS)
    assert used["input_sizes"]["output-aware rounding"] == used["input_sizes"]["sensitivity"] == len(set(LENGTHS))
    # method choice's few (evenly spaced over the files) come in several lengths too
    assert used["input_sizes"]["method choice"] > 1
    assert set(used["steps"]) == set(used["input_sizes"])


def _ragged_set():
    """Five samples of lengths 3, 5, 3, 4, 5 (one input, [1, T, 2]), stored padded as load_samples does."""
    from qtool.quantize.samples import _all_sizes, _padded
    lengths = [3, 5, 3, 4, 5]
    by_shape = {}
    for k, t in enumerate(lengths):
        x = np.full((1, t, 2), k + 1, np.float32)
        names, parts = by_shape.setdefault((("x", (t, 2)),), ([], {}))
        names.append(f"s{k}")
        parts.setdefault("x", []).append(x)
    names, parts, sizes = _all_sizes(by_shape)
    s = SampleSet(names, {"x": _padded(parts["x"])}, np.zeros((0,)), batch=4, sizes=sizes)
    return s.subset(range(len(names)))


def test_feeds_hold_one_size_each_and_outputs_join_padded():
    s = _ragged_set()
    assert s.names == ["s0", "s2", "s3", "s1", "s4"]  # by size, in the order read within one
    feeds = s.feeds
    assert [f["x"].shape for f in feeds] == [(2, 3, 2), (1, 4, 2), (2, 5, 2)]
    assert s.n_sizes == 3
    y = s.join([f["x"] * 2 for f in feeds])  # (an "output" the size of the input)
    assert y.shape == (5, 5, 2)
    np.testing.assert_array_equal(y[0, :3], 2 * np.ones((3, 2)))
    assert not y[0, 3:].any()  # zero-padded: no signal, no error
    with pytest.raises(ValueError):
        s.feed(1, 3)  # (two sizes in one run)
    sub = s.pick(["s4", "s0", "s3"])  # a subset keeps each size together
    assert sub.names == ["s0", "s3", "s4"] and [f["x"].shape[1] for f in sub.feeds] == [3, 4, 5]


def test_an_output_that_changes_size_counts_as_wrong():
    s = _ragged_set()
    s.reference = s.join([f["x"] for f in s.feeds])
    s.out_shapes = [tuple(f["x"].shape[1:]) for f in s.feeds for _ in range(len(f["x"]))]
    outs = [f["x"] for f in s.feeds]
    outs[1] = outs[1][:, :3]  # the length-4 sample's output came out 3 long
    y, bad = s.join_like_reference(outs)
    assert bad == 1 and y.shape == s.reference.shape and not y[2].any()
    np.testing.assert_array_equal(y[3], s.reference[3])


def test_samples_fed_whole_count_their_own_sizes():
    from qtool.quantize.samples import _stack
    x = _stack([np.zeros((1, 3), np.float32), np.zeros((1, 5), np.float32), np.zeros((1, 3), np.float32)])
    s = SampleSet(["a", "b", "c"], {"x": x}, np.zeros((0,)), 1, True, stacked=True)
    assert s.n_sizes == 2 and [f["x"].shape for f in s.feeds] == [(1, 3), (1, 5), (1, 3)]
