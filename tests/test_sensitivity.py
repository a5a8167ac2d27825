"""Per-layer sensitivity finds a planted damaged layer, and --exclude-sensitive acts on it."""
import numpy as np
import pytest
import onnx
from onnx import helper

from helpers import init, make_model, save, write_config, write_images
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions
from qtool.quantize.run import quantize
from qtool.quantize.options import ExclusionOptions, QuantizeOptions, SensitivityOptions


def damaged_chain(seed=0, c=8, damaged="c2"):
    """x -> c1 -> Relu -> c2 -> Relu -> Tanh -> c3 -> Relu -> c4 -> GAP -> Flatten -> Gemm.

    One output channel of the damaged conv carries weights and bias 300x the others: its
    activation range swamps the per-tensor uint8 scale of that conv's output, and the Tanh
    (no int8 rule) after it means no other layer shares that quantizer."""
    rng = np.random.default_rng(seed)
    nodes, inits, x, cin = [], [], "x", 3
    for k, name in enumerate(("c1", "c2", "c3", "c4")):
        w = rng.standard_normal((c, cin, 3, 3)) * (1.0 / np.sqrt(cin * 9))
        b = rng.standard_normal(c) * 0.05
        if name == damaged:
            w[0] *= 300.0
            b[0] = 30.0
        inits += [init(f"{name}_w", w), init(f"{name}_b", b)]
        nodes.append(helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [f"{name}_y"], name=name,
                                      kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"{name}_y"], [f"{name}_r"], name=f"{name}_relu"))
        x, cin = f"{name}_r", c
        if name == "c2":
            nodes.append(helper.make_node("Tanh", [x], ["t"], name="tanh"))
            x = "t"
    nodes += [helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"),
              helper.make_node("Flatten", ["gap"], ["flat"], name="flatten", axis=1),
              helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["y"], name="fc", transB=1)]
    inits += [init("fc_w", rng.standard_normal((10, c))), init("fc_b", np.zeros(10))]
    return make_model(nodes, inits, [("x", ["N", 3, 16, 16])], [("y", ["N", 10])])


@pytest.fixture
def damaged_workdir(tmp_path):
    model = save(damaged_chain(), str(tmp_path / "damaged.onnx"))
    data = tmp_path / "images"
    write_images(str(data), 24, seed=3)
    cfg = write_config(str(tmp_path / "cfg.toml"), size=16)
    wd = str(tmp_path / "work")
    calibrate(model, str(data), CalibrateOptions(config=cfg, method="minmax", show_progress=False), workdir=wd)
    return wd


def test_planted_damaged_layer_ranks_first(damaged_workdir):
    r = quantize(damaged_workdir, QuantizeOptions(progress=False, sensitivity=SensitivityOptions(samples=16)), say=lambda s: None)
    layers = sorted(r.sensitivity["layers"], key=lambda l: l["rank"])
    assert layers[0]["name"] == "c2", [(l["name"], round(l["output_sqnr_db"], 1)) for l in layers]
    # and clearly so: the damaged layer hurts far more than the next one
    assert layers[0]["output_sqnr_db"] + 6 < layers[1]["output_sqnr_db"]


def test_exclude_sensitive_keeps_the_damaged_layer_fp32(damaged_workdir):
    opts = QuantizeOptions(progress=False, sensitivity=SensitivityOptions(samples=12),
                           exclusion=ExclusionOptions(enabled=True, target_agreement=0.99, max_excluded=2))
    r = quantize(damaged_workdir, opts, say=lambda s: None)
    assert "c2" in r.exclusion.excluded
    # the damaged layer alone ruins the output: the default guard (guard.py) keeps it fp32 already, and
    # the search starts from there and never ends worse
    assert r.exclusion.excluded["c2"].startswith("kept fp32: alone in int8")
    first, last = r.exclusion.curve[0], r.exclusion.curve[-1]
    assert first.sqnr_db > 35 and last.sqnr_db >= first.sqnr_db
    assert r.report["excluded"] == r.exclusion.excluded
    status = {d["name"]: d["status"] for d in r.report["nodes"]}
    assert status["c2"] == "fp32"
    # the weights are rounded by output error (on calibration images only) before any layer is given up;
    # ranges are tuned only when asked
    assert r.report["rounding"] == "output-aware" and r.report["rounded_layers"]
    assert r.report["tuned_ranges"] is None
    assert set(r.exclusion.leave_one_out) <= {l["name"] for l in r.sensitivity["layers"]}


def test_plain_quantize_rounds_by_output_and_keeps_calibrated_ranges(damaged_workdir):
    r = quantize(damaged_workdir, QuantizeOptions(sensitivity=SensitivityOptions(enabled=False)), say=lambda s: None)
    assert r.report["rounding"] == "output-aware" and r.report["tuned_ranges"] is None
    r = quantize(damaged_workdir, QuantizeOptions(rounding=False, sensitivity=SensitivityOptions(enabled=False)), say=lambda s: None)
    assert r.report["rounding"] == "nearest" and r.report["tuned_ranges"] is None
    r = quantize(damaged_workdir, QuantizeOptions(rounding=True, tune_ranges=True, sensitivity=SensitivityOptions(enabled=False)), say=lambda s: None)
    assert r.report["rounding"] == "output-aware" and r.report["tuned_ranges"]["probes"] > 0


