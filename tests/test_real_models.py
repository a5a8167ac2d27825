"""What real third-party models broke (../shared/zoo), each as a small synthetic model: the default
calibrate + quantize (every optional step on, --strict: a fallback is a failure here) must write a
valid int8 model that ONNX Runtime runs and that stays close to fp32."""
from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper

from helpers import calibrate_samples, if_conv_model, init, make_model, run, save, weight, write_samples
from qtool import graph as G
from qtool.api import calibrate, quantize
from qtool.quantize.options import ExclusionOptions, QuantizeOptions, SensitivityOptions


def _sqnr(ref, out):
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    return 10 * np.log10((ref ** 2).sum() / max(((ref - out) ** 2).sum(), 1e-30))


def default_run(model, samples: list, tmp_path, min_db: float = 20.0, rounding: bool | None = None):
    """calibrate (method auto) + quantize with every default step, strict; the int8 model runs in ORT
    on every sample and its outputs stay within `min_db` of fp32. -> QuantizeResult."""
    work = calibrate_samples(model, samples, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quantize(work, QuantizeOptions(strict=True, rounding=rounding), verbose=False)
    m = onnx.load(q.path)
    onnx.checker.check_model(m)
    for s in samples[:3]:
        for ref, out in zip(run(model, s), run(m, s)):
            if np.issubdtype(ref.dtype, np.floating):
                assert _sqnr(ref, out) > min_db
    assert q.report["optional_steps"]["fallbacks"] == []
    return q


def test_sequence_first_output(tmp_path):
    """A CRNN's head writes [T, N, C]: the samples are on axis 1 (quantize took axis 0 for them)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("ReduceMean", ["r"], ["m"], name="pool_h", axes=[2], keepdims=0),  # [N, C, W]
             helper.make_node("Transpose", ["m"], ["t"], name="to_seq", perm=[2, 0, 1]),  # [W, N, C]
             helper.make_node("MatMul", ["t", "wh"], ["y"], name="head")]
    m = make_model(nodes, [weight(rng, "w", 8, 3, 3, 3), weight(rng, "b", 8, scale=0.1), weight(rng, "wh", 8, 12)],
                   [("x", ["N", 3, 4, 16])], [("y", [16, "N", 12])])
    samples = [{"x": rng.standard_normal((1, 3, 4, 16)).astype(np.float32)} for _ in range(12)]
    q = default_run(m, samples, tmp_path)
    assert q.report["rounding"] == "output-aware" and q.sensitivity is not None


def test_samples_on_axis_1_are_found():
    from qtool.quantize.samples import SampleSet, _sample_axis
    import onnxruntime as ort
    m = make_model([helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0, 2])], [], [("x", ["N", 5, 3])],
                   [("y", [5, "N", 3])])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.arange(4 * 5 * 3, dtype=np.float32).reshape(4, 5, 3)
    s = SampleSet(list("abcd"), {"x": x}, np.zeros(0), batch=2)
    s.axis, s.rows = _sample_axis(sess, "y", s)
    assert (s.axis, s.rows) == (1, 1)
    joined = s.join([sess.run(["y"], f)[0] for f in s.feeds])
    np.testing.assert_array_equal(joined, x)  # one entry per sample on axis 0, in order
    assert s.subset([2]).feeds[0]["x"].shape == (1, 5, 3)


def test_transposed_matmul_weight_rounds_in_c(tmp_path):
    """A MatMul weight [K, N] is read per output channel as a strided view: the C descent took
    it and failed ('ndarray is not C-contiguous')."""
    from qtool import qparams as Q
    from qtool.quantize import rounding
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 10))  # [K, N]: output channels on axis 1
    x = rng.standard_normal((400, 24)) @ rng.standard_normal((24, 24))
    h = np.cov(x.T)[None]
    s = Q.weight_scales(w, 1)
    native = rounding.round_weights(w, s, 1, h)
    saved, rounding._native = rounding._native, None
    try:
        ref = rounding.round_weights(w, s, 1, h)
    finally:
        rounding._native = saved
    np.testing.assert_array_equal(native, ref)


def test_feature_maps_of_several_dynamic_sizes(tmp_path):
    """A text detector: two dynamic-size maps at different strides meet after a Resize. The
    simulation's graph named both maps' dynamic height 'd2', and ORT reused one's buffer for the other."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="c1", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["a"], ["ar"], name="r1"),
             helper.make_node("Conv", ["ar", "w2", "b2"], ["d"], name="down", kernel_shape=[3, 3], pads=[1] * 4,
                              strides=[2, 2]),
             helper.make_node("Relu", ["d"], ["dr"], name="r2"),
             helper.make_node("Conv", ["dr", "w3", "b3"], ["e"], name="c3", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Resize", ["e", "", "scales"], ["u"], name="up", mode="nearest"),
             helper.make_node("Concat", ["ar", "u"], ["cat"], name="cat", axis=1),
             helper.make_node("Conv", ["cat", "w4", "b4"], ["y"], name="head", kernel_shape=[1, 1])]
    inits = [weight(rng, "w1", 6, 3, 3, 3), weight(rng, "b1", 6, scale=0.1), weight(rng, "w2", 6, 6, 3, 3, scale=0.2),
             weight(rng, "b2", 6, scale=0.1), weight(rng, "w3", 6, 6, 3, 3, scale=0.2), weight(rng, "b3", 6, scale=0.1),
             init("scales", [1, 1, 2, 2]), weight(rng, "w4", 1, 12, 1, 1), weight(rng, "b4", 1, scale=0.1)]
    m = make_model(nodes, inits, [("x", ["N", 3, "H", "W"])], [("y", ["N", 1, "H", "W"])])
    samples = [{"x": rng.standard_normal((1, 3, 16, 24)).astype(np.float32)} for _ in range(8)]
    q = default_run(m, samples, tmp_path)
    assert len(q.sensitivity["layers"]) >= 4


def test_second_head_computed_before_the_first_output(tmp_path):
    """Two outputs; the first (the reference) is finished early and a second head runs after it:
    a variant cut after it had no node writing the output ('Graph output does not exist')."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="c1", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["a"], ["ar"], name="r1"),
             helper.make_node("Conv", ["ar", "wd", "bd"], ["det"], name="det_head", kernel_shape=[1, 1]),
             helper.make_node("Conv", ["ar", "w2", "b2"], ["s1"], name="c2", kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["s1"], ["s1r"], name="r2"),
             helper.make_node("Conv", ["s1r", "w3", "b3"], ["seg"], name="seg_head", kernel_shape=[1, 1])]
    inits = [weight(rng, "w1", 6, 3, 3, 3), weight(rng, "b1", 6, scale=0.1), weight(rng, "wd", 2, 6, 1, 1),
             weight(rng, "bd", 2, scale=0.1), weight(rng, "w2", 6, 6, 3, 3, scale=0.2), weight(rng, "b2", 6, scale=0.1),
             weight(rng, "w3", 3, 6, 1, 1), weight(rng, "b3", 3, scale=0.1)]
    m = make_model(nodes, inits, [("x", ["N", 3, 8, 8])], [("det", ["N", 2, 8, 8]), ("seg", ["N", 3, 8, 8])])
    samples = [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(8)]
    q = default_run(m, samples, tmp_path)
    layers = {l["name"]: l for l in q.sensitivity["layers"]}
    assert layers["seg_head"]["output_sqnr_db"] == float("inf")  # it does not change the first output


def _token_model(rng, vocab=50, dim=16):
    """ids int64 [N, T] -> Gather(embedding) [N, T, dim] -> MatMul + Add -> Relu -> MatMul [N, T, 4]: a
    text encoder's float internals behind integer inputs."""
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e"], name="embed"),
             helper.make_node("MatMul", ["e", "w1"], ["h"], name="fc1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
             helper.make_node("Relu", ["hb"], ["hr"], name="relu"),
             helper.make_node("MatMul", ["hr", "w2"], ["y"], name="fc2")]
    inits = [weight(rng, "emb", vocab, dim), weight(rng, "w1", dim, 24, scale=0.3), weight(rng, "b1", 24, scale=0.1),
             weight(rng, "w2", 24, 4, scale=0.3)]
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "T"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T", 4])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def test_integer_inputs_only(tmp_path):
    """Token ids in, floats after the lookup: calibrate refused it ('no float32 input'), and the
    per-channel means of a [N, T, K] MatMul input were taken over T, which differs between samples."""
    rng = np.random.default_rng(4)
    m = _token_model(rng)
    samples = [{"ids": rng.integers(0, 50, (1, t)).astype(np.int64)} for t in (5, 7, 5, 9, 6, 8, 7, 5)]
    q = default_run(m, samples, tmp_path)
    from qtool.calibrate.table import load_table
    table = load_table(str(tmp_path / "work" / "calibration.json"))
    assert {len(v) for v in table.channel_means.values()} <= {16, 24}  # K channels, whatever T
    assert q.report["summary"].get("int8", 0) >= 2


def test_if_branch_reads_outer_weights(tmp_path):
    """An If whose branch reads the main graph's weights and tensors by name: folding dropped those
    weights as unused, and the experiments' graphs left them out."""
    rng = np.random.default_rng(5)
    then_g = helper.make_graph([helper.make_node("MatMul", ["h", "wv"], ["v"]), helper.make_node("Sigmoid", ["v"], ["p2"])],
                               "then", [], [helper.make_tensor_value_info("p2", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["p"], ["p1"])], "else", [],
                               [helper.make_tensor_value_info("p1", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h0"], name="fc1"),
             helper.make_node("Relu", ["h0"], ["h"], name="relu"),
             helper.make_node("Gemm", ["h", "w2", "b2"], ["l"], name="fc2"),
             helper.make_node("Sigmoid", ["l"], ["p"], name="sig"),
             helper.make_node("ReduceMax", ["p"], ["pm"], name="max", keepdims=0),
             helper.make_node("Greater", ["pm", "half"], ["cond"], name="gt"),
             helper.make_node("If", ["cond"], ["y"], name="verify", then_branch=then_g, else_branch=else_g)]
    inits = [weight(rng, "w1", 12, 16, scale=0.4), weight(rng, "b1", 16, scale=0.1), weight(rng, "w2", 16, 2, scale=0.4),
             weight(rng, "b2", 2, scale=0.1), weight(rng, "wv", 16, 2, scale=0.4), init("half", -1.0)]  # (the branch that reads them, always)
    m = make_model(nodes, inits, [("x", [1, 12])], [("y", [1, 2])])
    samples = [{"x": rng.standard_normal((1, 12)).astype(np.float32)} for _ in range(8)]
    q = default_run(m, samples, tmp_path)
    out = onnx.load(q.path)
    g = out.graph
    defined = {t.name for t in g.initializer} | {i.name for i in g.input} | {o for n in g.node for o in n.output}
    # every tensor the If reads by name is there (wv itself went into its branch, quantized there as a model)
    assert G.node_reads(next(n for n in g.node if n.op_type == "If")) <= defined
    # ... and no fp32 copy of it is left in the main graph, unread (silero's op18 export: 110.9 % of fp32's size)
    assert "wv" not in {t.name for t in g.initializer}


def test_inputs_without_a_batch_axis(tmp_path):
    """A stateful model: a scalar sample rate and a state [2, N, 8] beside the signal. Stacking the
    samples on axis 0 made the If's condition [N] and cut the state in the wrong place."""
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("Equal", ["sr", "k16"], ["is16"], name="eq"),
             helper.make_node("Cast", ["is16"], ["f16"], name="cast", to=TensorProto.FLOAT),
             helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="fc"),
             helper.make_node("ReduceMean", ["state"], ["sm"], name="state_mean", axes=[0], keepdims=0),  # [N, 8]
             helper.make_node("Add", ["h", "sm"], ["hs"], name="mix"),
             helper.make_node("Mul", ["hs", "f16"], ["hm"], name="gate"),
             helper.make_node("Gemm", ["hm", "w2", "b2"], ["y"], name="out"),
             helper.make_node("Unsqueeze", ["hs", "zero"], ["state_n"], name="new_state")]
    inits = [init("k16", 16000, np.int64), weight(rng, "w", 20, 8, scale=0.3), weight(rng, "b", 8, scale=0.1),
             weight(rng, "w2", 8, 1, scale=0.4), weight(rng, "b2", 1, scale=0.1), init("zero", [0], np.int64)]
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 20]),
                                       helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, 1, 8]),
                                       helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1]),
                           helper.make_tensor_value_info("state_n", TensorProto.FLOAT, [1, 1, 8])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    samples = [{"x": rng.standard_normal((1, 20)).astype(np.float32),
                "state": rng.standard_normal((2, 1, 8)).astype(np.float32), "sr": np.array(16000, np.int64)}
               for _ in range(8)]
    default_run(m, samples, tmp_path)


