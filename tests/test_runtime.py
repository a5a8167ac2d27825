"""qtool.runtime.NativeSession against ONNX Runtime on the same QDQ int8 files.

Small float models are built with onnx.helper, quantized by ORT's quantize_static (QDQ, uint8
activations, int8 per-channel weights) and run by both runtimes: every uint8 output must match
within one quantization step (most match exactly). ORT's int8 weights are plain s8, whose sums
ORT computes exactly only on some CPUs: the native runtime runs them under the arithmetic this
machine's ORT uses (qtool/ort_arithmetic.py), so the comparison holds on a CPU without VNNI too."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ort = pytest.importorskip("onnxruntime")
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static  # noqa: E402

from qtool.errors import QtoolError  # noqa: E402
from qtool.ort_arithmetic import ort_int8_arithmetic  # noqa: E402
from qtool.runtime import NativeSession  # noqa: E402

RNG = np.random.default_rng(0)


def _w(name, *shape, scale=0.3):
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype(np.float32), name)


def _model(nodes, inits, in_shape, out_shape, out_name="y", opset=17):
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
                          [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, out_shape)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


class _Feed(CalibrationDataReader):
    def __init__(self, xs):
        self.it = iter(xs)

    def get_next(self):
        x = next(self.it, None)
        return None if x is None else {"x": x}


def _quantize(m, tmp_path, shape, name="m", n=6):
    f32, i8 = tmp_path / f"{name}.onnx", tmp_path / f"{name}.int8.onnx"
    onnx.save(m, f32)
    xs = [RNG.standard_normal(shape).astype(np.float32) for _ in range(n)]
    quantize_static(str(f32), str(i8), _Feed(xs), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return str(i8)


def _ort(path):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def _out_scale(path, out="y"):
    m = onnx.load(path)
    for n in m.graph.node:
        if n.op_type == "DequantizeLinear" and n.output[0] == out:
            return float(numpy_helper.to_array(next(i for i in m.graph.initializer if i.name == n.input[1])))
    return None


def _compare(path, shape, n=3, exact_frac=0.98):
    ours, ref = NativeSession(path, threads=2, arithmetic=ort_int8_arithmetic()), _ort(path)
    step = _out_scale(path)
    for _ in range(n):
        x = RNG.standard_normal(shape).astype(np.float32)
        a, b = ours.run(None, {"x": x})[0], ref.run(None, {"x": x})[0]
        assert a.shape == b.shape
        d = np.abs(a - b)
        if step is None:  # float output (Gemm without Q): compare relative to the range
            assert d.max() <= 1e-4 * max(1.0, np.abs(b).max()), d.max()
            continue
        assert d.max() <= step * 1.001, f"max diff {d.max() / step:.2f} steps"
        assert (d <= step * 1e-3).mean() >= exact_frac, f"only {(d <= step * 1e-3).mean():.4f} exact"
    return ours


def _cnn():
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "wd", "bd"], ["c2"], pads=[1, 1, 1, 1], group=16),
        helper.make_node("Clip", ["c2", "lo", "hi"], ["r2"]),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"]),
        helper.make_node("Add", ["c3", "r1"], ["a"]),
        helper.make_node("MaxPool", ["a"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["p", "w4"], ["c4"], pads=[0, 0, 2, 2], kernel_shape=[3, 3], group=2),
        helper.make_node("Concat", ["p", "c4"], ["cat"], axis=1),
        helper.make_node("AveragePool", ["cat"], ["ap"], kernel_shape=[2, 2], strides=[1, 1]),
        helper.make_node("GlobalAveragePool", ["ap"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1),
    ]
    inits = [_w("w1", 16, 3, 3, 3), _w("b1", 16, scale=0.1), _w("wd", 16, 1, 3, 3), _w("bd", 16, scale=0.1),
             _w("w3", 16, 16, 1, 1), _w("b3", 16, scale=0.1), _w("w4", 8, 8, 3, 3),
             _w("wf", 10, 24, scale=0.2), _w("bf", 10, scale=0.1),
             numpy_helper.from_array(np.float32(0.0), "lo"), numpy_helper.from_array(np.float32(6.0), "hi")]
    return _model(nodes, inits, ["N", 3, 20, 20], ["N", 10])


def test_cnn_matches_ort(tmp_path):
    path = _quantize(_cnn(), tmp_path, (1, 3, 20, 20))
    s = _compare(path, (1, 3, 20, 20))
    assert not s.fallback_nodes(), s.report()
    _compare(path, (3, 3, 20, 20), n=1)  # another batch size re-plans


def test_matmul_transpose_reshape(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["c1"], ["t"], perm=[0, 2, 3, 1]),
        helper.make_node("Reshape", ["t", "shp"], ["r"]),
        helper.make_node("MatMul", ["r", "wm"], ["mm"]),
        helper.make_node("Relu", ["mm"], ["y"]),
    ]
    inits = [_w("w1", 8, 4, 3, 3), _w("b1", 8, scale=0.1), _w("wm", 8, 5),
             numpy_helper.from_array(np.array([-1, 8], np.int64), "shp")]
    m = _model(nodes, inits, [1, 4, 6, 6], [36, 5])
    path = _quantize(m, tmp_path, (1, 4, 6, 6))
    s = _compare(path, (1, 4, 6, 6))
    assert not [f for f in s.fallback_nodes() if f[1] in ("Conv", "MatMul")], s.report()


def test_op_without_int8_kernel_runs_in_fp32(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Softmax", ["c1"], ["sm"], axis=1),
        helper.make_node("Conv", ["sm", "w2", "b2"], ["y"]),
    ]
    inits = [_w("w1", 8, 3, 3, 3), _w("b1", 8, scale=0.1), _w("w2", 4, 8, 1, 1), _w("b2", 4, scale=0.1)]
    m = _model(nodes, inits, [1, 3, 8, 8], [1, 4, 8, 8])
    path = _quantize(m, tmp_path, (1, 3, 8, 8))
    s = _compare(path, (1, 3, 8, 8), exact_frac=0.5)  # ORT's QLinearSoftmax uses a table of exp
    assert [op for _, op, _ in s.fallback_nodes()] == ["Softmax"], s.report()
    rep = s.report()
    assert "fp32 fallback (1 nodes)" in rep and "Softmax" in rep and "no int8 kernel" in rep


def test_silu_is_one_table(tmp_path):
    """x * Sigmoid(x) between Q/DQ: Sigmoid's table and the Mul compose into one 256-entry table."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c1"], ["s"]),
        helper.make_node("Mul", ["c1", "s"], ["silu"]),
        helper.make_node("Conv", ["silu", "w2", "b2"], ["c2"]),
        helper.make_node("Sigmoid", ["c2"], ["s2"]),
        helper.make_node("Mul", ["c2", "s2"], ["y"]),
    ]
    inits = [_w("w1", 8, 3, 3, 3), _w("b1", 8, scale=0.1), _w("w2", 4, 8, 1, 1), _w("b2", 4, scale=0.1)]
    m = _model(nodes, inits, [1, 3, 8, 8], [1, 4, 8, 8])
    path = _quantize(m, tmp_path, (1, 3, 8, 8))
    s = _compare(path, (1, 3, 8, 8), exact_frac=0.9)  # ORT's sigmoid table uses MLAS's approximation
    assert not s.fallback_nodes(), s.report()
    modes = {(e.op, e.mode) for e in s.report_entries()}
    assert ("Sigmoid", "fused") in modes and ("Mul", "int8") in modes, s.report()


