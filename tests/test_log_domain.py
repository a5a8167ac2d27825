"""rules/log_domain.py: a spectrum on its way to a Log stays fp32, the network after it int8."""
import numpy as np
import onnx
import pytest
from onnx import helper

from helpers import init, make_model, run, save
from qtool.plan import make_plan
from qtool.rules.log_domain import log_domain

FRAME, BINS, MELS = 64, 33, 12


def _front_end_nodes():
    """frames -> DFT (two MatMuls) -> re^2 + im^2 -> Sqrt -> mel MatMul -> + eps -> Log"""
    return [helper.make_node("MatMul", ["x", "dft_re"], ["re"], name="dft_re"),
            helper.make_node("MatMul", ["x", "dft_im"], ["im"], name="dft_im"),
            helper.make_node("Mul", ["re", "re"], ["re2"], name="re2"),
            helper.make_node("Mul", ["im", "im"], ["im2"], name="im2"),
            helper.make_node("Add", ["re2", "im2"], ["power"], name="power"),
            helper.make_node("Sqrt", ["power"], ["mag"], name="mag"),
            helper.make_node("MatMul", ["mag", "mel_w"], ["mel"], name="mel"),
            helper.make_node("Add", ["mel", "eps"], ["mel_eps"], name="eps"),
            helper.make_node("Log", ["mel_eps"], ["logmel"], name="log")]


def _front_end_inits(rng):
    n = np.arange(FRAME)[:, None] * np.arange(BINS)[None, :]
    window = np.hanning(FRAME)[:, None]
    mel = np.zeros((BINS, MELS))
    edges = np.linspace(0, BINS - 1, MELS + 2)
    for m in range(MELS):  # triangular filters
        lo, mid, hi = edges[m], edges[m + 1], edges[m + 2]
        k = np.arange(BINS)
        mel[:, m] = np.clip(np.minimum((k - lo) / (mid - lo), (hi - k) / (hi - mid)), 0, None)
    return [init("dft_re", window * np.cos(2 * np.pi * n / FRAME)),
            init("dft_im", -window * np.sin(2 * np.pi * n / FRAME)),
            init("mel_w", mel), init("eps", np.array(1e-6))]


def spectrum_model(seed=0):
    """A log-mel front end and a two-layer network over its frames: [N, T, 64] -> [N, T, 4]."""
    rng = np.random.default_rng(seed)
    nodes = _front_end_nodes() + [
        helper.make_node("MatMul", ["logmel", "w1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["hr"], name="relu1"),
        helper.make_node("MatMul", ["hr", "w2"], ["y"], name="fc2")]
    inits = _front_end_inits(rng) + [init("w1", rng.standard_normal((MELS, 16)) / 4),
                                     init("w2", rng.standard_normal((16, 4)) / 4)]
    return make_model(nodes, inits, [("x", ["N", 20, FRAME])], [("y", ["N", 20, 4])])


def sounds(rng, n):
    """n clips of 20 frames: a few partials whose levels span 60 dB, over a faint noise floor"""
    out = []
    for _ in range(n):
        t = np.arange(20 * FRAME) / 8000.0
        f0 = rng.uniform(150, 600)
        clip = sum(10.0 ** (-3.0 * k / 6) * np.sin(2 * np.pi * f0 * (k + 1) * t + rng.uniform(0, 6))
                   for k in range(7))
        clip = clip * rng.uniform(0.2, 1.0) + rng.standard_normal(t.size) * 1e-4
        out.append(clip.reshape(1, 20, FRAME).astype(np.float32))
    return out


def test_the_walk_takes_the_front_end_and_leaves_the_network():
    m = spectrum_model()
    assert log_domain(m) == {n: log_domain(m)[n] for n in
                             ("dft_re", "dft_im", "re2", "im2", "power", "mag", "mel", "eps")}
    plan = make_plan(m)
    status = {d.name: (d.status, d.reason) for d in plan.decisions}
    assert status["mel"][0] == "fp32" and "feeds a Log" in status["mel"][1]
    assert status["fc1"][0] == "int8" and status["fc2"][0] == "int8"
    # the framed waveform is read by the DFT alone: no quantizer left on it, nor on the spectrum
    assert "x" not in plan.tensors and not {"re", "im", "power", "mel"} & set(plan.tensors)
    assert "logmel" in plan.tensors


def test_a_log_after_a_softmax_keeps_the_network_int8():
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["z"], name="fc"),
             helper.make_node("Softmax", ["z"], ["p"], name="softmax", axis=-1),
             helper.make_node("Log", ["p"], ["y"], name="log")]
    m = make_model(nodes, [init("w", rng.standard_normal((8, 4)))], [("x", ["N", 8])], [("y", ["N", 4])])
    assert log_domain(m) == {}
    assert "fc" in make_plan(m).int8_nodes


