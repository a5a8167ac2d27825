"""The runtime's fp32 numpy fallbacks against ONNX Runtime, one node at a time."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

ort = pytest.importorskip("onnxruntime")

from qtool.runtime.fp32_ops import FP32_OPS  # noqa: E402

X = np.random.default_rng(0).standard_normal((2, 5, 12, 11)).astype(np.float32)
I64 = lambda *v: np.array(v, np.int64)  # noqa: E731
F32 = lambda *v: np.array(v, np.float32)  # noqa: E731

CASES = [
    ("MaxPool", [], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("MaxPool", [], dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    ("MaxPool", [], dict(kernel_shape=[2, 3], strides=[1, 2], dilations=[2, 1], pads=[0, 1, 1, 0])),
    ("AveragePool", [], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("AveragePool", [], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1)),
    ("AveragePool", [], dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    # ceil_mode where the last window would start past the input: ONNX Runtime drops it (H 12 -> 4, not 5)
    ("AveragePool", [], dict(kernel_shape=[2, 2], strides=[3, 3], ceil_mode=1)),
    ("AveragePool", [], dict(kernel_shape=[3, 3], strides=[3, 3], pads=[1, 0, 1, 1], ceil_mode=1, count_include_pad=1)),
    ("MaxPool", [], dict(kernel_shape=[2, 2], strides=[3, 3], pads=[1, 0, 1, 1], ceil_mode=1)),
    ("GlobalAveragePool", [], {}),
    ("Conv", [np.random.default_rng(1).standard_normal((6, 5, 3, 3)).astype(np.float32)], dict(pads=[1, 0, 1, 2], strides=[2, 1])),
    ("Conv", [np.random.default_rng(2).standard_normal((5, 1, 3, 3)).astype(np.float32)], dict(group=5, auto_pad="SAME_UPPER")),
    ("Softmax", [], dict(axis=1)),
    ("Sigmoid", [], {}),
    ("HardSigmoid", [], dict(alpha=0.2, beta=0.5)),
    ("HardSwish", [], {}),
    ("LeakyRelu", [], dict(alpha=0.1)),
    ("Resize", [np.zeros(0, np.float32), F32(1, 1, 2, 2)], dict(mode="nearest")),
    ("Resize", [np.zeros(0, np.float32), np.zeros(0, np.float32), I64(2, 5, 7, 30)],
     dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")),
    # bilinear upsampling in every U-Net / FPN decoder (rembg's u2net: the runtime stopped at 'mode=linear')
    ("Resize", [np.zeros(0, np.float32), F32(1, 1, 2, 2)], dict(mode="linear")),
    ("Resize", [np.zeros(0, np.float32), F32(1, 1, 2.5, 0.5)], dict(mode="linear", coordinate_transformation_mode="asymmetric")),
    ("Resize", [np.zeros(0, np.float32), np.zeros(0, np.float32), I64(2, 5, 7, 30)],
     dict(mode="linear", coordinate_transformation_mode="align_corners")),
    ("Resize", [np.zeros(0, np.float32), np.zeros(0, np.float32), I64(2, 5, 24, 1)],
     dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel")),
    # a decoder's upsampling and a DB text head's: strides, pads, output_padding, groups, dilations, output_shape
    ("ConvTranspose", [np.random.default_rng(3).standard_normal((5, 4, 2, 2)).astype(np.float32),
                       np.random.default_rng(4).standard_normal(4).astype(np.float32)], dict(strides=[2, 2])),
    ("ConvTranspose", [np.random.default_rng(5).standard_normal((5, 3, 3, 3)).astype(np.float32)],
     dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])),
    ("ConvTranspose", [np.random.default_rng(6).standard_normal((5, 2, 3, 2)).astype(np.float32)],
     dict(strides=[3, 1], pads=[0, 1, 2, 0], dilations=[1, 2], group=5)),
    ("ConvTranspose", [np.random.default_rng(7).standard_normal((5, 3, 4, 4)).astype(np.float32)],
     dict(strides=[2, 2], output_shape=[25, 23])),
    ("ConvTranspose", [np.random.default_rng(8).standard_normal((5, 3, 3, 3)).astype(np.float32)],
     dict(strides=[2, 2], auto_pad="SAME_UPPER")),
    ("Slice", [I64(1, 2), I64(10, 100), I64(2, 3), I64(2, 3)], {}),
    ("Pad", [I64(0, 0, 1, 2, 0, 0, 3, 0), F32(0.5)], dict(mode="constant")),
    ("Transpose", [], dict(perm=[0, 2, 3, 1])),
    ("ReduceMean", [], dict(axes=[2, 3], keepdims=1)),
    ("Flatten", [], dict(axis=1)),
]


@pytest.mark.parametrize("op,extra,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_fp32_op_matches_ort(op, extra, attrs):
    names = ["x"] + [f"in{i}" for i in range(len(extra))]
    inits = [numpy_helper.from_array(a, n) for a, n in zip(extra, names[1:])]
    node = helper.make_node(op, names, ["y"], **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, X.shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    opset = 17 if op not in ("ReduceMean",) else 13
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]
    at = dict(attrs)
    at["_n_outputs"] = 1
    y = FP32_OPS[op]([X] + [e if e.size else None for e in extra], at)[0]
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


CASES_18 = [
    ("Resize", [np.zeros(0, np.float32), F32(2, 0.5)], dict(mode="nearest", axes=[2, 3])),
    ("Resize", [np.zeros(0, np.float32), F32(3)], dict(mode="nearest", axes=[-1])),
    ("Resize", [np.zeros(0, np.float32), np.zeros(0, np.float32), I64(30, 7)],
     dict(mode="nearest", axes=[2, 3], keep_aspect_ratio_policy="not_larger")),
    ("Resize", [np.zeros(0, np.float32), np.zeros(0, np.float32), I64(30, 7)],
     dict(mode="nearest", axes=[2, 3], keep_aspect_ratio_policy="not_smaller")),
    ("Split", [], dict(axis=3, num_outputs=3)),  # 11 = 4 + 4 + 3
    ("Split", [], dict(axis=1, num_outputs=2)),  # 5 = 3 + 2
]


@pytest.mark.parametrize("op,extra,attrs", CASES_18, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES_18)])
def test_fp32_op_matches_ort_opset18(op, extra, attrs):
    """Opset 18's Resize axes / keep_aspect_ratio_policy and Split num_outputs with uneven parts."""
    names = ["x"] + [f"in{i}" for i in range(len(extra))]
    inits = [numpy_helper.from_array(a, n) for a, n in zip(extra, names[1:])]
    n_out = attrs.get("num_outputs", 1)
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, names, outs, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, X.shape)],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    refs = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": X})
    at = dict(attrs)
    at["_n_outputs"] = n_out
    ys = FP32_OPS[op]([X] + [e if e.size else None for e in extra], at)
    assert len(ys) == len(refs)
    for y, ref in zip(ys, refs):
        assert y.shape == ref.shape
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op,direction,layout,extra", [  # (layout 0 only: ORT runs no other)
    ("LSTM", "forward", 0, {}), ("LSTM", "bidirectional", 0, {}), ("LSTM", "reverse", 0, {}),
    ("GRU", "forward", 0, {}), ("GRU", "bidirectional", 0, dict(linear_before_reset=1)), ("GRU", "reverse", 0, dict(linear_before_reset=1))])
