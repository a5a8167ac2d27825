"""A transformer-like block through the default quantize: an embedding Gather (int8 per row) and a
LayerNorm with an outlier channel, scaled per sample, into a weight MatMul (input quantized at run time,
chosen by measurement); run by ONNX Runtime, and no weight pair that ORT's AVX2 path could saturate."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from helpers import calibrate_samples, run
from qtool.api import quantize
from qtool.arithmetic import saturating_pairs
from qtool.quantize.options import QuantizeOptions

T, D, N, V = 64, 128, 160, 200  # (over 1 MMAC: portable keeps pair-safe int8 weights, not uint8)


def _block(batch=1, bias=False):
    rng = np.random.default_rng(0)
    gamma = np.ones(D, np.float32)
    gamma[3] = 30.0  # the outlier channel every LayerNorm output of a real encoder carries
    inits = [numpy_helper.from_array(rng.standard_normal((V, D)).astype(np.float32), "table"),
             numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(np.zeros(D, np.float32), "beta"),
             numpy_helper.from_array((rng.standard_normal((D, N)) / 4).astype(np.float32), "w")]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="embed", axis=0),
             helper.make_node("Add", ["e", "x"], ["h"], name="add"),
             helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["n"], name="ln", axis=-1),
             helper.make_node("Mul", ["n", "s"], ["z"], name="scale"),  # a scale that changes per sample
             helper.make_node("MatMul", ["z", "w"], ["y0" if bias else "y"], name="dense")]
    if bias:  # (first, as torch exports it)
        inits.append(numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), "bias"))
        nodes.append(helper.make_node("Add", ["bias", "y0"], ["y"], name="dense_bias"))
    b = batch
    g = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("ids", TensorProto.INT64, [b, T]),
                                           helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, T, D]),
                                           helper.make_tensor_value_info("s", TensorProto.FLOAT, [b, 1, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, T, N])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _samples(n, seed):
    rng = np.random.default_rng(seed)
    return [{"ids": rng.integers(0, V, (1, T)).astype(np.int64),
             "x": rng.standard_normal((1, T, D)).astype(np.float32),
             "s": np.full((1, 1, 1), 10.0 ** rng.uniform(-1.5, 1.0), np.float32)} for _ in range(n)]


def _sqnr(ref, out):
    return 10 * np.log10(float((ref.astype(np.float64) ** 2).sum()) / float(((ref - out).astype(np.float64) ** 2).sum()))


def test_embedding_int8_per_row_and_dynamic_input_by_measurement(tmp_path):
    model = _block()
    work = calibrate_samples(model, _samples(24, 1), tmp_path)
    q = quantize(work, QuantizeOptions(strict=True), verbose=False)
    m = onnx.load(q.path)
    report = json.load(open(os.path.join(work, "quantize.json")))

    # the embedding table: int8, one scale per row, read by Gather; the fp32 table is gone
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    assert "table" not in inits
    gathers = [n for n in m.graph.node if n.op_type == "Gather"]
    assert sorted(inits[n.input[0]].dtype.str for n in gathers) == ["<f4", "|i1"]
    assert report["embeddings"]["embed"]["rows"] == V and report["embeddings"]["embed"]["weight_sqnr_db"] > 35

    # the MatMul reads its input through DynamicQuantizeLinear, as an integer MatMul, and quantize.json says why
    choice = report["dynamic_inputs"]["layers"]["dense"]
    assert choice["dynamic"] and choice["needs_dynamic"] and choice["dynamic_sqnr_db"] >= choice["static_sqnr_db"] + 6
    dense = next(n for n in m.graph.node if n.name == "dense")
    assert dense.op_type == "MatMulInteger"
    assert next(n for n in m.graph.node if n.output[0] == dense.input[0]).op_type == "DynamicQuantizeLinear"

    # the Mul before it has no int8 reader left: it runs fp32, and nothing rounds its input statically
    assert next(d for d in report["nodes"] if d["name"] == "scale")["status"] == "fp32"
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] in ("n", "z") for n in m.graph.node)

    # its weights follow the portable target: no pair ORT's AVX2 kernel sums in int16 can saturate
    w = inits[dense.input[1]]
    assert w.dtype == np.int8 and not len(saturating_pairs(w.T.astype(np.int64))[0])

    # ONNX Runtime runs it on held-out samples; on the calibration samples the model measured far better
    # with the dynamic input than all static (the step's own figures)
    held = _samples(8, 2)
    ref = np.concatenate([run(model, f)[0] for f in held])
    got = np.concatenate([run(m, f)[0] for f in held])
    assert _sqnr(ref, got) > 20
    figures = report["dynamic_inputs"]["output_sqnr_db"]
    assert figures["needed"] > figures["static"] + 3

    # and the choice is deterministic: a second quantize writes the same bytes
    again = quantize(work, QuantizeOptions(strict=True, output=str(tmp_path / "again.onnx")), verbose=False)
    assert open(again.path, "rb").read() == open(q.path, "rb").read()


def test_a_dynamic_layer_is_one_int8_op_with_its_bias_in_onnx_runtime_and_the_native_runtime(tmp_path):
    """The dynamic layer is written as quantize_dynamic writes one (MatMulInteger, Cast, Mul): ONNX Runtime
    makes it one DynamicQuantizeMatMul that adds the bias too, and qtool's runtime one step
    (test_runtime_dynamic: ORT's output bit for bit); the int8 embedding lookup is one step too."""
    import onnxruntime as ort

    from qtool.runtime import NativeSession
    work = calibrate_samples(_block(bias=True), _samples(24, 1), tmp_path)
    q = quantize(work, QuantizeOptions(strict=True), verbose=False)
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    sess = ort.InferenceSession(q.path, so, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]
    assert ops.count("DynamicQuantizeMatMul") == 1 and "Add" not in ops[ops.index("DynamicQuantizeMatMul"):], ops
    native = NativeSession(q.path, threads=2)
    steps = [type(st).__name__ for st in native.program.steps]
    assert steps.count("DynamicGemmStep") == 1 and "Add" not in {st.op for st in native.program.steps}, steps
    # and the int8 embedding table's five lookup nodes are one step
    assert steps.count("EmbeddingStep") == 1 and not {"Cast", "Unsqueeze"} & {st.op for st in native.program.steps}
    for feed in _samples(3, 5):  # (the LayerNorm before it is float arithmetic, computed in another order)
        np.testing.assert_allclose(native.run(None, feed)[0], sess.run(None, feed)[0], rtol=1e-5, atol=1e-5)


def test_a_constant_index_gather_and_a_static_friendly_layer_stay_as_they_were(tmp_path):
    """A Gather with constant indices is not a lookup table; a MatMul whose input one range holds keeps it static."""
    from qtool.quantize.embedding import embedding_gathers
    m = _block()
    m.graph.initializer.append(numpy_helper.from_array(np.array([1, 2], np.int64), "const_ids"))
    m.graph.node.insert(0, helper.make_node("Gather", ["table", "const_ids"], ["c"], name="const_gather"))
    assert [n.name for n in embedding_gathers(m)] == ["embed"]
    assert embedding_gathers(m, {"embed": "user"}) == []
    small = _block()  # a token-type table of two rows: its rounding would be in every position, for kilobytes
    small.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.ones((2, D), np.float32), "table"))
    assert embedding_gathers(small) == []

    samples = _samples(24, 3)
    for s in samples:
        s["s"][...] = 1.0  # one scale for every sample: a static range holds the input
    work = calibrate_samples(_block(), samples, tmp_path)
    quantize(work, QuantizeOptions(strict=True), verbose=False)
    report = json.load(open(os.path.join(work, "quantize.json")))
    assert not report["dynamic_inputs"]["layers"]["dense"]["dynamic"]
    assert not any(n.op_type == "DynamicQuantizeLinear" for n in onnx.load(os.path.join(work, "model.int8.onnx")).graph.node)


def test_a_model_that_takes_any_batch_is_measured_one_sample_a_run(tmp_path):
    """A run-time range is each sample's own: with a free batch axis, quantize's measurements (the dynamic
    choice's figures, and the output judged with DynamicQuantizeLinear in the model) run one sample at a time
    and find what the model of batch 1 finds. Batched, the per-sample scales (1/30 to 10) would share one range
    per batch and the dynamic input would measure far worse."""
    samples = _samples(24, 1)
    reports = []
    for name, batch in (("one", 1), ("free", None)):
        work = calibrate_samples(_block(batch), samples, tmp_path / name)
        quantize(work, QuantizeOptions(strict=True), verbose=False)
        reports.append(json.load(open(os.path.join(work, "quantize.json")))["dynamic_inputs"])
    one, free = reports
    for key in ("static_sqnr_db", "dynamic_sqnr_db"):
        assert abs(one["layers"]["dense"][key] - free["layers"]["dense"][key]) < 0.01, key
    assert free["layers"]["dense"]["dynamic"]
    assert abs(one["output_sqnr_db"]["needed"] - free["output_sqnr_db"]["needed"]) < 0.01
