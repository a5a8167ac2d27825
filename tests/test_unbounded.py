"""quantize/unbounded.py: an attention mask's infinity keeps the ops around it fp32, the layers int8."""
import numpy as np
import onnx
import pytest
from onnx import helper

from helpers import init, make_model, run, save
from qtool.calibrate.table import CalibrationTable
from qtool.quantize.unbounded import unbounded_exclusions

T, D = 6, 8


def masked_attention(kind: str, seed=0):
    """x [N,T,D], keep [N,1,T] (1 = a real position) -> scores (int8 MatMul) + mask -> Softmax ->
    int8 MatMul. The mask is -inf where keep is 0 (a masked_fill) or keep's complement times the float's
    lowest value (Hugging Face's finfo.min)."""
    rng = np.random.default_rng(seed)
    if kind == "inf":
        mask = [helper.make_node("Less", ["keep", "half"], ["pad"], name="is_pad"),
                helper.make_node("Where", ["pad", "neg_inf", "zero"], ["mask"], name="mask")]
        consts = [init("half", np.array(0.5)), init("neg_inf", np.array(-np.inf)), init("zero", np.array(0.0))]
    else:
        mask = [helper.make_node("Sub", ["one", "keep"], ["pad"], name="is_pad"),
                helper.make_node("Mul", ["pad", "lowest"], ["mask"], name="mask")]
        consts = [init("one", np.array(1.0)), init("lowest", np.array(np.finfo(np.float32).min))]
    nodes = mask + [helper.make_node("MatMul", ["x", "ws"], ["scores"], name="scores"),
                    helper.make_node("Add", ["scores", "mask"], ["masked"], name="add_mask"),
                    helper.make_node("Softmax", ["masked"], ["p"], name="softmax", axis=-1),
                    helper.make_node("MatMul", ["p", "wv"], ["y"], name="mix")]
    inits = consts + [init("ws", rng.standard_normal((D, T))), init("wv", rng.standard_normal((T, 4)))]
    return make_model(nodes, inits, [("x", ["N", T, D]), ("keep", ["N", 1, T])], [("y", ["N", T, 4])])


def feeds(rng, n):
    out = []
    for _ in range(n):
        keep = np.ones((1, 1, T), np.float32)
        keep[..., rng.integers(3, T):] = 0.0  # padded tails of different lengths
        out.append({"x": rng.standard_normal((1, T, D)).astype(np.float32), "keep": keep})
    return out


def _quantized(tmp_path, kind, monkeypatch=None):
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions
    from qtool.quantize.run import quantize
    if monkeypatch is not None:
        monkeypatch.setattr("qtool.quantize.run.unbounded_exclusions", lambda model, table: ({}, {}))
        # (and every input static: layers quantizing theirs at run time would take the mask Add's pairs too)
        monkeypatch.setattr("qtool.quantize.steps.dynamic_inputs.measure", lambda ctx, samples, threads=0: [])
    m = masked_attention(kind)
    model = save(m, str(tmp_path / f"{kind}.onnx"))
    data = tmp_path / f"data-{kind}-{monkeypatch is None}"
    data.mkdir()
    for i, f in enumerate(feeds(np.random.default_rng(1), 24)):
        np.savez(data / f"{i:03d}.npz", **f)
    wd = str(tmp_path / f"work-{kind}-{monkeypatch is None}")
    with pytest.warns(UserWarning) if kind == "inf" else _no_warning():
        calibrate(model, str(data), CalibrateOptions(config=None, method="minmax", show_progress=False), workdir=wd)
    r = quantize(wd, say=lambda s: None)
    q = onnx.load(r.report["int8_model"])
    ys, yq = [], []
    for f in feeds(np.random.default_rng(2), 8):
        ys.append(run(m, f)[0])
        yq.append(run(q, f)[0])
    ys, yq = np.concatenate(ys), np.concatenate(yq)
    return r, q, float(10 * np.log10(np.sum(ys ** 2) / np.sum((ys - yq) ** 2)))


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("kind", ["inf", "finfo_min"])
def test_the_mask_add_stays_fp32_and_the_layers_int8(tmp_path, kind):
    r, q, db = _quantized(tmp_path, kind)
    assert "add_mask" in r.report["excluded"] and "clamp" in r.report["excluded"]["add_mask"]
    quantized = {n.input[0] for n in q.graph.node if n.op_type == "QuantizeLinear"}
    assert {"x", "p"} <= quantized  # both layers int8
    assert not quantized & {"mask", "masked"}
    assert db > 25.0


@pytest.mark.parametrize("kind", ["inf", "finfo_min"])
def test_without_the_rule_the_masked_positions_come_back(tmp_path, monkeypatch, kind):
    _, _, db = _quantized(tmp_path, kind, monkeypatch)
    assert db < 15.0


def _table(ranges, nonfinite=None):
    return CalibrationTable("m.onnx", "", "", "minmax", 24, ranges={"minmax": ranges}, nonfinite=nonfinite or {})


def test_only_the_writers_and_readers_of_the_tensor():
    m = masked_attention("inf")
    table = _table({"scores": [-3.0, 3.0], "mask": [0.0, 0.0], "masked": [-3.0, 3.0]},
                   {"mask": {"count": 12, "samples": []}, "masked": {"count": 12, "samples": []}})
    excluded, held = unbounded_exclusions(m, table)
    assert set(held) == {"mask", "masked"}
    assert set(excluded) == {"mask", "add_mask", "softmax"}
    big = _table({"scores": [-3.0, 3.0], "mask": [-3.4e38, 0.0]})
    assert set(unbounded_exclusions(m, big)[0]) == {"mask", "add_mask"}
    assert unbounded_exclusions(m, _table({"scores": [-3.0, 3.0], "mask": [-1e6, 0.0]})) == ({}, {})


def test_an_infinity_from_the_data_is_not_the_graphs():
    """One inf in one corrupt sample reaches every tensor after the input: that costs the sample
    (calibration leaves it out of the ranges), not the int8 model."""
    from helpers import small_convnet
    m = small_convnet()
    every = {o: {"count": 1, "samples": ["bad.npy"]} for n in m.graph.node for o in n.output}
    assert unbounded_exclusions(m, _table({"scores": [-3.0, 3.0]}, every)) == ({}, {})