def test_model_with_nothing_to_quantize_is_written_as_it_is(tmp_path):
    rng = np.random.default_rng(7)
    m = make_model([helper.make_node("Sin", ["x"], ["y"])], [], [("x", ["N", 4])], [("y", ["N", 4])])
    q = default_run(m, [{"x": rng.standard_normal((1, 4)).astype(np.float32)} for _ in range(4)], tmp_path, min_db=100)
    assert q.report["summary"].get("int8", 0) == 0


def test_reshape_by_the_area_of_a_deep_feature_map(tmp_path):
    """[N, C, H, W] -> Reshape to [N, 2, C/2, H*W] with H*W computed at run time, 32x below the input:
    33 and 64, the two sizes constant folding tried, both give 2x2 there, so H*W was frozen at 4."""
    from qtool.fuse import fuse_model
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], name="pool", kernel_shape=[32, 32], strides=[32, 32],
                              ceil_mode=1),
             helper.make_node("Shape", ["p"], ["s"]),
             helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
             helper.make_node("Gather", ["s", "i2"], ["h"], axis=0),
             helper.make_node("Gather", ["s", "i3"], ["w"], axis=0),
             helper.make_node("Mul", ["h", "w"], ["hw"]),
             helper.make_node("Concat", ["n", "two", "half", "hw"], ["shape"], axis=0),
             helper.make_node("Reshape", ["p", "shape"], ["y"])]
    inits = [init("i0", [0], np.int64), init("i2", [2], np.int64), init("i3", [3], np.int64),
             init("two", [2], np.int64), init("half", [2], np.int64)]
    m = make_model(nodes, inits, [("x", ["N", 4, "H", "W"])], [("y", ["N", 2, 2, None])])
    fused = fuse_model(m).model
    x = np.random.default_rng(8).standard_normal((1, 4, 96, 128)).astype(np.float32)
    np.testing.assert_array_equal(run(fused, {"x": x})[0], run(m, {"x": x})[0])


