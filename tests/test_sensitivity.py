"""Per-layer sensitivity finds a planted damaged layer, and --exclude-sensitive acts on it."""
import numpy as np
import pytest
from onnx import helper

from helpers import init, make_model, save, write_config, write_images
from qtool.calibrate.run import calibrate
from qtool.quantize.run import SensitivityOptions, quantize


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
    calibrate(model, str(data), cfg, "minmax", workdir=wd, show_progress=False)
    return wd


def test_planted_damaged_layer_ranks_first(damaged_workdir):
    r = quantize(damaged_workdir, sensitivity=SensitivityOptions(samples=16, show_progress=False), say=lambda s: None)
    layers = sorted(r.sensitivity["layers"], key=lambda l: l["rank"])
    assert layers[0]["name"] == "c2", [(l["name"], round(l["output_sqnr_db"], 1)) for l in layers]
    # and clearly so: the damaged layer hurts far more than the next one
    assert layers[0]["output_sqnr_db"] + 6 < layers[1]["output_sqnr_db"]


def test_exclude_sensitive_keeps_the_damaged_layer_fp32(damaged_workdir):
    opts = SensitivityOptions(samples=12, exclude_sensitive=True, target_agreement=0.99, max_excluded=2,
                              show_progress=False)
    r = quantize(damaged_workdir, sensitivity=opts, say=lambda s: None)
    assert "c2" in r.exclusion.excluded
    first, last = r.exclusion.curve[0], r.exclusion.curve[-1]
    assert last.sqnr_db > first.sqnr_db + 6
    assert r.report["excluded"] == r.exclusion.excluded
    status = {d["name"]: d["status"] for d in r.report["nodes"]}
    assert status["c2"] == "fp32"
    # --exclude-sensitive first rounds weights by output error and tunes ranges, on calibration images only
    assert r.report["rounding"] == "output-aware" and r.report["rounded_layers"]
    assert r.report["tuned_ranges"] is not None and r.report["tuned_ranges"]["probes"] > 0
    assert set(r.exclusion.leave_one_out) <= {l["name"] for l in r.sensitivity["layers"]}


def test_plain_quantize_keeps_nearest_rounding_and_calibrated_ranges(damaged_workdir):
    r = quantize(damaged_workdir, sensitivity=SensitivityOptions(enabled=False), say=lambda s: None)
    assert r.report["rounding"] == "nearest" and r.report["tuned_ranges"] is None
    r = quantize(damaged_workdir, sensitivity=SensitivityOptions(enabled=False), say=lambda s: None,
                 rounding=True, tune_ranges=True)
    assert r.report["rounding"] == "output-aware" and r.report["tuned_ranges"]["probes"] > 0
