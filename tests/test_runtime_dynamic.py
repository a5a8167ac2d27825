"""Dynamic quantization in the native runtime: DynamicQuantizeLinear -> DequantizeLinear -> MatMul
with an int8 weight (per column or per tensor) runs as DynamicQuantizeStep + DynamicGemmStep, and
gives ONNX Runtime's output (its MatMulIntegerToFloat / DynamicQuantizeMatMul fusion) bit for bit,
on every kernel set, under the arithmetic this machine's ORT applies (exact with VNNI, int16-saturating
pairs without), and the numpy reference in qtool.runtime.dynamic_quant under the exact one."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

ort = pytest.importorskip("onnxruntime")

import qtool.kernels as K  # noqa: E402
from helpers import kernel_set  # noqa: E402
from qtool.arithmetic import EXACT  # noqa: E402
from qtool.ort_arithmetic import ort_int8_arithmetic  # noqa: E402
from qtool.runtime import NativeSession  # noqa: E402
from qtool.runtime.dynamic_quant import dynamic_qparams, k_chunks, matmul_integer_to_float, quantize_u8  # noqa: E402

KERNEL_SETS = K.available_isas() + (["avx2-exact"] if "avx2" in K.available_isas() else [])


@pytest.fixture(params=KERNEL_SETS)
def isa(request):
    with kernel_set(request.param) as tier:
        yield tier


def _weights(rng, k, n, per_column=True, big=False):
    w = np.full((k, n), 127, np.int8) if big else rng.integers(-127, 128, (k, n)).astype(np.int8)
    if big:
        w[:, ::2] = -127
    s = (rng.random(n if per_column else 1) * 0.02 + 1e-3).astype(np.float32)
    return w, s


def dyn_model(x_shape, w, s, *, bias=None, extra_reader=False, second_matmul=None, opset=17, form="qdq", u8=False):
    """x -> DynamicQuantizeLinear -> DequantizeLinear -> MatMul(., DQ(w, s, axis=1)) [+ bias] -> y, or with
    form="integer": x -> DynamicQuantizeLinear -> MatMulInteger(., w) -> Cast -> Mul(., qs * sw) [+ bias] -> y
    (the weight stored as uint8 + 128 with u8; a second MatMul on the same DQ, or a Relu reading the DQ,
    when asked)."""
    k, n = w.shape
    zero = np.zeros(n if s.size > 1 else (), np.int8)
    if u8:
        w, zero = (w.astype(np.int16) + 128).astype(np.uint8), np.full(zero.shape, 128, np.uint8)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(s.reshape(-1) if s.size > 1 else s.reshape(()), "sw"),
             numpy_helper.from_array(zero, "zw")]
    if form == "integer":
        nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "qs", "qz"]),
                 helper.make_node("Mul", ["qs", "sw"], ["mult"]),  # (before the MatMulInteger, as quantize_dynamic writes it)
                 helper.make_node("MatMulInteger", ["q", "w", "qz", "zw"], ["acc"]),
                 helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
                 helper.make_node("Mul", ["accf", "mult"], ["mm"])]
    else:
        nodes = [helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wd"], axis=1),
                 helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "qs", "qz"]),
                 helper.make_node("DequantizeLinear", ["q", "qs", "qz"], ["xd"]),
                 helper.make_node("MatMul", ["xd", "wd"], ["mm"])]
    outs = ["y"]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "b"))
        nodes.append(helper.make_node("Add", ["b", "mm"], ["y"]))  # the bias first, as torch exports it
    else:
        nodes.append(helper.make_node("Identity", ["mm"], ["y"]))
    if second_matmul is not None:
        w2, s2 = second_matmul
        inits += [numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(s2, "sw2")]
        nodes += [helper.make_node("DequantizeLinear", ["w2", "sw2"], ["wd2"], axis=1),
                  helper.make_node("MatMul", ["xd", "wd2"], ["y2"])]
        outs.append("y2")
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["xd"], ["r"]))
        outs.append("r")
    # leading dims symbolic, as exporters write them (with static ones ORT folds MatMul + Add into a float Gemm)
    dims = [f"d{i}" for i in range(len(x_shape) - 1)] + [x_shape[-1]]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _ort(m, x):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def _native(m, x, path, arithmetic=None):
    """The runtime's outputs and session, under the integer arithmetic this machine's ORT applies (its
    u8 x s8 pairs summed in a saturating int16 without VNNI) unless `arithmetic` says otherwise: what a
    comparison with ORT must use to hold on every x86 tier."""
    import onnx
    onnx.save(m, path)
    sess = NativeSession(str(path), threads=2, arithmetic=arithmetic or ort_int8_arithmetic())
    return sess.run(None, {"x": x}), sess


CASES = [  # (x shape, K, N, per column, bias, x offset)
    ((1, 7, 16), 16, 24, True, False, 0.0),
    ((2, 5, 64), 64, 48, True, True, 0.0),
    ((33, 384), 384, 96, True, True, 0.0),
    ((1, 33, 384), 384, 96, True, True, 0.0),
    ((1, 32, 1536), 1536, 40, True, False, 0.0),
    ((3, 20), 20, 5, False, False, 0.0),
    ((4, 9, 32), 32, 17, True, True, 3.0),    # all positive: the range starts at 0, zero point 0
    ((4, 9, 32), 32, 17, True, False, -3.0),  # all negative: zero point 255
]


FORMS = [("qdq", False), ("integer", False), ("integer", True)]


@pytest.mark.parametrize("form", FORMS, ids=["qdq", "integer", "integer-u8"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[2]}" for c in CASES])
def test_dynamic_matmul_matches_ort_bit_for_bit(case, form, isa, tmp_path):
    shape, k, n, per_col, with_bias, off = case
    rng = np.random.default_rng(k * 7 + n)
    w, s = _weights(rng, k, n, per_col)
    x = (rng.standard_normal(shape) * 2 + off).astype(np.float32)
    bias = (rng.standard_normal(n) * 0.1).astype(np.float32) if with_bias else None
    m = dyn_model(shape, w, s, bias=bias, form=form[0], u8=form[1])
    (y,), sess = _native(m, x, tmp_path / "m.onnx")
    (ref,) = _ort(m, x)
    kinds = {e.op: e.mode for e in sess.report_entries()} if hasattr(sess, "report_entries") else None
    steps = [type(st).__name__ for st in sess.program.steps]
    assert steps.count("DynamicGemmStep") == 1, kinds
    # one step each for the quantize and the GEMM: the Cast, the scales' Muls and a bias Add run inside
    assert len(steps) == 2 + (bias is None), steps  # (+ the Identity)
    if with_bias and len(shape) == 2 and form[0] == "qdq":
        # ORT folds a 2-D MatMul + Add into a float Gemm on the dequantized values (the integer form it runs in int8)
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    else:  # its DynamicQuantizeMatMul / MatMulIntegerToFloat
        np.testing.assert_array_equal(y, ref)
    # and the numpy reference of the exact arithmetic
    if ort_int8_arithmetic() != EXACT:
        (y,), _ = _native(m, x, tmp_path / "m.onnx", EXACT)
    sc, zp = dynamic_qparams(x)
    want = matmul_integer_to_float(quantize_u8(x, sc, zp).reshape(-1, k), zp, w, np.float32(sc) * s.reshape(-1))
    if bias is not None:
        want = want + bias
    np.testing.assert_array_equal(y.reshape(-1, n), want)


def test_dynamic_matmul_long_k_is_split_and_exact(isa, tmp_path):
    """255 * sum(|w|) over K beyond 2^24: float32 partial sums would round; K runs in chunks."""
    rng = np.random.default_rng(5)
    w, s = _weights(rng, 1200, 8, big=True)
    assert len(k_chunks(np.ascontiguousarray(w.T))) > 1
    x = np.abs(rng.standard_normal((3, 1200))).astype(np.float32) + 5  # every code near 255
    x[0, 0] = -0.01
    m = dyn_model(x.shape, w, s)
    (y,), sess = _native(m, x, tmp_path / "m.onnx")
    (ref,) = _ort(m, x)
    np.testing.assert_array_equal(y, ref)


def test_dynamic_quantize_shared_and_mixed_readers(tmp_path):
    """One DynamicQuantizeLinear read by two MatMuls stays one step; a DequantizeLinear also read by
    another op runs in fp32 (and its MatMuls with it), still as ORT computes."""
    rng = np.random.default_rng(9)
    w, s = _weights(rng, 32, 16)
    w2, s2 = _weights(rng, 32, 8)
    x = rng.standard_normal((2, 6, 32)).astype(np.float32)
    m = dyn_model(x.shape, w, s, second_matmul=(w2, s2))
    ys, sess = _native(m, x, tmp_path / "a.onnx")
    names = [type(st).__name__ for st in sess.program.steps]
    assert names.count("DynamicQuantizeStep") == 1 and names.count("DynamicGemmStep") == 2
    for y, r in zip(ys, _ort(m, x)):
        np.testing.assert_array_equal(y, r)
    m = dyn_model(x.shape, w, s, extra_reader=True)
    ys, sess = _native(m, x, tmp_path / "b.onnx")
    assert "DynamicGemmStep" not in {type(st).__name__ for st in sess.program.steps}
    for y, r in zip(ys, _ort(m, x)):
        np.testing.assert_allclose(y, r, rtol=1e-5, atol=1e-5)


def test_dynamic_quantize_step_matches_ort(tmp_path):
    rng = np.random.default_rng(2)
    for x in (rng.standard_normal((3, 50)).astype(np.float32) * 7, np.zeros((2, 3), np.float32),
              np.abs(rng.standard_normal((1, 4, 8))).astype(np.float32)):
        node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, None),
                               helper.make_tensor_value_info("s", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("z", TensorProto.UINT8, None)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
        m.ir_version = 8
        got, _ = _native(m, x, tmp_path / "q.onnx")
        for a, b in zip(got, _ort(m, x)):
            np.testing.assert_array_equal(np.asarray(a), b)


def test_both_forms_emulate_ort_without_vnni_alike(tmp_path):
    """Under ORT's x86 arithmetic without VNNI (u8 x s8 pairs summed in a saturating int16) a dynamic
    layer with int8 weights whose pairs can leave int16 runs the saturating kernels in either form, and
    the same weights stored as uint8 + 128 (ORT's exact u8 x u8 kernels there) do not."""
    import onnx
    from qtool.arithmetic import EXACT, ORT_X86_NOVNNI
    rng = np.random.default_rng(4)
    w, s = _weights(rng, 64, 8, big=True)
    x = np.abs(rng.standard_normal((1, 3, 64))).astype(np.float32) + 5  # every code near 255
    x[0, 0, 0] = -0.01

    def run(arithmetic, **kw):
        path = tmp_path / "m.onnx"
        onnx.save(dyn_model(x.shape, w, s, **kw), path)
        return NativeSession(str(path), threads=1, arithmetic=arithmetic).run(None, {"x": x})[0]

    exact = run(EXACT)
    sat = {form: run(ORT_X86_NOVNNI, form=form) for form in ("qdq", "integer")}
    assert not np.array_equal(sat["qdq"], exact)
    np.testing.assert_array_equal(sat["integer"], sat["qdq"])
    np.testing.assert_array_equal(run(ORT_X86_NOVNNI, form="integer", u8=True), exact)
    np.testing.assert_array_equal(run(EXACT, form="integer"), exact)


@pytest.mark.parametrize("form", ["qdq", "integer"])
def test_a_mul_by_a_row_before_the_quantize_runs_inside_it(form, isa, tmp_path):
    """x -> Mul(x, row [K]) -> DynamicQuantizeLinear (a migration's 1/s) is one DynamicQuantizeStep with the
    row as its multiplier: ORT's output bit for bit. A Mul by a scalar, or one whose product another op
    reads too, stays a Mul."""
    import onnx
    rng = np.random.default_rng(11)
    w, s = _weights(rng, 48, 24)
    x = rng.standard_normal((1, 9, 48)).astype(np.float32) * 3
    for row, also_read, fused in ((rng.random(48).astype(np.float32) * 5 + 0.1, False, True),
                                  (np.array([0.37], np.float32), False, False),
                                  (rng.random(48).astype(np.float32) + 0.5, True, False)):
        m = dyn_model(x.shape, w, s, form=form)
        g = m.graph
        g.initializer.append(numpy_helper.from_array(row, "row"))
        g.node.insert(0, helper.make_node("Mul", ["x", "row"], ["xs"], name="smooth"))
        for n in g.node:
            if n.op_type == "DynamicQuantizeLinear":
                n.input[0] = "xs"
        if also_read:
            g.node.append(helper.make_node("Relu", ["xs"], ["r"]))
            g.output.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
        ys, sess = _native(m, x, tmp_path / "m.onnx")
        ops = [st.op for st in sess.program.steps]
        assert ("Mul" not in ops) == fused, ops
        assert [type(st).__name__ for st in sess.program.steps].count("DynamicGemmStep") == 1
        for y, r in zip(ys, _ort(m, x)):
            np.testing.assert_array_equal(y, r)