def test_recurrent_ops_match_ort(op, direction, layout, extra):
    """LSTM and GRU (a CRNN's, a VAD's, a tagger's), with biases and initial states (ONNX Runtime runs no batch-first layout)."""
    rng = np.random.default_rng(11)
    t, n, i, h = 7, 3, 5, 4
    d, g = (2 if direction == "bidirectional" else 1), (4 if op == "LSTM" else 3)
    x = rng.standard_normal((n, t, i) if layout else (t, n, i)).astype(np.float32)
    arrays = [rng.standard_normal((d, g * h, i)).astype(np.float32) * 0.5,
              rng.standard_normal((d, g * h, h)).astype(np.float32) * 0.5,
              rng.standard_normal((d, 2 * g * h)).astype(np.float32) * 0.2]
    state = (n, d, h) if layout else (d, n, h)
    arrays.append(rng.standard_normal(state).astype(np.float32))  # initial_h
    names = ["x", "W", "R", "B", "", "h0"]
    if op == "LSTM":
        arrays.append(rng.standard_normal(state).astype(np.float32))  # initial_c
        names.append("c0")
    inits = [numpy_helper.from_array(a, nm) for a, nm in zip(arrays, [nm for nm in names[1:] if nm])]
    outs = ["y", "yh"] + (["yc"] if op == "LSTM" else [])
    node = helper.make_node(op, names, outs, hidden_size=h, direction=direction, layout=layout, **extra)
    gr = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                           [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], initializer=inits)
    m = helper.make_model(gr, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    refs = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    at = dict(hidden_size=h, direction=direction, layout=layout, _n_outputs=len(outs), **extra)
    ys = FP32_OPS[op]([x] + arrays[:3] + [None] + arrays[3:], at)
    for y, ref in zip(ys, refs):
        assert y.shape == ref.shape
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_plans_for_many_input_sizes_are_bounded_by_bytes(tmp_path, monkeypatch):
    """One plan (and its buffers) per set of input shapes is kept for the next run of those shapes, at most
    PLANS of them and PLAN_BYTES together: photos of many sizes held 8 plans of 350 MB each."""
    import onnx
    from qtool.runtime import NativeSession
    from qtool.runtime import session as rs
    rng = np.random.default_rng(12)
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "h", "w"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, "h", "w"])],
                          [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, tmp_path / "m.onnx")
    s = NativeSession(str(tmp_path / "m.onnx"), threads=1)
    sizes = [(8, 8), (16, 8), (8, 16), (16, 16)]
    for h, w in sizes:
        s.run(None, {"x": rng.standard_normal((1, 3, h, w)).astype(np.float32)})
    assert len(s._plans) == 4
    for p in s._plans.values():
        p.bytes = 10 << 20  # (as if each held 10 MB of buffers)
    monkeypatch.setattr(rs, "PLAN_BYTES", 25 << 20)
    s.run(None, {"x": rng.standard_normal((1, 3, 24, 24)).astype(np.float32)})
    assert len(s._plans) == 3 and ((1, 3, 24, 24),) in s._plans  # the oldest two went, the newest stays
    monkeypatch.setattr(rs, "PLAN_BYTES", 1)
    s._plans[((1, 3, 24, 24),)].bytes = 10 << 20
    s.run(None, {"x": rng.standard_normal((1, 3, 8, 24)).astype(np.float32)})
    assert list(s._plans) == [((1, 3, 8, 24),)]  # (the newest is kept whatever its size)