def _conv_chain(relu: bool):
    """x -> four 3x3 convolutions (each followed by a Relu when `relu`) -> + 1 -> Log"""
    rng = np.random.default_rng(2)
    nodes, x = [], "x"
    for k in range(4):
        nodes.append(helper.make_node("Conv", [x, f"w{k}"], [f"c{k}"], name=f"conv{k}", kernel_shape=[3, 3],
                                      pads=[1, 1, 1, 1]))
        x = f"c{k}"
        if relu:
            nodes.append(helper.make_node("Relu", [x], [f"r{k}"], name=f"relu{k}"))
            x = f"r{k}"
    nodes += [helper.make_node("Mul", [x, x], ["sq"], name="square"),
              helper.make_node("Add", ["sq", "one"], ["sq1"], name="plus_one"),
              helper.make_node("Log", ["sq1"], ["y"], name="log")]
    inits = [init(f"w{k}", rng.standard_normal((4, 4 if k else 3, 3, 3)) / 6) for k in range(4)] + [init("one", 1.0)]
    return make_model(nodes, inits, [("x", ["N", 3, 8, 8])], [("y", ["N", 4, 8, 8])])


def test_a_log_on_a_network_is_no_front_end():
    """A Log on a Relu'd CNN keeps the CNN int8; a chain of filters alone is a front end, kept fp32 down to
    its second filter (the first may stay int8, as a front end's framing does)."""
    assert log_domain(_conv_chain(relu=True)) == {}
    assert set(log_domain(_conv_chain(relu=False))) == {"plus_one", "square", "conv3", "conv2"}