def test_unknown_op_is_a_load_error(tmp_path):
    m = _model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("NonMaxSuppression", ["r", "r"], ["y"])],
               [], [1, 3, 4], [1, 3])
    p = tmp_path / "nms.onnx"
    onnx.save(m, p)
    with pytest.raises(QtoolError, match="NonMaxSuppression"):
        NativeSession(str(p))


def test_bad_input_shape_is_a_qtool_error(tmp_path):
    path = _quantize(_cnn(), tmp_path, (1, 3, 20, 20))
    s = NativeSession(path)
    with pytest.raises(QtoolError, match=r"input 'x' has shape \[1, 4, 20, 20\], expected \[N, 3, 20, 20\]"):
        s.run(None, {"x": np.zeros((1, 4, 20, 20), np.float32)})
    with pytest.raises(QtoolError, match="input 'x' has shape"):
        s.run(None, {"x": np.zeros((3, 20, 20), np.float32)})
    with pytest.raises(QtoolError, match="input 'x' is missing"):
        s.run(None, {})
    with pytest.raises(QtoolError, match="no such file"):
        NativeSession(str(tmp_path / "missing.onnx"))


def test_api_shape_and_buffers_are_reused(tmp_path):
    path = _quantize(_cnn(), tmp_path, (1, 3, 20, 20))
    s = NativeSession(path)
    (i,) = s.get_inputs()
    assert i.name == "x" and i.shape == ["N", 3, 20, 20]
    x = RNG.standard_normal((2, 3, 20, 20)).astype(np.float32)
    a = s.run(None, {"x": x})[0]
    b = s.run(["y"], {"x": x})[0]
    np.testing.assert_array_equal(a, b)
    a[:] = 0  # outputs are copies, not views of the plan's buffers
    np.testing.assert_array_equal(s.run(None, {"x": x})[0], b)


