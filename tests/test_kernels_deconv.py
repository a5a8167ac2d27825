"""ConvTranspose on the native kernels, on every kernel set this CPU has, and in the runtime.

int8 (qtool.kernels.pack_deconv2d / deconv2d, one convolution per output phase): bit for bit the numpy
reference (reference.deconv2d: every input pixel scatters its kernel, exact int32 sums, qparams'
requantization). ONNX Runtime runs a Q/DQ ConvTranspose in float (dequantize, float ConvTranspose,
quantize), so the runtime's int8 output is the exact one and ORT's may sit one step away where its float
sum rounds across a half: at most one step, and almost every value the same.
float32 (qtool.kernels.f32.conv_transpose, a GEMM then col2im): within float32 rounding of the float64
sum (1e-6 of the sum of the terms' magnitudes), the same tolerance against ORT's float ConvTranspose."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

K = pytest.importorskip("qtool.kernels")
from helpers import init, kernel_set, make_model, run  # noqa: E402
from qtool.kernel_params import DeconvGeometry  # noqa: E402
from qtool.kernels import reference as R  # noqa: E402
from qtool.kernels.deconv_phases import unsupported  # noqa: E402
from qtool.runtime.fp32_ops import conv_transpose  # noqa: E402
from test_kernels import KERNEL_SETS, canary_out, check, rand_u8  # noqa: E402

# (Cin, Cout/group, kernel, strides, pads, output_padding, group, H, W, N)
CASES = [
    (8, 5, (4, 4), (2, 2), (1, 1, 1, 1), (0, 0), 1, 5, 6, 1),        # a decoder's upsampling
    (16, 33, (2, 2), (2, 2), (0, 0, 0, 0), (0, 0), 1, 4, 3, 2),      # U-Net's, Cout past a 32-wide panel
    (6, 4, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 2, 5, 5, 1),        # grouped, output_padding
    (7, 3, (3, 2), (1, 1), (0, 1, 2, 0), (0, 0), 1, 4, 4, 1),        # stride 1, uneven pads
    (12, 12, (5, 3), (3, 2), (2, 1, 1, 0), (2, 1), 3, 3, 4, 2),      # phases with different tap counts
    (4, 1, (4, 4), (2, 2), (1, 1, 1, 1), (0, 0), 4, 6, 6, 1),        # depthwise phases
    (70, 40, (4, 4), (2, 2), (1, 1, 1, 1), (0, 0), 1, 9, 7, 1),      # K past the blocks, rows past MR
]
IDS = [f"k{c[2][0]}x{c[2][1]}s{c[3][0]}{c[3][1]}g{c[6]}" for c in CASES]


@pytest.fixture(params=KERNEL_SETS)
def kset(request):
    with kernel_set(request.param) as tier:
        K._native.set_parallel_min_ns(0)  # thread even the tiny cases
        yield tier
        K._native.set_parallel_min_ns(15000)


def _int8_case(rng, case):
    cin, og, k, s, pads, opad, g, h, w, n = case
    wq = rng.integers(-127, 128, (cin, og) + k).astype(np.int8)
    wq.flat[0], wq.flat[-1] = 127, -127
    q = dict(x_zp=int(rng.integers(0, 256)), multiplier=(rng.random(og * g) * 2e-3 + 5e-4).astype(np.float32),
             y_zp=int(rng.integers(0, 256)), lo=2, hi=251, geometry=DeconvGeometry(s, pads, opad, g))
    return wq, rng.integers(-4000, 4000, og * g).astype(np.int32), rand_u8(rng, (n, h, w, cin)), q


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("canary", [0xA5, 0x5A])
def test_int8_deconv_is_the_reference_bit_for_bit(kset, case, canary):
    rng = np.random.default_rng(hash(case) % 2 ** 32)
    wq, bias, x, q = _int8_case(rng, case)
    p = K.pack_deconv2d(wq, bias, **q)
    want = R.deconv2d(wq, bias, x, **q)
    big, out = canary_out(p.out_shape(*x.shape[:3]), np.uint8, canary)
    got = K.deconv2d(p, x, out=out)
    check("deconv2d", got, want, big, canary, 1, f"{kset} {case}")
    again = np.empty_like(want)
    K.bind_deconv2d(p, x, again)()  # the bound call the runtime uses
    np.testing.assert_array_equal(again, want)


def test_phase_split_refuses_what_it_cannot_do():
    assert unsupported((4, 4), (2, 2), (1, 1, 1, 1)) is None
    assert "smaller than stride" in unsupported((1, 1), (2, 2), (0, 0, 0, 0))
    assert "too large" in unsupported((3, 3), (1, 1), (3, 3, 3, 3))
    with pytest.raises(ValueError, match="smaller than stride"):
        K.pack_deconv2d(np.ones((2, 2, 1, 1), np.int8), None, x_zp=0, multiplier=1.0, y_zp=0,
                        geometry=DeconvGeometry((2, 2)))


@pytest.mark.parametrize("tier", [t for t in K.available_isas() if t != "amx"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float_conv_transpose_within_float32_rounding(tier, case):
    cin, og, k, s, pads, opad, g, h, w, n = case
    rng = np.random.default_rng(hash(case) % 2 ** 32)
    wf = rng.standard_normal((cin, og) + k).astype(np.float32)
    b = rng.standard_normal(og * g).astype(np.float32)
    x = rng.standard_normal((n, cin, h, w)).astype(np.float32)
    at = dict(strides=list(s), pads=list(pads), output_padding=list(opad), group=g)
    exact = conv_transpose([x.astype(np.float64), wf.astype(np.float64), b.astype(np.float64)], at)[0]
    size = conv_transpose([np.abs(x).astype(np.float64), np.abs(wf).astype(np.float64), np.abs(b).astype(np.float64)], at)[0]
    with kernel_set(tier):
        p = K.f32.pack_conv_transpose(wf, b, DeconvGeometry(s, pads, opad, g))
        out = np.full(p.out_shape(n, h, w), np.float32(-7.5e30))
        got = K.f32.conv_transpose(p, x, out=out)
    assert got.shape == exact.shape
    assert np.all(np.abs(got - exact) <= 1e-6 * size), f"{tier}: worst {np.max(np.abs(got - exact) / size):.2e}"


def _qdq_deconv_model(rng, cin=6, cout=5, hw=7):
    """x -> Q/DQ (uint8) -> ConvTranspose(DQ int8 W per Cout along axis 1, DQ int32 bias) -> Relu -> Q/DQ,
    as qtool writes a decoder's upsampling; and an input."""
    sx, zx = 0.03, 100
    wq = rng.integers(-127, 128, (cin, cout, 4, 4)).astype(np.int8)
    sw = (rng.uniform(0.5, 1.5, cout) * 2e-3).astype(np.float32)
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["wd"], axis=1),
             helper.make_node("DequantizeLinear", ["bq", "sb", "zb"], ["bd"], axis=0),
             helper.make_node("ConvTranspose", ["xd", "wd", "bd"], ["t"], strides=[2, 2], pads=[1, 1, 1, 1],
                              kernel_shape=[4, 4], name="up"),
             helper.make_node("Relu", ["t"], ["r"]),
             helper.make_node("QuantizeLinear", ["r", "sy", "zy"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"])]
    inits = [init("sx", sx), init("zx", zx, np.uint8), init("wq", wq, np.int8), init("sw", sw),
             init("zw", np.zeros(cout), np.int8), init("bq", rng.integers(-3000, 3000, cout), np.int32),
             init("sb", np.float32(sx) * sw), init("zb", np.zeros(cout), np.int32), init("sy", 0.011),
             init("zy", 0, np.uint8)]
    model = make_model(nodes, inits, [("x", [2, cin, hw, hw])], [("y", None)])
    x = (rng.standard_normal((2, cin, hw, hw)) * 2).astype(np.float32)
    return model, x


def test_runtime_runs_qdq_conv_transpose_in_int8_exactly_and_within_a_step_of_ort(tmp_path):
    from onnx import numpy_helper

    from qtool.qparams import ActQParams, quantize
    from qtool.runtime import NativeSession
    rng = np.random.default_rng(5)
    model, x = _qdq_deconv_model(rng)
    path = str(tmp_path / "ct.onnx")
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    sess = NativeSession(path, threads=2)
    assert any("int8:" in ln and "1 ConvTranspose" in ln for ln in sess.report().splitlines())
    ours = sess.run(None, {"x": x})[0]
    # the exact int8 result: the reference kernel on the model's own numbers
    v = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    xq = np.ascontiguousarray(quantize(x, ActQParams(float(v["sx"]), int(v["zx"]))).transpose(0, 2, 3, 1))
    mult = K.conv_multiplier(float(v["sx"]), v["sw"], float(v["sy"]))
    want = R.deconv2d(v["wq"], v["bq"], xq, x_zp=int(v["zx"]), multiplier=mult, y_zp=int(v["zy"]),
                      geometry=DeconvGeometry((2, 2), (1, 1, 1, 1)))
    want = (want.astype(np.float32) - np.float32(v["zy"])) * np.float32(v["sy"])
    np.testing.assert_array_equal(ours, want.transpose(0, 3, 1, 2))
    steps = np.rint(np.abs(ours - run(model, {"x": x})[0]) / float(v["sy"]))
    assert steps.max() <= 1 and (steps == 0).mean() >= 0.99


def test_runtime_runs_a_float_conv_transpose_on_the_native_kernel():
    from qtool.runtime import NativeSession
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=[2, 2], pads=[0, 1, 1, 0],
                              output_padding=[1, 0], group=2, name="up")]
    model = make_model(nodes, [init("w", rng.standard_normal((4, 3, 3, 3))), init("b", rng.standard_normal(6))],
                       [("x", [1, 4, 5, 6])], [("y", None)])
    import tempfile, os  # noqa: E401
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f.onnx")
        with open(path, "wb") as f:
            f.write(model.SerializeToString())
        sess = NativeSession(path, threads=2)
        x = rng.standard_normal((1, 4, 5, 6)).astype(np.float32)
        ours = sess.run(None, {"x": x})[0]
    assert "native float32 ConvTranspose" in sess.report()
    ref = run(model, {"x": x})[0]
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
