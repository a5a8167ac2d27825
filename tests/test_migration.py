"""Outlier channels of a run-time quantized input moved into the weights (quantize/migrate.py): the graph
computes the same, the scale goes into a constant where it can, and quantize keeps it only where measured."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from helpers import calibrate_samples, run
from qtool.api import quantize
from qtool.calibrate.table import CalibrationTable
from qtool.quantize.migrate import Migration, apply
from qtool.quantize.options import QuantizeOptions

T, D, N = 16, 32, 48


def _two_readers(half=np.float32(0.5)):
    """x -> LayerNorm (n: read by a MatMul and a residual Add) and x -> Mul by a constant `half` (g: read by one
    MatMul)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.ones(D, np.float32), "gamma"),
             numpy_helper.from_array(np.zeros(D, np.float32), "beta"),
             numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((D, N)).astype(np.float32), "w2"),
             numpy_helper.from_array(np.asarray(half, np.float32), "half")]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], name="ln", axis=-1),
             helper.make_node("MatMul", ["n", "w1"], ["a"], name="m1"),
             helper.make_node("Add", ["a", "n"], ["r"], name="residual"),
             helper.make_node("Mul", ["r", "half"], ["g"], name="half_mul"),
             helper.make_node("MatMul", ["g", "w2"], ["y"], name="m2")]
    g = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, T, D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, T, N])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_the_moved_graph_computes_the_same_and_folds_into_a_constant_where_it_can():
    m = _two_readers(np.linspace(0.5, 1.5, D))
    rng = np.random.default_rng(1)
    s1, s2 = (np.exp(rng.uniform(-2, 2, k)).astype(np.float32) for k in (D, D))
    moves = [Migration("n", ("m1",), 0.75, {}, 10.0, s1), Migration("g", ("m2",), 0.75, {}, 10.0, s2)]
    table = CalibrationTable("", "", "", "minmax", 1, ranges={"minmax": {"n": [-3.0, 3.0], "g": [-4.0, 5.0]}})
    moved, new_table, how = apply(m, table, moves)
    x = {"x": rng.standard_normal((1, T, D)).astype(np.float32)}
    np.testing.assert_allclose(run(moved, x)[0], run(m, x)[0], rtol=1e-4, atol=1e-4)
    # n has another reader (the residual): a Mul by 1/s before m1 alone; g's producer is a Mul by a per-channel
    # constant that only m2 reads after: 1/s goes into that constant, no node added
    assert how["n"].startswith("a Mul") and how["g"].startswith("into")
    nodes = {n.name: n for n in moved.graph.node}
    assert len(moved.graph.node) == len(m.graph.node) + 1
    assert nodes["residual"].input[1] == "n" and nodes["m1"].input[0] != "n"
    assert nodes["m2"].input[0] == "g"
    # the inputs not changed; the table gets the scaled tensor's range, wide enough for every channel
    assert len(m.graph.node) == 5 and table.ranges["minmax"].keys() == {"n", "g"}
    lo, hi = new_table.ranges["minmax"][nodes["m1"].input[0]]
    assert lo <= -3.0 / s1.min() + 1e-6 and hi >= 3.0 / s1.min() - 1e-6


def test_a_scalar_constant_stays_a_scalar():
    """A Mul by one number (the erf GELU's closing 0.5) keeps it: runtimes fuse the GELU only with scalars
    (ONNX Runtime's BiasGelu, qtool's GeluStep); the scale is a Mul of its own."""
    m = _two_readers()
    rng = np.random.default_rng(1)
    s2 = np.exp(rng.uniform(-2, 2, D)).astype(np.float32)
    table = CalibrationTable("", "", "", "minmax", 1, ranges={"minmax": {"n": [-3.0, 3.0], "g": [-4.0, 5.0]}})
    moved, _, how = apply(m, table, [Migration("g", ("m2",), 0.75, {}, 10.0, s2)])
    assert how["g"].startswith("a Mul")
    assert numpy_helper.to_array(next(t for t in moved.graph.initializer if t.name == "half")).size == 1
    x = {"x": rng.standard_normal((1, T, D)).astype(np.float32)}
    np.testing.assert_allclose(run(moved, x)[0], run(m, x)[0], rtol=1e-4, atol=1e-4)