def test_a_wrongly_declared_output_shape_is_calibrated(tmp_path):
    """A Paddle CRNN declares its output [-1, 25, C] and computes [N, 80, C]: ONNX Runtime lets that
    pass in a plain run, not into the buffer calibration bound to it."""
    rng = np.random.default_rng(9)
    m = make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="fc")], [weight(rng, "w", 8, 6)],
                   [("x", ["N", "T", 8])], [("y", ["N", 25, 6])])
    samples = [{"x": rng.standard_normal((1, 80, 8)).astype(np.float32)} for _ in range(8)]
    default_run(m, samples, tmp_path)


def test_position_embeddings_that_broadcast_over_the_batch(tmp_path):
    """An output [1, T, C] whatever the batch (a transformer's position embeddings): one sample run
    took it for batch-major, and the next batch of two had no buffer for it."""
    rng = np.random.default_rng(10)
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "one"], ["t"], axis=0),
             helper.make_node("Slice", ["pos", "zero", "t", "one"], ["p"]),  # [1, T, 8]
             helper.make_node("Add", ["x", "p"], ["xp"], name="add_pos"),
             helper.make_node("MatMul", ["xp", "w"], ["y"], name="fc")]
    inits = [weight(rng, "pos", 1, 32, 8), init("zero", [0], np.int64), init("one", [1], np.int64),
             weight(rng, "w", 8, 4)]
    m = make_model(nodes, inits, [("x", ["N", "T", 8])], [("y", ["N", "T", 4])])
    samples = [{"x": rng.standard_normal((1, 6, 8)).astype(np.float32)} for _ in range(8)]
    default_run(m, samples, tmp_path)