def test_a_dft_basis_may_be_the_first_operand():
    """swift-f0 multiplies a constant basis by the frames (MatMul(basis, frames)): still a linear filter."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("MatMul", ["basis", "x"], ["re"], name="dft"),
             helper.make_node("Mul", ["re", "re"], ["p"], name="power"),
             helper.make_node("Log", ["p"], ["y"], name="log")]
    m = make_model(nodes, [init("basis", rng.standard_normal((6, 8)))], [("x", [8, 3])], [("y", [6, 3])])
    assert set(log_domain(m)) == {"dft", "power"}


def _quantized_sqnr(tmp_path, monkeypatch, rule: bool) -> float:
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions
    from qtool.quantize.run import quantize
    if not rule:
        monkeypatch.setattr("qtool.plan.log_domain", lambda model: {})
    rng = np.random.default_rng(3)
    m = spectrum_model()
    model = save(m, str(tmp_path / "spectrum.onnx"))
    data = tmp_path / f"clips-{rule}"
    data.mkdir()
    for i, s in enumerate(sounds(rng, 24)):
        np.save(data / f"{i:03d}.npy", s)
    wd = str(tmp_path / f"work-{rule}")
    calibrate(model, str(data), CalibrateOptions(config=None, method="minmax", show_progress=False), workdir=wd)
    r = quantize(wd, say=lambda s: None)
    q = onnx.load(r.report["int8_model"])
    ys, yq = [], []
    for s in sounds(np.random.default_rng(4), 8):
        ys.append(run(m, {"x": s})[0])
        yq.append(run(q, {"x": s})[0])
    ys, yq = np.concatenate(ys), np.concatenate(yq)
    return float(10 * np.log10(np.sum(ys ** 2) / np.sum((ys - yq) ** 2)))


def test_quiet_bins_survive_quantization(tmp_path, monkeypatch):
    with_rule = _quantized_sqnr(tmp_path, monkeypatch, rule=True)
    monkeypatch.undo()
    without = _quantized_sqnr(tmp_path, monkeypatch, rule=False)
    assert with_rule > 30.0 and without < with_rule - 10.0, (with_rule, without)


def test_an_stft_front_end_with_a_length_mask():
    """Whisper's and NeMo's exports: STFT as one op (opset 17), the samples past the length masked with
    Where, |X|^2 summed over real and imaginary parts, a mel MatMul, Log (Whisper's mel MatMul in int8:
    10.3 dB). The STFT and what follows stay fp32, the network after the Log int8."""
    rng = np.random.default_rng(9)
    nodes = [helper.make_node("Where", ["mask", "x", "zero"], ["xm"], name="mask_len"),
             helper.make_node("STFT", ["xm", "step", "window"], ["spec"], name="stft"),  # [N, F, 33, 2]
             helper.make_node("ReduceSumSquare", ["spec", "last"], ["power"], name="power", keepdims=0),
             helper.make_node("MatMul", ["power", "mel_w"], ["mel"], name="mel"),
             helper.make_node("Clip", ["mel", "floor"], ["mc"], name="floor"),
             helper.make_node("Log", ["mc"], ["logmel"], name="log"),
             helper.make_node("MatMul", ["logmel", "w1"], ["y"], name="fc")]
    inits = [init("zero", 0.0), init("step", np.array(32), np.int64), init("window", np.hanning(64)),
             init("last", np.array([-1]), np.int64), init("mel_w", np.abs(rng.standard_normal((33, 12)))),
             init("floor", 1e-10), init("w1", rng.standard_normal((12, 4)))]
    g = helper.make_graph(nodes, "stft", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 640]),
                                          helper.make_tensor_value_info("mask", onnx.TensorProto.BOOL, ["N", 640])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 19, 4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(m)
    assert set(log_domain(m)) == {"stft", "power", "mel", "floor"}
    assert "fc" in make_plan(m).int8_nodes


def magnitude_model(seed=0):
    """Silero VAD's front end without a Log: DFT -> re^2 + im^2 (Pow 2) -> Sqrt -> a network (MatMul, Relu, MatMul)."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("MatMul", ["x", "dft_re"], ["re"], name="dft_re"),
             helper.make_node("MatMul", ["x", "dft_im"], ["im"], name="dft_im"),
             helper.make_node("Pow", ["re", "two"], ["re2"], name="re2"),
             helper.make_node("Pow", ["im", "two"], ["im2"], name="im2"),
             helper.make_node("Add", ["re2", "im2"], ["power"], name="power"),
             helper.make_node("Sqrt", ["power"], ["mag"], name="mag"),
             helper.make_node("MatMul", ["mag", "w1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["hr"], name="relu1"),
             helper.make_node("MatMul", ["hr", "w2"], ["y"], name="fc2")]
    inits = _front_end_inits(rng)[:2] + [init("two", np.array(2.0)), init("w1", rng.standard_normal((BINS, 16)) / 4),
                                         init("w2", rng.standard_normal((16, 4)) / 4)]
    return make_model(nodes, inits, [("x", ["N", 20, FRAME])], [("y", ["N", 20, 4])])


def test_a_magnitude_spectrum_keeps_its_power_fp32():
    """The power under a front end's Sqrt stays fp32 (and the DFT writing it); the magnitude, half its spread
    in dB, is quantized for the network, which stays int8."""
    m = magnitude_model()
    assert set(log_domain(m)) == {"dft_re", "dft_im", "re2", "im2", "power"}
    plan = make_plan(m)
    assert {"fc1", "fc2"} <= plan.int8_nodes
    assert "mag" in plan.tensors and not {"re", "im", "power"} & set(plan.tensors)


def test_a_layernorm_sqrt_is_no_magnitude():
    """Sqrt(mean((x - mean(x))^2) + eps) over a linear layer's output: centred squares, not a power spectrum."""
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["z"], name="fc"),
             helper.make_node("ReduceMean", ["z"], ["mu"], name="mean", axes=[-1]),
             helper.make_node("Sub", ["z", "mu"], ["d"], name="centre"),
             helper.make_node("Pow", ["d", "two"], ["d2"], name="sq"),
             helper.make_node("ReduceMean", ["d2"], ["var"], name="var", axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"], name="plus_eps"),
             helper.make_node("Sqrt", ["ve"], ["sd"], name="sd"),
             helper.make_node("Div", ["d", "sd"], ["y"], name="norm")]
    m = make_model(nodes, [init("w", rng.standard_normal((8, 8))), init("two", np.array(2.0)), init("eps", np.array(1e-5))],
                   [("x", ["N", 8])], [("y", ["N", 8])], opset=17)
    assert log_domain(m) == {}
    # nor a Sqrt of the squares of a network's output (a Relu between)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["z"], name="fc"), helper.make_node("Relu", ["z"], ["r"], name="relu"),
             helper.make_node("Mul", ["r", "r"], ["p"], name="sq"), helper.make_node("Sqrt", ["p"], ["y"], name="root")]
    m = make_model(nodes, [init("w", rng.standard_normal((8, 8)))], [("x", ["N", 8])], [("y", ["N", 8])])
    assert log_domain(m) == {}
