"""A small encoder block as exporters write it (LayerNormalization at opset 17 or the decomposed
ReduceMean/Sub/Pow/Sqrt/Div chain, scaled and masked attention with Softmax, the erf GELU chain, the
dynamic int8 MatMuls) on the native runtime: the chains become native float32 steps (the report says
so), and the outputs stay within the fp32 ops' tolerance of ONNX Runtime (1e-5 of the output's
range: float32 sums in another order) and of the numpy steps the runtime takes without the kernels."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ort = pytest.importorskip("onnxruntime")

from qtool.runtime import NativeSession  # noqa: E402

H, HEADS = 32, 2
R = np.random.default_rng(3)


def _w(*shape, s=0.2):
    return (R.standard_normal(shape) * s).astype(np.float32)


def _layernorm(nodes, inits, x, out, decomposed, tag):
    g, b = f"{tag}_g", f"{tag}_b"
    inits += [numpy_helper.from_array(_w(H, s=1.0) + 1, g), numpy_helper.from_array(_w(H), b)]
    if not decomposed:
        nodes.append(helper.make_node("LayerNormalization", [x, g, b], [out], axis=-1, epsilon=1e-5))
        return
    inits += [numpy_helper.from_array(np.array(2.0, np.float32), f"{tag}_two"),
              numpy_helper.from_array(np.array(1e-6, np.float32), f"{tag}_eps")]
    t = lambda s: f"{tag}_{s}"  # noqa: E731
    nodes += [helper.make_node("ReduceMean", [x], [t("m")], axes=[-1]),
              helper.make_node("Sub", [x, t("m")], [t("d")]),
              helper.make_node("Pow", [t("d"), f"{tag}_two"], [t("p")]),
              helper.make_node("ReduceMean", [t("p")], [t("v")], axes=[-1]),
              helper.make_node("Add", [t("v"), f"{tag}_eps"], [t("ve")]),
              helper.make_node("Sqrt", [t("ve")], [t("s")]),
              helper.make_node("Div", [t("d"), t("s")], [t("n")]),
              helper.make_node("Mul", [t("n"), g], [t("ng")]),
              helper.make_node("Add", [t("ng"), b], [out])]


def _dyn_matmul(nodes, inits, x, out, k, n, tag):
    w = R.integers(-127, 128, (k, n)).astype(np.int8)
    inits += [numpy_helper.from_array(w, f"{tag}_w"), numpy_helper.from_array((R.random(n) * 0.01 + 1e-3).astype(np.float32), f"{tag}_sw"),
              numpy_helper.from_array(np.zeros(n, np.int8), f"{tag}_zw"), numpy_helper.from_array(_w(n), f"{tag}_bias")]
    nodes += [helper.make_node("DequantizeLinear", [f"{tag}_w", f"{tag}_sw", f"{tag}_zw"], [f"{tag}_wd"], axis=1),
              helper.make_node("DynamicQuantizeLinear", [x], [f"{tag}_q", f"{tag}_qs", f"{tag}_qz"]),
              helper.make_node("DequantizeLinear", [f"{tag}_q", f"{tag}_qs", f"{tag}_qz"], [f"{tag}_xd"]),
              helper.make_node("MatMul", [f"{tag}_xd", f"{tag}_wd"], [f"{tag}_mm"]),
              helper.make_node("Add", [f"{tag}_bias", f"{tag}_mm"], [out])]


def encoder(decomposed: bool, opset: int = 17):
    nodes, inits = [], []
    c = lambda v, name: inits.append(numpy_helper.from_array(np.array(v, np.float32), name)) or name  # noqa: E731
    _layernorm(nodes, inits, "x", "h0", decomposed, "ln0")
    for t in ("q", "k", "v"):
        _dyn_matmul(nodes, inits, "h0", t, H, H, t)
        inits.append(numpy_helper.from_array(np.array([1, -1, HEADS, H // HEADS], np.int64), f"{t}_shape"))
        nodes += [helper.make_node("Reshape", [t, f"{t}_shape"], [f"{t}_r"]),
                  helper.make_node("Transpose", [f"{t}_r"], [f"{t}_t"], perm=[0, 2, 3, 1] if t == "k" else [0, 2, 1, 3])]
    nodes += [helper.make_node("MatMul", ["q_t", "k_t"], ["sc"]),
              helper.make_node("Div", ["sc", c(np.sqrt(H // HEADS), "sqrt_d")], ["scd"]),
              helper.make_node("Unsqueeze", ["mask", c_axes(inits)], ["m4"]),
              helper.make_node("Sub", [c(1.0, "one_m"), "m4"], ["inv"]),
              helper.make_node("Mul", ["inv", c(-10000.0, "neg")], ["bias"]),
              helper.make_node("Add", ["scd", "bias"], ["scm"]),
              helper.make_node("Softmax", ["scm"], ["pr"], axis=-1),
              helper.make_node("MatMul", ["pr", "v_t"], ["ctx"]),
              helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ctx_t", c_shape(inits)], ["ctx_r"]),
              helper.make_node("Add", ["ctx_r", "h0"], ["res"])]
    _layernorm(nodes, inits, "res", "h1", decomposed, "ln1")
    _dyn_matmul(nodes, inits, "h1", "up", H, 4 * H, "up")
    nodes += [helper.make_node("Div", ["up", c(1.4142135, "sqrt2")], ["gd"]),
              helper.make_node("Erf", ["gd"], ["ge"]),
              helper.make_node("Add", ["ge", c(1.0, "one")], ["ga"]),
              helper.make_node("Mul", ["up", "ga"], ["gm"]),
              helper.make_node("Mul", ["gm", c(0.5, "half")], ["gelu"])]
    _dyn_matmul(nodes, inits, "gelu", "down", 4 * H, H, "down")
    nodes.append(helper.make_node("Add", ["down", "h1"], ["y"]))
    g = helper.make_graph(nodes, "enc", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "L", H]),
                                         helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, "L"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def c_axes(inits):
    inits.append(numpy_helper.from_array(np.array([1, 2], np.int64), "mask_axes"))
    return "mask_axes"


def c_shape(inits):
    inits.append(numpy_helper.from_array(np.array([1, -1, H], np.int64), "ctx_shape"))
    return "ctx_shape"


@pytest.mark.parametrize("decomposed", [False, True])
@pytest.mark.parametrize("length", [7, 33])
def test_encoder_block_native_kernels_match_ort(decomposed, length, tmp_path):
    m = encoder(decomposed, opset=13 if decomposed else 17)
    path = str(tmp_path / "enc.onnx")
    onnx.save(m, path)
    x = R.standard_normal((1, length, H)).astype(np.float32)
    mask = np.ones((1, length), np.float32)
    mask[0, length - 2:] = 0
    feeds = {"x": x, "mask": mask}
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    sess = NativeSession(path, threads=2)
    got = sess.run(None, feeds)[0]
    got2 = sess.run(None, feeds)[0]  # the bound plan
    np.testing.assert_array_equal(got, got2)
    tol = 1e-5 * float(np.abs(ref).max())
    assert np.abs(got - ref).max() <= tol, np.abs(got - ref).max()
    fused = sorted((e.op, e.detail.split(" as ")[0]) for e in sess.report_entries()
                   if e.mode == "fp32" and "native" in e.detail)
    first_ln = ("ReduceMean", "9 nodes of a LayerNorm") if decomposed else ("LayerNormalization", "native LayerNorm kernel")
    assert fused == sorted([first_ln, ("Add", f"residual Add and LayerNorm ({9 if decomposed else 1} nodes)"),
                            ("Add", "masked Softmax (2 nodes)"),  # (the mask is made after the Div)
                            ("Div", "erf GELU (5 nodes)")]
                          + [("MatMul", "native float32 MatMul of two activations")] * 2), fused
    numpy_steps = NativeSession(path, threads=2, backend="reference").run(None, feeds)[0]
    assert np.abs(got - numpy_steps).max() <= tol


def test_a_chain_read_in_the_middle_runs_node_by_node(tmp_path):
    """The GELU's Erf output is also a graph output: no fusion (Erf alone may still be native)."""
    m = encoder(False)
    m.graph.output.append(helper.make_tensor_value_info("ge", TensorProto.FLOAT, None))
    path = str(tmp_path / "enc.onnx")
    onnx.save(m, path)
    feeds = {"x": R.standard_normal((1, 5, H)).astype(np.float32), "mask": np.ones((1, 5), np.float32)}
    sess = NativeSession(path, threads=1)
    got = sess.run(None, feeds)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(got, ref):
        assert np.abs(a - b).max() <= 1e-5 * float(np.abs(b).max())
    assert not any("GELU" in e.detail for e in sess.report_entries())


