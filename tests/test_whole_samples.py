"""Models whose axis 0 is not a batch: a file (one sample, as the README promises) whose array has the
model's rank and several rows on a free axis 0 runs whole, never cut into rows nor joined with other files.
madmom's beat/onset/key networks take a [frames, bins] spectrogram: cut into one-row slices, their
convolutions over time failed in ONNX Runtime, and onnx's shape inference aborted the process."""
from __future__ import annotations


import numpy as np
import onnx
from onnx import helper

from helpers import init, make_model, save
from qtool.api import Sampling, calibrate, evaluate, quantize
from qtool.quantize.options import QuantizeOptions


def _frames_model(rng, bins=8, k=5):
    """x [T, bins] -> a convolution over time (kernel k, no padding) -> per-frame values [T - k + 1] and
    the key-like mean over time [4]."""
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
             helper.make_node("Unsqueeze", ["xt", "ax0"], ["x3"]),                        # [1, bins, T]
             helper.make_node("Conv", ["x3", "w1", "b1"], ["c1"], kernel_shape=[k]),    # [1, 4, T - k + 1]
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], kernel_shape=[1]),    # [1, 1, T - k + 1]
             helper.make_node("Squeeze", ["c2", "ax01"], ["frames"]),
             helper.make_node("ReduceMean", ["r1"], ["m"], axes=[2], keepdims=0),        # [1, 4]
             helper.make_node("Squeeze", ["m", "ax0"], ["key"])]
    inits = [init("w1", rng.standard_normal((4, bins, k)) * 0.3), init("b1", rng.standard_normal(4) * 0.1),
             init("w2", rng.standard_normal((1, 4, 1))), init("b2", np.zeros(1)),
             init("ax0", [0], np.int64), init("ax01", [0, 1], np.int64)]
    return make_model(nodes, inits, [("x", ["T", bins])], [("frames", ["F"]), ("key", [4])], opset=13)


def _files(folder, lengths, seed, bins=8):
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for i, t in enumerate(lengths):
        np.save(folder / f"s{i:02d}.npy", rng.standard_normal((t, bins)).astype(np.float32))
    return str(folder)


def test_spectrogram_files_run_whole(tmp_path):
    path = save(_frames_model(np.random.default_rng(2)), tmp_path / "frames.onnx")
    calib = _files(tmp_path / "c", [20, 20, 24, 20, 30, 20, 20, 26], seed=1)
    w = str(tmp_path / "w")
    r = calibrate(path, calib, workdir=w)
    assert r.table.n_samples == 8  # (files, not 188 rows)
    q = quantize(w, QuantizeOptions(strict=True))  # every optional step works on whole samples
    assert q.report["summary"].get("int8", 0) >= 2
    ev = evaluate(workdir=w, data=_files(tmp_path / "e", [22, 20, 28], seed=3))
    assert ev["n_samples"] == 3
    assert ev["outputs"]["frames"]["sqnr_db"] > 25 and ev["outputs"]["key"]["sqnr_db"] > 25


def test_rows_of_a_batch_axis_still_join(tmp_path):
    """Files of one row each on a free axis 0 are samples of a batch axis: they are joined as before."""
    from qtool.data.tensors import NpyFolder
    m = _frames_model(np.random.default_rng(2))
    d = tmp_path / "one"
    d.mkdir()
    for i in range(4):
        np.save(d / f"{i}.npy", np.zeros((1, 8), np.float32))
    assert NpyFolder(str(d), m, "m.onnx").batch > 1
    assert NpyFolder(_files(tmp_path / "many", [20, 21], seed=0), m, "m.onnx").batch == 1


def _batch_one_model(rng, t=12, c=6):
    """ids-like x [N, T, C] declared with a free N, but a Reshape to [1, T * C] inside: it runs at batch 1
    only (khmersm's segmenter views its one sentence so)."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["flat"]),
             helper.make_node("MatMul", ["flat", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    inits = [init("shape", [1, t * c], np.int64), init("w", rng.standard_normal((t * c, 16)) * 0.2),
             init("w2", rng.standard_normal((16, 5)))]
    return make_model(nodes, inits, [("x", ["N", t, c])], [("y", [1, 5])], opset=13)


def test_a_free_batch_the_graph_does_not_honour(tmp_path):
    """Calibration ran the files one by one; quantize's samples joined them into a batch of 2 to find the
    sample axis, ORT refused, and every step that needs samples was skipped ('calibration samples failed')."""
    import warnings
    path = save(_batch_one_model(np.random.default_rng(5)), tmp_path / "b1.onnx")
    rng = np.random.default_rng(6)
    samples = [rng.standard_normal((1, 12, 6)).astype(np.float32) for _ in range(12)]
    d = tmp_path / "d"
    d.mkdir()
    for i, s in enumerate(samples):
        np.save(d / f"{i:02d}.npy", s)
    w = str(tmp_path / "w")
    calibrate(path, str(d), workdir=w, sampling=Sampling(batch=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = quantize(w)
    said = " ".join(str(c.message) for c in caught)
    assert "calibration samples failed" not in said and "method choice failed" not in said, said
    assert q.report["summary"].get("int8", 0) >= 2


def test_sizes_count_external_weight_files(tmp_path):
    """khmersm keeps its 7 MB of weights in model.onnx.data: quantize reported its int8 model at 10878 %
    of the fp32 one, counting the fp32 model's 26 kB graph file alone."""
    from helpers import small_convnet
    from qtool.modelio import model_bytes
    m = small_convnet()
    path = str(tmp_path / "ext.onnx")
    onnx.save(m, path, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin",
              size_threshold=0)
    assert model_bytes(path) == (tmp_path / "ext.onnx").stat().st_size + (tmp_path / "weights.bin").stat().st_size
    rng = np.random.default_rng(0)
    calibrate(path, [rng.standard_normal((1, 3, 16, 16)).astype(np.float32) for _ in range(4)],
              workdir=str(tmp_path / "w"))
    q = quantize(str(tmp_path / "w"))
    assert q.report["size_bytes"]["fp32"] == model_bytes(path)
    assert q.report["size_bytes"]["int8"] < 3 * q.report["size_bytes"]["fp32"]