def _unbalanced_mobilenet_block(rng):
    """x -> 1x1 Conv (one output channel 40x the others) -> hard-swish (Add, Clip, Mul, Div: fp32 in
    the int8 model) -> depthwise 3x3 -> 1x1 Conv -> y: one uint8 range per tensor starves seven channels."""
    w1 = rng.standard_normal((8, 4, 1, 1)) * 0.5
    w1[7] *= 40.0
    w2 = rng.standard_normal((4, 8, 1, 1)) * 0.5
    w2[:, 7] /= 40.0  # (the output hears every channel alike)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["z"], name="pw1", kernel_shape=[1, 1]),
             helper.make_node("Add", ["z", "three"], ["z3"], name="hs_add"),
             helper.make_node("Clip", ["z3", "zero", "six"], ["g"], name="hs_clip"),
             helper.make_node("Mul", ["z", "g"], ["zg"], name="hs_mul"),
             helper.make_node("Div", ["zg", "six"], ["h"], name="hs_div"),
             helper.make_node("Conv", ["h", "wd", "bd"], ["d"], name="dw", kernel_shape=[3, 3], pads=[1] * 4, group=8),
             helper.make_node("Conv", ["d", "w2", "b2"], ["y"], name="pw2", kernel_shape=[1, 1])]
    inits = [init("w1", w1), weight(rng, "b1", 8, scale=0.1), init("three", 3.0), init("zero", 0.0), init("six", 6.0),
             weight(rng, "wd", 8, 1, 3, 3), weight(rng, "bd", 8, scale=0.1), init("w2", w2),
             weight(rng, "b2", 4, scale=0.1)]
    return make_model(nodes, inits, [("x", ["N", 4, 10, 10])], [("y", ["N", 4, 10, 10])])