T2, D2, N2 = 64, 128, 160


def _block(outlier):
    """A LayerNorm whose output has one channel `outlier` times wider, scaled per sample, into a MatMul."""
    rng = np.random.default_rng(0)
    gamma = np.ones(D2, np.float32)
    gamma[3] = outlier
    inits = [numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(np.zeros(D2, np.float32), "beta"),
             numpy_helper.from_array((rng.standard_normal((D2, N2)) / 4).astype(np.float32), "w")]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], name="ln", axis=-1),
             helper.make_node("Mul", ["n", "s"], ["z"], name="scale"),
             helper.make_node("MatMul", ["z", "w"], ["y"], name="dense")]
    g = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, T2, D2]),
                                           helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, 1, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, T2, N2])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _samples(n, seed):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, T2, D2)).astype(np.float32),
             "s": np.full((1, 1, 1), 10.0 ** rng.uniform(-1.5, 1.0), np.float32)} for _ in range(n)]


def _sqnr(ref, out):
    return 10 * np.log10(float((ref.astype(np.float64) ** 2).sum()) / float(((ref - out).astype(np.float64) ** 2).sum()))


def test_quantize_moves_an_outlier_channel_into_the_weights(tmp_path):
    model = _block(40.0)
    work = calibrate_samples(model, _samples(24, 1), tmp_path)
    q = quantize(work, QuantizeOptions(strict=True), verbose=False)
    report = json.load(open(os.path.join(work, "quantize.json")))["dynamic_inputs"]
    assert report["layers"]["dense"]["dynamic"]
    mig, entry = report["migration"], report["migration"]["tensors"]["z"]
    # the outlier channel sets each run's range: moved into the weights, by a strength measured better
    assert mig["kept"] and entry["alpha"] > 0 and entry["channel_spread"] > 10
    assert entry["layer_sqnr_db"][str(entry["alpha"])] >= entry["layer_sqnr_db"]["0.0"] + 1.0
    assert mig["output_sqnr_db"]["after"] >= mig["output_sqnr_db"]["before"] + 1.0
    # z has no other reader, but its producer multiplies by an input, not a constant: a Mul by 1/s before dense
    assert entry["how"].startswith("a Mul")
    m = onnx.load(q.path)
    held = _samples(8, 2)
    ref = np.concatenate([run(model, f)[0] for f in held])
    out = np.concatenate([run(m, f)[0] for f in held])
    assert _sqnr(ref, out) > 30
    # deterministic: a second quantize writes the same bytes
    again = quantize(work, QuantizeOptions(strict=True, output=str(tmp_path / "again.onnx")), verbose=False)
    assert open(again.path, "rb").read() == open(q.path, "rb").read()


def test_a_failing_migration_falls_back_to_the_inputs_as_they_are(tmp_path, monkeypatch):
    import warnings

    from qtool.quantize.steps import migration

    def boom(*a, **k):
        raise RuntimeError("injected fault")
    monkeypatch.delenv("QTOOL_STRICT", raising=False)
    monkeypatch.setattr(migration, "measure", boom)
    work = calibrate_samples(_block(40.0), _samples(24, 1), tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = quantize(work, QuantizeOptions(), verbose=False)
    said = [str(w.message) for w in caught if "injected fault" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("migration failed (RuntimeError: injected fault)")
    report = json.load(open(os.path.join(work, "quantize.json")))
    assert [f["step"] for f in report["optional_steps"]["fallbacks"]] == ["migration"]
    assert report["dynamic_inputs"]["layers"]["dense"]["dynamic"]  # (the dynamic input stays)
    assert not any("smooth" in n.name for n in onnx.load(q.path).graph.node)