def test_views_made_once_follow_new_inputs(tmp_path):
    """The Reshape/Transpose views of plan buffers are made once per plan: a second run with other
    values must still read the new values (and the plan has fewer calls than steps)."""
    path = str(tmp_path / "enc.onnx")
    onnx.save(encoder(False), path)
    sess = NativeSession(path, threads=2)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for seed in (1, 2):
        g = np.random.default_rng(seed)
        feeds = {"x": g.standard_normal((1, 9, H)).astype(np.float32), "mask": np.ones((1, 9), np.float32)}
        want = ref.run(None, feeds)[0]
        got = sess.run(None, feeds)[0]
        assert np.abs(got - want).max() <= 1e-5 * float(np.abs(want).max())
    (plan,) = sess._plans.values()
    views = [st.op for st, _ in plan.steps_calls if st.op in ("Reshape", "Transpose") and st.mode == "fp32"]
    # q, k, v's and the context's Transpose (of a native MatMul's buffer) made once; the Reshape of that
    # transposed view copies, so it runs
    assert sorted(views) == ["Reshape"], views


def test_bench_times_another_ort_model_in_the_same_rounds(tmp_path):
    """`qtool bench --ort-model` (BenchOptions.others): another file with the same inputs, e.g. ONNX
    Runtime's quantize_dynamic output, gets its own ratio; a file with other inputs is refused."""
    from qtool.errors import QtoolError
    from qtool.runtime.bench import BenchOptions, bench, format_batch
    path, other = str(tmp_path / "enc.int8.onnx"), str(tmp_path / "other.onnx")

    def static(m):  # 6 tokens
        for i in m.graph.input:
            i.type.tensor_type.shape.dim[1].dim_value = 6
        return m
    onnx.save(static(encoder(False)), path)
    onnx.save(static(encoder(True)), other)
    opts = BenchOptions(batches=(1,), threads=1, repeats=1, rounds=2, round_s=0.0, settle_s=0.0, max_rounds=2,
                        others=(other,))
    r = bench(path, None, opts, log=None)["batches"][1]
    assert set(r["ratios"]) == {"ort_int8", "ort:other.onnx"} and r["ort:other.onnx_ms"] > 0
    assert "ORT other.onnx" in format_batch(1, r)
    m = static(encoder(False))
    m.graph.input[1].name = "attention"
    for n in m.graph.node:
        n.input[:] = ["attention" if i == "mask" else i for i in n.input]
    onnx.save(m, other)
    with pytest.raises(QtoolError, match="inputs"):
        bench(path, None, opts, log=None)