def test_default_sensitivity_samples_follow_the_output_size():
    """A classifier ranks on 64 images; a model with large outputs (a detector) on fewer, down to 4."""
    from onnx import TensorProto, helper
    from qtool.quantize.split import sensitivity_samples

    def model(out_dims):
        g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, out_dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_dims)])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    assert sensitivity_samples(model([1, 1000])) == 64
    assert sensitivity_samples(model(["n", 1000])) == 64
    assert sensitivity_samples(model([1, 3549, 6])) == 4  # YOLOX at 416x416: 2^16 / 21294, rounded up
    assert sensitivity_samples(model([1, 1000, 10])) == 7  # 2^16 / 10000, rounded up
    assert sensitivity_samples(model([1, 1024, 4])) == 16  # 2^16 values / 2^12 per image
    assert sensitivity_samples(model([1, 3549, 85])) == 4  # at least 4
    assert sensitivity_samples(model([1, 3, "h", "w"])) == 64  # unknown size: the classifier's count


def test_tuning_takes_sensitivity_images_spread_over_them_and_at_least_eight():
    """Rounding and range tuning read 32 of the sensitivity images, spread over all of them (not their first
    half: a folder in order, a recognizer's crops image by image, gave the fit half the images); a detector
    ranks on 4 but its covariances take 8, evenly spread over the calibration images."""
    from qtool.quantize.split import SampleSplit
    files = [f"f{k:03d}" for k in range(100)]
    big = SampleSplit.of(files, 64)
    assert len(big.tune) == 32 and set(big.tune) <= set(big.sensitivity)
    assert big.tune[0] == big.sensitivity[0] and big.tune[-1] in big.sensitivity[-2:]  # both ends, not the first half
    assert SampleSplit.of(files[:32], 32).tune == files[:32]  # as many as it takes: all, in order
    assert SampleSplit.of(files[:32], 18, tune=18).tune == files[:18]  # as many sensitivity images: the same ones
    small = SampleSplit.of(files, 4)
    assert len(small.sensitivity) == 4 and len(small.tune) == 8 and len(set(small.tune)) == 8
    assert set(small.files({"tune", "sensitivity"})) == set(small.tune) | set(
        small.sensitivity)
    assert SampleSplit.of(files[:5], 4).tune == files[:5]  # fewer files than that: all of them