def test_unbalanced_channels_are_balanced_exactly_and_gain(tmp_path, monkeypatch):
    """quantize/equalize.py: the balanced fp32 graph computes the same outputs, and the int8 model gains:
    the wide channel no longer sets the range of the seven narrow ones, before and after hard-swish."""
    from qtool.calibrate.table import load_table
    from qtool.quantize.equalize import equalize
    from qtool.quantize.steps import equalization
    rng = np.random.default_rng(11)
    m = _unbalanced_mobilenet_block(rng)
    samples = [{"x": rng.standard_normal((1, 4, 10, 10)).astype(np.float32)} for _ in range(12)]
    q = default_run(m, samples, tmp_path / "balanced", min_db=0, rounding=False)
    table = load_table(str(tmp_path / "balanced" / "work" / "calibration.json"))
    assert {"z", "h"} <= set(table.channel_ranges)
    balanced, _, _ = equalize(onnx.load(str(tmp_path / "balanced" / "work" / "fused.onnx")), table, say=lambda s: None)
    assert sum(n.op_type == "Mul" for n in balanced.graph.node) == 3  # hard-swish's own, one before it, one after
    for s in samples[:2]:
        np.testing.assert_allclose(run(balanced, s)[0], run(m, s)[0], rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(equalization, "balance", lambda ctx, samples, say: None)
    plain = default_run(m, samples, tmp_path / "plain", min_db=0, rounding=False)

    def db(q):
        return np.mean([_sqnr(run(m, s)[0], run(onnx.load(q.path), s)[0]) for s in samples])
    assert db(q) > db(plain) + 1.5  # (12.6 -> 14.6 dB here)


def test_a_network_inside_an_if_is_quantized_where_every_sample_takes_it(tmp_path):
    """Silero VAD keeps its 16 kHz network in one branch of If(sr == 16000) and its 8 kHz one in the
    other: the branch every calibration sample takes is quantized as a model of its own and put back;
    the other stays fp32."""
    rng = np.random.default_rng(12)
    m = if_conv_model(rng)
    samples = [{"x": rng.standard_normal((1, 1, 64)).astype(np.float32), "sr": np.array(16000, np.int64)}
               for _ in range(12)]
    q = default_run(m, samples, tmp_path)
    assert [(s["node"], s["branch"]) for s in q.report["subgraphs"]] == [("rate", "then_branch")]
    out = onnx.load(q.path)
    node = next(n for n in out.graph.node if n.op_type == "If")
    ops = {a.name: [n.op_type for n in a.g.node] for a in node.attribute}
    assert "QuantizeLinear" in ops["then_branch"] and "QuantizeLinear" not in ops["else_branch"]
    eight = dict(samples[0], sr=np.array(8000, np.int64))  # the branch no sample took: still fp32, exact
    np.testing.assert_array_equal(run(out, eight)[0], run(m, eight)[0])


def test_figures_count_the_branches_quantized(tmp_path):
    """Every figure quantize gave was the main graph's, which the experiments see: with the network in a branch,
    "output SQNR inf dB" and 0 layers (silero-vad's op18 export: the model written read 12.2 dB, 4.7 % of its
    speech decisions flipped). The output SQNR is now the written model's, and --exclude-sensitive, with no layer
    of the main graph to keep, searches inside the branch."""
    from qtool.quantize.run import quantize as quantize_run
    rng = np.random.default_rng(15)
    m = if_conv_model(rng)
    samples = [{"x": rng.standard_normal((1, 1, 64)).astype(np.float32), "sr": np.array(16000, np.int64)}
               for _ in range(40)]
    q = default_run(m, samples, tmp_path)
    cost = q.report["target_cost"]
    assert 10 < cost["output_sqnr_db"] < 80 and "If branches" in cost["measured"]
    assert q.report["subgraphs"][0]["summary"]["int8"] == 2
    said = []
    r = quantize_run(str(tmp_path / "work"), QuantizeOptions(progress=False, sensitivity=SensitivityOptions(), exclusion=ExclusionOptions(enabled=True, target_agreement=0.9999)), say=said.append)
    assert r.exclusion is None  # (the main graph has no layer of its own to keep)
    line = next(t for t in said if t.startswith("rate (then_branch"))
    assert "--exclude-sensitive there kept" in line, said


def test_a_failing_branch_stays_fp32_and_says_so(tmp_path, monkeypatch):
    """The optional step 'subgraphs' fails: the branch stays fp32, one warning, the model is written."""
    from qtool.quantize.steps import subgraphs
    monkeypatch.delenv("QTOOL_STRICT", raising=False)
    m = if_conv_model(np.random.default_rng(13))

    def boom(*a, **k):
        raise RuntimeError("injected fault")
    monkeypatch.setattr(subgraphs, "quantize_branches", boom)
    path = save(m, tmp_path / "model.onnx")
    rng = np.random.default_rng(14)
    data = write_samples(tmp_path / "data", [{"x": rng.standard_normal((1, 1, 64)).astype(np.float32),
                                       "sr": np.array(16000, np.int64)} for _ in range(6)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calibrate(path, data, workdir=str(tmp_path / "w"), verbose=False, threads=1)
        q = quantize(str(tmp_path / "w"), verbose=False)
    assert sum("subgraphs failed" in str(w.message) for w in caught) == 1
    assert [f["step"] for f in q.report["optional_steps"]["fallbacks"]] == ["subgraphs"]
    onnx.checker.check_model(onnx.load(q.path))