def test_unfolded_pad_and_batchnorm(tmp_path):
    """An exporter-style graph (explicit Pad, unfused BatchNormalization, Clip as ReLU6) quantized
    without pre-processing: Pad folds into the Conv, BN becomes a per-channel table, all exact."""
    ch = 6
    nodes = [
        helper.make_node("Pad", ["x", "pads", "zero"], ["xp"]),
        helper.make_node("Conv", ["xp", "w1"], ["c1"], strides=[2, 2]),
        helper.make_node("BatchNormalization", ["c1", "g", "b", "m", "v"], ["bn"]),
        helper.make_node("Clip", ["bn", "lo", "hi"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array([0, 0, 0, 0, 0, 0, 1, 1], np.int64), "pads"),
             numpy_helper.from_array(np.float32(0.0), "zero"), _w("w1", ch, 3, 3, 3),
             numpy_helper.from_array(RNG.uniform(0.5, 1.5, ch).astype(np.float32), "g"), _w("b", ch, scale=0.2),
             _w("m", ch, scale=0.2), numpy_helper.from_array(RNG.uniform(0.5, 2, ch).astype(np.float32), "v"),
             numpy_helper.from_array(np.float32(0.0), "lo"), numpy_helper.from_array(np.float32(6.0), "hi")]
    m = _model(nodes, inits, [1, 3, 9, 9], [1, ch, 4, 4])
    path = _quantize(m, tmp_path, (1, 3, 9, 9))
    s = _compare(path, (1, 3, 9, 9))
    modes = {(e.op, e.mode) for e in s.report_entries()}
    assert ("Pad", "fused") in modes and ("BatchNormalization", "int8") in modes, s.report()


def test_every_isa_matches_ort(tmp_path):
    """The packed kernels of every ISA the CPU has (forced with set_isa) give the same answers."""
    K = pytest.importorskip("qtool.kernels")
    if not hasattr(K, "available_isas"):
        pytest.skip("native kernels not built")
    path = _quantize(_cnn(), tmp_path, (1, 3, 20, 20))
    x = RNG.standard_normal((2, 3, 20, 20)).astype(np.float32)
    ref = _ort(path).run(None, {"x": x})[0]
    step = _out_scale(path)
    try:
        for isa in K.available_isas():
            K.set_isa(isa)
            s = NativeSession(path, arithmetic=ort_int8_arithmetic())
            assert s.backend == "native"
            y = s.run(None, {"x": x})[0]
            assert np.abs(y - ref).max() <= step * 1.001, isa
    finally:
        K.set_isa(None)


@pytest.mark.parametrize("backend", ["numpy", "reference"])
def test_numpy_backends_match_ort(tmp_path, backend):
    """The kernels' numpy reference and the executor's own stand-in (used when nothing native is
    built) are exact too."""
    path = _quantize(_cnn(), tmp_path, (1, 3, 20, 20))
    x = RNG.standard_normal((1, 3, 20, 20)).astype(np.float32)
    s = NativeSession(path, backend=backend, arithmetic=ort_int8_arithmetic())
    if s.backend != backend:
        pytest.skip(f"{backend} backend not importable")
    np.testing.assert_array_equal(s.run(None, {"x": x})[0], _ort(path).run(None, {"x": x})[0])


def test_slice_resize_concat_on_uint8(tmp_path):
    """Focus-style Slice/Concat and nearest Resize select uint8 values: int8, exact."""
    nodes = [
        helper.make_node("Slice", ["x", "s0", "e0", "ax", "st"], ["a"]),
        helper.make_node("Slice", ["x", "s1", "e1", "ax", "st"], ["b"]),
        helper.make_node("Concat", ["a", "b"], ["cat"], axis=1),
        helper.make_node("Conv", ["cat", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Resize", ["c1", "", "sc"], ["y"], mode="nearest"),
    ]
    i64 = lambda v, n: numpy_helper.from_array(np.array(v, np.int64), n)  # noqa: E731
    inits = [i64([0, 0], "s0"), i64([8, 8], "e0"), i64([1, 0], "s1"), i64([8, 8], "e1"), i64([2, 3], "ax"),
             i64([2, 2], "st"), _w("w1", 4, 6, 3, 3), _w("b1", 4, scale=0.1),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "sc")]
    m = _model(nodes, inits, [1, 3, 8, 8], [1, 4, 8, 8])
    path = _quantize(m, tmp_path, (1, 3, 8, 8))
    s = _compare(path, (1, 3, 8, 8))
    # ORT leaves the Slices on the float input (quantizing after them): those run in fp32
    assert {op for _, op, _ in s.fallback_nodes()} <= {"Slice"}, s.report()
    assert {e.op for e in s.report_entries() if e.mode == "int8"} >= {"Concat", "Conv", "Resize"}, s.report()


def test_int8_activations_run_in_fp32_and_say_why(tmp_path):
    """S8S8 models (int8 activations) have no int8 kernel here: every op runs in fp32 numpy
    between ONNX-exact Q/DQ, within one step of ORT, and the report names the reason."""
    f32, i8 = tmp_path / "m.onnx", tmp_path / "m.s8.onnx"
    onnx.save(_cnn(), f32)
    xs = [RNG.standard_normal((1, 3, 20, 20)).astype(np.float32) for _ in range(4)]
    quantize_static(str(f32), str(i8), _Feed(xs), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    # ORT without its int8 kernels (the QDQ graph in float, as we run it here): its int8 s8 x s8
    # sums are not exact on every CPU, so they are no reference for float ops between Q/DQ
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.add_session_config_entry("session.disable_quant_qdq", "1")
    s, ref = NativeSession(str(i8)), ort.InferenceSession(str(i8), so, providers=["CPUExecutionProvider"])
    step = _out_scale(str(i8))
    x = np.random.default_rng(5).standard_normal((2, 3, 20, 20)).astype(np.float32)
    a, b = s.run(None, {"x": x})[0], ref.run(None, {"x": x})[0]
    # float sums in another order: a value at a rounding boundary may land one step away. How many do
    # depends on ORT's float kernels on this CPU (AVX2: under 1 %; AVX-512 on Zen 5: 15 %)
    assert np.abs(a - b).max() <= step * 1.001 and (np.abs(a - b) < step * 1e-3).mean() > 0.75
    reasons = {op: why for _, op, why in s.fallback_nodes()}
    assert "Conv" in reasons and "not a dequantized uint8 tensor" in reasons["Conv"], s.report()


def test_auto_pad_same(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], auto_pad="SAME_UPPER", strides=[2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["y"], kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"),
    ]
    inits = [_w("w1", 8, 3, 3, 3), _w("b1", 8, scale=0.1)]
    m = _model(nodes, inits, ["N", 3, "H", "W"], ["N", 8, "h", "w"])
    path = _quantize(m, tmp_path, (1, 3, 11, 11))
    s = _compare(path, (1, 3, 11, 11))
    assert not s.fallback_nodes(), s.report()
    _compare(path, (1, 3, 16, 13), n=1)  # another size: packed again with its own pads


def test_float_hard_swish_chain_is_one_table(tmp_path):
    """x * Clip(x + 3, 0, 6) / 6 with no Q/DQ inside (as qtool's quantizer leaves hard-swish):
    the whole chain between DQ and Q is a function of the uint8 input, i.e. one table."""
    f = lambda v, n: numpy_helper.from_array(np.array(v, np.float32), n)  # noqa: E731
    q = lambda n, s, z: [numpy_helper.from_array(np.array(s, np.float32), n + "_s"),  # noqa: E731
                         numpy_helper.from_array(np.array(z, np.uint8), n + "_z")]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xq_s", "xq_z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xq_s", "xq_z"], ["xd"]),
        helper.make_node("Add", ["xd", "three"], ["a"]),
        helper.make_node("Clip", ["a", "zero", "six"], ["cl"]),
        helper.make_node("Div", ["cl", "six"], ["hs"]),
        helper.make_node("Mul", ["xd", "hs"], ["m"]),
        helper.make_node("QuantizeLinear", ["m", "yq_s", "yq_z"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "yq_s", "yq_z"], ["y"]),
    ]
    inits = q("xq", 0.05, 128) + q("yq", 0.04, 20) + [f(3, "three"), f(0, "zero"), f(6, "six")]
    m = _model(nodes, inits, [1, 4, 5, 5], [1, 4, 5, 5], opset=13)
    path = tmp_path / "hs.onnx"
    onnx.save(m, path)
    s = NativeSession(str(path))
    assert not s.fallback_nodes(), s.report()
    x = RNG.standard_normal((1, 4, 5, 5)).astype(np.float32) * 3
    np.testing.assert_array_equal(s.run(None, {"x": x})[0], _ort(str(path)).run(None, {"x": x})[0])


def test_views_from_fp32_ops_keep_their_buffer_alive(tmp_path):
    """An fp32 fallback Split returns views of the buffer it reads (a dequantized int8 output); that
    buffer must not go back to the pool while a view is still to be read (nudenet's YOLOv8 head
    read garbage: NaN and 1e24 in its boxes)."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Split", ["c1", "sp"], ["a", "b"], axis=1),
        helper.make_node("Conv", ["a", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c2", "w3", "b3"], ["c3"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c3", "b"], ["y"]),  # b read last, after c2 took a buffer
    ]
    # c2 (uint8, 32 channels) as large as dequantized c1 (float32, 8): the best fit for its buffer, once (wrongly) free
    inits = [_w("w1", 8, 3, 3, 3), _w("b1", 8, scale=0.1), _w("w2", 32, 4, 3, 3), _w("b2", 32, scale=0.1),
             _w("w3", 4, 32, 3, 3), _w("b3", 4, scale=0.1),
             numpy_helper.from_array(np.array([4, 4], np.int64), "sp")]
    m = _model(nodes, inits, [1, 3, 8, 8], [1, 4, 8, 8])
    f32, i8 = tmp_path / "v.onnx", tmp_path / "v.int8.onnx"
    onnx.save(m, f32)
    xs = [RNG.standard_normal((1, 3, 8, 8)).astype(np.float32) for _ in range(4)]
    quantize_static(str(f32), str(i8), _Feed(xs), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, op_types_to_quantize=["Conv"])
    x = xs[0]
    kept = NativeSession(str(i8), threads=1, reuse_buffers=False).run(None, {"x": x})[0]
    s = NativeSession(str(i8), threads=1)
    assert "Split" in [op for _, op, _ in s.fallback_nodes()], s.report()
    for _ in range(2):  # the trace run, then the bound buffers
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], kept)