def focus_stem(seed=0):
    """YOLOX's Focus stem: Slices of the graph input (pass-through ops that stay int8 on their own),
    a Concat, then convolutions."""
    rng = np.random.default_rng(seed)
    st = lambda name, v: init(name, np.array(v, np.int64), np.int64)  # noqa: E731
    nodes = [helper.make_node("Slice", ["x", "s0", "e0", "ax", "st"], ["a"], name="slice_a"),
             helper.make_node("Slice", ["x", "s1", "e1", "ax", "st"], ["b"], name="slice_b"),
             helper.make_node("Concat", ["a", "b"], ["cat"], name="cat", axis=1),
             helper.make_node("Conv", ["cat", "w1"], ["y1"], name="c1", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y1"], ["r1"], name="r1"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="c2", kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    inits = [st("s0", [0]), st("e0", [16]), st("s1", [1]), st("e1", [17]), st("ax", [2]), st("st", [2]),
             init("w1", rng.standard_normal((8, 6, 3, 3)) * 0.2), init("w2", rng.standard_normal((4, 8, 3, 3)) * 0.2)]
    return make_model(nodes, inits, [("x", ["N", 3, 16, 16])], [("y", ["N", 4, 8, 16])])


def test_a_layer_alone_in_int8_does_not_carry_the_input_quantizer(tmp_path):
    """Pass-through ops reading the graph input leave the sensitivity variants too: the last conv's
    variant quantizes only its own tensors and starts at that conv, not at the input."""
    from qtool.quantize.context import QuantizeContext
    from qtool.quantize.samples import load_samples
    from qtool.quantize.sensitivity import layer_sensitivity
    from qtool.quantize.simulate import Simulator
    model = save(focus_stem(), str(tmp_path / "focus.onnx"))
    write_images(str(tmp_path / "images"), 8, seed=2)
    cfg = write_config(str(tmp_path / "cfg.toml"), size=16)
    r = calibrate(model, str(tmp_path / "images"),
                  CalibrateOptions(config=cfg, method="minmax", show_progress=False), workdir=str(tmp_path / "w"))
    ctx = QuantizeContext(r.fused, r.table, "minmax", threads=1)
    sim = Simulator(ctx)
    assert {"slice_a", "slice_b"} <= sim.plan.int8_nodes  # the plan of the whole model keeps them int8
    samples = load_samples(r.fused, r.table, sorted(str(p) for p in (tmp_path / "images").iterdir()))
    seen = []
    orig = Simulator.run

    def spy(self, s, variants, progress=None, reduce=None):
        seen.extend(variants)
        return orig(self, s, variants, progress, reduce)
    Simulator.run = spy
    try:
        layers = {l.name: l for l in layer_sensitivity(ctx, samples)}
    finally:
        Simulator.run = orig
    assert set(layers) >= {"c1", "c2"}
    for v in seen:
        assert "x" not in v.tensors and not v.nodes & {"slice_a", "slice_b"}
    assert layers["cat"].output_sqnr_db > 100  # a Concat alone has no int8 input: nothing changes
    assert np.isfinite(layers["c2"].output_sqnr_db) and layers["c2"].output_sqnr_db < 80


def test_a_per_position_distribution_is_judged_per_position(tmp_path):
    """A CTC-style output [N, T, C] (Softmax over C): each layer's KL is the mean over positions (it
    was 0 for any output not [N, C]), agreement counts positions, and the ranking is by KL, so the
    planted damaged layer (one channel 300x the others before an fp32 Tanh) ranks first."""
    import warnings

    from helpers import run
    from qtool.api import calibrate as api_calibrate, quantize as api_quantize
    rng = np.random.default_rng(5)
    w1 = rng.standard_normal((8, 16)) * 0.4
    w1[:, 0] *= 300.0
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Tanh", ["h"], ["t"], name="tanh"),
             helper.make_node("MatMul", ["t", "w2"], ["z"], name="fc2"),
             helper.make_node("MatMul", ["z", "w3"], ["logits"], name="fc3"),
             helper.make_node("Softmax", ["logits"], ["y"], name="softmax", axis=-1)]
    m = make_model(nodes, [init("w1", w1), init("w2", rng.standard_normal((16, 16)) * 0.5),
                           init("w3", rng.standard_normal((16, 12)) * 0.8)],
                   [("x", ["N", 10, 8])], [("y", ["N", 10, 12])])
    path = save(m, str(tmp_path / "seq.onnx"))
    data = tmp_path / "data"
    data.mkdir()
    for k in range(24):
        np.save(data / f"{k:03d}.npy", rng.standard_normal((1, 10, 8)).astype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api_calibrate(path, str(data), method="minmax", workdir=str(tmp_path / "w"), verbose=False, threads=1)
        q = api_quantize(str(tmp_path / "w"), QuantizeOptions(strict=True, rounding=False), verbose=False)
    layers = sorted(q.sensitivity["layers"], key=lambda l: l["rank"])
    assert layers[0]["name"] == "fc1", [(l["name"], l["kl"]) for l in layers]
    assert layers[0]["kl"] > 0 and [l["kl"] for l in layers] == sorted((l["kl"] for l in layers), reverse=True)
    n_positions = q.sensitivity["samples"] * 10
    for l in layers:
        assert abs(l["top1_agreement"] * n_positions - round(l["top1_agreement"] * n_positions)) < 1e-6
    assert layers[0]["top1_agreement"] < 1.0  # (the damaged layer flips some positions' winner)
    assert run(onnx.load(q.path), {"x": np.load(data / "000.npy")})[0].shape == (1, 10, 12)


def gated_head(seed=0):
    """Conv -> SiLU (Sigmoid, Mul: no weights, int8 because a Conv reads them) -> Conv -> Sigmoid
    writing the graph output (fp32 in the plan: its output stays fp32)."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="c1", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["s"], name="gate"),
             helper.make_node("Mul", ["c", "s"], ["m"], name="silu"),
             helper.make_node("Conv", ["m", "w2"], ["z"], name="c2", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["z"], ["y"], name="last")]
    inits = [init("w1", rng.standard_normal((8, 3, 3, 3)) * 0.4), init("w2", rng.standard_normal((2, 8, 3, 3)) * 0.3)]
    return make_model(nodes, inits, [("x", ["N", 3, 16, 16])], [("y", ["N", 2, 16, 16])])


def test_an_op_without_weights_is_measured_as_the_model_runs_it(tmp_path):
    """A weightless op is int8 in the model because an int8 op reads its output; measured alone it
    keeps that output quantizer (it is not reported free), and the final Sigmoid the plan leaves fp32
    stays fp32 in every variant (calibration has no range for its input)."""
    from qtool.quantize.context import QuantizeContext
    from qtool.quantize.samples import load_samples
    from qtool.quantize.sensitivity import layer_sensitivity
    model = save(gated_head(), str(tmp_path / "head.onnx"))
    write_images(str(tmp_path / "images"), 8, seed=3)
    cfg = write_config(str(tmp_path / "cfg.toml"), size=16)
    r = calibrate(model, str(tmp_path / "images"),
                  CalibrateOptions(config=cfg, method="minmax", show_progress=False), workdir=str(tmp_path / "w"))
    ctx = QuantizeContext(r.fused, r.table, "minmax", threads=1)
    samples = load_samples(r.fused, r.table, sorted(str(p) for p in (tmp_path / "images").iterdir()))
    layers = {l.name: l for l in layer_sensitivity(ctx, samples)}
    assert "last" not in layers and {"c1", "gate", "silu", "c2"} <= set(layers)
    for name in ("gate", "silu"):
        assert layers[name].output_sqnr_db < 80, (name, layers[name].output_sqnr_db)