@pytest.mark.parametrize("decomposed", [False, True])
def test_residual_sum_read_elsewhere_is_kept(decomposed, tmp_path):
    """Add(a, b) -> LayerNorm where the sum is also a graph output (a pre-LN block's next residual): one
    native step writes both, each equal to ONNX Runtime's (the sum bit for bit)."""
    nodes, inits = [helper.make_node("Add", ["a", "b"], ["s"])], []
    _layernorm(nodes, inits, "s", "y", decomposed, "ln")
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "L", H]) for n in ("a", "b")]
    g = helper.make_graph(nodes, "g", vi, [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "s")],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = str(tmp_path / "res.onnx")
    onnx.save(m, path)
    feeds = {n: R.standard_normal((1, 11, H)).astype(np.float32) for n in ("a", "b")}
    sess = NativeSession(path, threads=1)
    y, s = sess.run(None, feeds)
    ry, rs = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(s, rs)
    assert np.abs(y - ry).max() <= 1e-5 * float(np.abs(ry).max())
    assert [e.detail for e in sess.report_entries() if e.mode == "fp32"] == [
        f"residual Add and LayerNorm ({9 if decomposed else 1} nodes) as one native kernel"]


def test_float16_ops_keep_numpy_and_their_type(tmp_path):
    """The float32 kernels take float32 only: a float16 Softmax/Erf runs as numpy's op, float16 out."""
    g = helper.make_graph([helper.make_node("Softmax", ["x"], ["s"], axis=-1), helper.make_node("Erf", ["s"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = str(tmp_path / "h.onnx")
    onnx.save(m, path)
    x = R.random((2, 8)).astype(np.float16)
    sess = NativeSession(path, threads=1)
    y = sess.run(None, {"x": x})[0]
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert y.dtype == np.float16 and np.abs(y.astype(np.float32) - ref).max() <= 2e-3
    assert not any("native" in e.detail for e in sess.report_entries())
