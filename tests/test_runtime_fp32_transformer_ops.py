"""The fp32 ops transformer exports carry, against ONNX Runtime one node at a time: random inputs of
several shapes (broadcasting where the op broadcasts), their attributes, and each opset where the
op's meaning changed (Softmax 11 vs 13, ReduceMean's axes as an input from 18, Gelu from 20)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

ort = pytest.importorskip("onnxruntime")

from qtool.runtime.fp32_ops import FP32_OPS  # noqa: E402

R = np.random.default_rng(0)
I64 = lambda *v: np.array(v, np.int64)  # noqa: E731


def f32(*shape, scale=1.0):
    return (R.standard_normal(shape) * scale).astype(np.float32)


def _dtype(a):
    return {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
            np.dtype(np.bool_): TensorProto.BOOL, np.dtype(np.int32): TensorProto.INT32,
            np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int8): TensorProto.INT8}[a.dtype]


def run_both(op, inputs, attrs, opset, n_out=1, const=()):
    """One-node model: `inputs` (None = omitted) as graph inputs, those at positions `const` as
    initializers; ONNX Runtime's outputs and FP32_OPS's."""
    while inputs and inputs[-1] is None:  # a trailing omitted input is left off the node
        inputs = inputs[:-1]
    at = dict(attrs, _n_outputs=n_out, _opset=opset)
    got = FP32_OPS[op](list(inputs), at)
    names = [f"i{k}" if a is not None else "" for k, a in enumerate(inputs)]
    outs = [f"o{k}" for k in range(n_out)]
    node = helper.make_node(op, names, outs, **attrs)
    g_in = [helper.make_tensor_value_info(n, _dtype(a), a.shape)
            for k, (n, a) in enumerate(zip(names, inputs)) if a is not None and k not in const]
    inits = [numpy_helper.from_array(a, n) for k, (n, a) in enumerate(zip(names, inputs)) if k in const]
    g_out = [helper.make_tensor_value_info(o, _dtype(np.asarray(y)), None) for o, y in zip(outs, got)]
    g = helper.make_graph([node], "g", g_in, g_out, initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    feeds = {n: a for k, (n, a) in enumerate(zip(names, inputs)) if a is not None and k not in const}
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    return ref, got


def check(op, inputs, attrs, opset, n_out=1, const=(), tol=2e-6):
    ref, got = run_both(op, inputs, attrs, opset, n_out, const)
    for r, y in zip(ref, got[:n_out]):
        y = np.asarray(y)
        assert y.shape == r.shape, (op, y.shape, r.shape)
        assert y.dtype == r.dtype, (op, y.dtype, r.dtype)
        if r.dtype.kind == "f":
            np.testing.assert_allclose(y, r, rtol=tol, atol=tol)
        else:
            np.testing.assert_array_equal(y, r)


@pytest.mark.parametrize("shape,axis", [((2, 7, 16), -1), ((3, 5, 8), 1), ((4, 33), -1), ((2, 3, 4, 6), 2)])
def test_layer_norm_all_outputs(shape, axis):
    d = shape[axis:] if axis >= 0 else shape[axis:]
    check("LayerNormalization", [f32(*shape, scale=3) + 2, f32(*d), f32(*d)], dict(axis=axis, epsilon=1e-3), 17,
          n_out=3)
    check("LayerNormalization", [f32(*shape), f32(*d), None], dict(axis=axis), 17, n_out=1)


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("axis", [None, 1, -1])
def test_softmax_family_by_opset(op, opset, axis):
    attrs = {} if axis is None else dict(axis=axis)
    check(op, [f32(2, 3, 5, 4, scale=4)], attrs, opset, tol=1e-6)


@pytest.mark.parametrize("opset", [13, 20])
def test_erf_and_gelu(opset):
    x = np.concatenate([f32(3, 1000, scale=2), np.array([[0, 1e-6, -1e-6, 3.9, -4.5, 7, 100, -0.5]] * 3, np.float32)],
                       axis=1)
    check("Erf", [x], {}, opset, tol=5e-7)
    if opset >= 20:
        check("Gelu", [x], {}, opset, tol=1e-6)
        check("Gelu", [x], dict(approximate="tanh"), opset, tol=1e-6)


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 2, -1])
def test_trilu(upper, k):
    x = f32(2, 5, 7)
    check("Trilu", [x] + ([] if k is None else [I64(k)]), dict(upper=upper), 14)


@pytest.mark.parametrize("a_shape,b_shape", [((2, 3, 4), (2, 3, 4)), ((1, 1, 4), (2, 3, 1)), ((3, 4), (4,))])
def test_where_and_comparisons_broadcast(a_shape, b_shape):
    a, b = f32(*a_shape), f32(*b_shape)
    b.flat[0] = a.flat[0]
    for op in ("Equal", "Less", "Greater", "GreaterOrEqual", "LessOrEqual"):
        check(op, [a, b], {}, 16)
    c = a > 0
    d = b > 0.5
    for op in ("And", "Or", "Xor"):
        check(op, [c, d], {}, 16)
    check("Not", [c], {}, 16)
    check("Where", [np.broadcast_to(c, np.broadcast_shapes(a_shape, b_shape)).copy(), a, b], {}, 16)
    check("Where", [d, a, np.array(-1e4, np.float32)], {}, 16)


def test_pow_sqrt_neg_div_sub():
    x = np.abs(f32(2, 3, 8)) + 0.1
    check("Pow", [x, np.array(2.0, np.float32)], {}, 15)
    check("Pow", [x, f32(8)], {}, 15)
    check("Sqrt", [x], {}, 13)
    check("Neg", [x], {}, 13)
    check("Div", [x, f32(1, 1, 8) + 3], {}, 14)
    check("Sub", [x, f32(3, 1)], {}, 14)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("axes,keep", [((-1,), 1), ((1, 2), 0), ((), 1)])
def test_reduce_mean_axes_by_opset(opset, axes, keep):
    x = f32(2, 5, 6)
    for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceL2", "ReduceSumSquare"):
        axes_as_input = opset >= 18 or op == "ReduceSum"
        if axes_as_input:
            ins, at = [x, I64(*axes) if axes else None], dict(keepdims=keep)
        else:
            ins, at = [x], dict(keepdims=keep, **({"axes": list(axes)} if axes else {}))
        check(op, ins, at, opset, tol=1e-5)


def test_decomposed_layer_norm_chain():
    """ReduceMean -> Sub -> Pow -> ReduceMean -> Add -> Sqrt -> Div, as the ViT export writes it."""
    x = f32(1, 7, 32, scale=2)
    (m,), _ = run_both("ReduceMean", [x], dict(axes=[-1]), 13)
    check("Sub", [x, m], {}, 13)


@pytest.mark.parametrize("start,limit,delta,dt", [(0, 10, 1, np.int64), (5, -3, -2, np.int64), (0.5, 3.2, 0.7, np.float32),
                                                  (3, 3, 1, np.int64), (1, 8, 3, np.int32)])
def test_range(start, limit, delta, dt):
    check("Range", [np.array(start, dt), np.array(limit, dt), np.array(delta, dt)], {}, 11)


@pytest.mark.parametrize("x_shape,shape", [((3, 1), (2, 1, 6)), ((1, 4), (4, 1)), ((2, 3), (3,)), ((1,), (1, 1, 5))])
def test_expand(x_shape, shape):
    check("Expand", [f32(*x_shape), I64(*shape)], {}, 13)
    check("Expand", [f32(*x_shape) > 0, I64(*shape)], {}, 13)


def test_cumsum_argmax_misc():
    x = f32(3, 6)
    for ex in (0, 1):
        for rev in (0, 1):
            check("CumSum", [x, I64(1).reshape(())], dict(exclusive=ex, reverse=rev), 14, tol=1e-5)
    x[0, 4] = x[0, 1] = 9
    for op in ("ArgMax", "ArgMin"):
        check(op, [x], dict(axis=1, keepdims=0, select_last_index=1), 13)
        check(op, [x], dict(axis=0), 13)
    for op in ("Sin", "Cos", "Softplus", "Sign"):
        check(op, [x], {}, 13, tol=1e-6)
    check("Einsum", [f32(2, 3, 4), f32(2, 4, 5)], dict(equation="bij,bjk->bik"), 12, tol=1e-5)
    check("Mod", [I64(7, -7, 5), I64(3, 3, -2)], {}, 13)
    check("Mod", [f32(6), f32(6) + 3], dict(fmod=1), 13, tol=1e-6)


@pytest.mark.parametrize("size,ctm,excl", [((1, 3, 16, 16), "half_pixel", 0), ((1, 3, 50, 41), "half_pixel", 0),
                                           ((1, 3, 16, 16), "pytorch_half_pixel", 1), ((1, 3, 30, 20), "align_corners", 0),
                                           ((1, 3, 9, 45), "asymmetric", 0)])
def test_resize_cubic(size, ctm, excl):
    """The position-embedding interpolation of ViT exports (37 x 37 -> 16 x 16 and up)."""
    x = f32(1, 3, 37, 37)
    check("Resize", [x, None, None, np.array(size, np.int64)],
          dict(mode="cubic", coordinate_transformation_mode=ctm, cubic_coeff_a=-0.75, exclude_outside=excl), 13, tol=1e-5)
    check("Resize", [x, None, np.array([1, 1, 0.5, 1.5], np.float32)], dict(mode="cubic", cubic_coeff_a=-0.5), 13,
          tol=1e-5)


def test_dynamic_quantize_linear_exact():
    for x in (f32(5, 64, scale=3), np.abs(f32(4, 9)), -np.abs(f32(4, 9)), np.zeros((3, 4), np.float32),
              np.array([[0.5, 2.5, -1.5, 1e-9]], np.float32) * np.float32(255 / 4)):
        ref, got = run_both("DynamicQuantizeLinear", [x], {}, 11, n_out=3)
        for r, y in zip(ref, got):
            np.testing.assert_array_equal(np.asarray(y), r)
            assert np.asarray(y).dtype == r.dtype


@pytest.mark.parametrize("b_type", [np.int8, np.uint8])
def test_matmul_integer(b_type):
    """MatMulInteger (a MatMulInteger no int8 rule takes runs as this op): zero points one, or per column
    of a 2-D b; a batched a. (ONNX also allows one per row of a 2-D a; ONNX Runtime does not.)"""
    lo, hi = (-128, 128) if b_type == np.int8 else (0, 256)
    for a_shape, b_shape, za, zb in (((3, 5), (5, 4), np.uint8(7), None), ((2, 3, 5), (5, 4), np.uint8(200), "col"),
                                    ((1, 7, 5), (5, 4), np.uint8(0), "col")):
        a = R.integers(0, 256, a_shape).astype(np.uint8)
        b = R.integers(lo, hi, b_shape).astype(b_type)
        za = R.integers(0, 256, a_shape[0]).astype(np.uint8) if isinstance(za, str) else np.array(za, np.uint8)
        zb = R.integers(lo, hi, b_shape[1]).astype(b_type) if zb == "col" else np.array(3, b_type)
        check("MatMulInteger", [a, b, za, zb], {}, 13, const=(1, 2, 3))


def test_arithmetic_writes_c_order_whatever_the_inputs_layout():
    """A transposed view plus a row (MPNet's position bias plus the mask) gives a C-ordered sum, which the
    native Softmax after it reads in place; the values are numpy's."""
    bias = f32(1, 4, 5, 3).transpose(0, 3, 1, 2)  # [1, 3, 4, 5], strided
    row = f32(1, 1, 1, 5)
    for op, ref in (("Add", np.add), ("Sub", np.subtract), ("Mul", np.multiply), ("Div", np.divide)):
        (y,) = FP32_OPS[op]([bias, row], {})
        assert y.flags.c_contiguous, op
        np.testing.assert_array_equal(y, ref(bias, row))