_R = np.random.default_rng(3)
MOVES = [  # each with an input its op accepts (C a multiple of 4, H and W even)
    ("DepthToSpace", _R.standard_normal((2, 12, 3, 5)), [], dict(blocksize=2, mode="DCR")),
    ("DepthToSpace", _R.standard_normal((2, 12, 3, 5)), [], dict(blocksize=2, mode="CRD")),
    ("SpaceToDepth", _R.standard_normal((2, 3, 4, 6)), [], dict(blocksize=2)),
    ("GatherElements", _R.standard_normal((2, 5, 4, 3)), [_R.integers(-5, 5, (2, 5, 4, 3))], dict(axis=1)),
    # indices shorter than the data off the axis: the output takes the indices' shape
    ("GatherElements", _R.standard_normal((2, 5, 4, 3)), [_R.integers(-4, 4, (1, 2, 4, 2))], dict(axis=2)),
]


@pytest.mark.parametrize("op,x,extra,attrs", MOVES, ids=[f"{c[0]}-{i}" for i, c in enumerate(MOVES)])
def test_data_movement_ops_match_ort(op, x, extra, attrs):
    x = x.astype(np.float32)
    names = ["x"] + [f"in{i}" for i in range(len(extra))]
    inits = [numpy_helper.from_array(a, n) for a, n in zip(extra, names[1:])]
    g = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    y = FP32_OPS[op]([x] + extra, dict(attrs, _n_outputs=1))[0]
    assert y.shape == ref.shape
    np.testing.assert_array_equal(y, ref)
