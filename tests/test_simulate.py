"""quantize/simulate.py: a variant run from a cut computes what the variant's QDQ model computes in
float, whatever the cut, and the cuts are planned to save work."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from helpers import small_convnet, write_config, write_images
from qtool.metrics import sqnr_db
from qtool.ortsession import session
from qtool.quantize.context import QuantizeContext
from qtool.quantize.samples import load_samples
from qtool.quantize.sensitivity import quantizable_layers
from qtool.quantize.simulate import Simulator, Variant


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions
    root = tmp_path_factory.mktemp("sim")
    from helpers import save
    model = save(small_convnet(seed=3), root / "net.onnx")
    write_images(root / "data", 10, seed=4)
    cfg = write_config(root / "cfg.toml")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = calibrate(model, str(root / "data"),
                      CalibrateOptions(config=cfg, method="minmax", threads=1, show_progress=False),
                      workdir=str(root / "work"))
    ctx = QuantizeContext(r.fused, r.table, "minmax", threads=1)
    return ctx, load_samples(r.fused, r.table, sorted(str(p) for p in (root / "data").iterdir()))


def _float_qdq(ctx, samples, exclude, **kw):
    """The variant's own QDQ model, run by ORT in float (no int8 kernels): what the simulation claims to be."""
    q = ctx.build(exclude, **kw).model
    return np.concatenate([session(q, 1, basic=True).run(None, f)[0] for f in samples.feeds])


def test_each_single_layer_variant_is_its_qdq_model_in_float(setup):
    ctx, samples = setup
    sim = Simulator(ctx)
    names = [d.name for d in quantizable_layers(ctx.fused)]
    excl = [{n: "x" for n in names if n != name} for name in names]
    outs = sim.run(samples, [sim.variant(e, prune_excluded=False) for e in excl])
    for name, e, y in zip(names, excl, outs):
        want = _float_qdq(ctx, samples, e, prune_excluded=False)
        assert sqnr_db(want, y) > 60, name  # equal up to float rounding of the sums
        assert sqnr_db(samples.reference, y) < 80  # and the layer's quantization shows


def test_the_cut_does_not_change_the_answer(setup, monkeypatch):
    ctx, samples = setup
    sim = Simulator(ctx)
    names = [d.name for d in quantizable_layers(ctx.fused)]
    vs = [sim.variant({n: "x" for n in names if n != name}, prune_excluded=False) for name in names]
    planned = sim.run(samples, vs)
    assert len({sim.plan_cuts([sim.first(v) for v in vs], sim._share)[sim.first(v)] for v in vs}) > 1
    monkeypatch.setattr(sim, "plan_cuts", lambda firsts, share, seconds: {f: 0 for f in firsts})  # every variant from the input
    whole = sim.run(samples, vs)
    for a, b in zip(planned, whole):
        # one variant per session fixes its quantizers in the graph, several switch them: ORT sums
        # in another order there, and a value at a rounding boundary may land one step away
        assert sqnr_db(b, a) > 60


def test_a_tensor_probe_follows_its_fed_range(setup):
    """A probe's range comes with the run: two ranges for one tensor, one session, two answers."""
    from qtool import qparams as Q
    ctx, samples = setup
    sim = Simulator(ctx)
    t = next(iter(sim.plan.tensors))
    lo, hi = ctx.table.range(t, "minmax")
    wide, narrow = (Variant(set(), {t: Q.activation_qparams(lo * f, hi * f)}, sim.plan.int8_nodes) for f in (4.0, 1.0))
    y_wide, y_narrow = sim.run(samples, [wide, narrow])
    ref = samples.reference
    assert sqnr_db(ref, y_narrow) > sqnr_db(ref, y_wide) + 3  # a 4x wider range: coarser steps


def test_plan_cuts_trades_sessions_against_suffix_work():
    sim = Simulator.__new__(Simulator)
    share = np.full(100, 0.01)  # 100 nodes of equal cost: a suffix from node p costs (100 - p) / 100
    far = sim.plan_cuts([0, 90, 91], share, pass_seconds=10.0)
    assert far[0] == 0 and far[90] == 90  # a late variant gets its own cut: 0.9 pass saved
    each = sim.plan_cuts([0, 40, 41, 42], share, pass_seconds=100.0)  # sessions nearly free: one per start
    assert [each[f] for f in (0, 40, 41, 42)] == [0, 40, 41, 42]
    # when a pass costs less than making a session (a tiny input), every variant runs from the input
    assert set(sim.plan_cuts([0, 90, 91], share, pass_seconds=0.001).values()) == {0}


def test_the_prefix_runs_only_what_the_cut_needs(setup):
    ctx, samples = setup
    sim = Simulator(ctx)
    early = sim._frontier(2)
    m, big = sim.prefix_model(early)
    assert 0 < len(m.graph.node) <= 2 < len(sim.nodes)  # the nodes after the cut are not in it
    got = session(m, 1, external=big).run(early, samples.feeds[0])
    from qtool.ortsession import with_outputs
    want = session(with_outputs(ctx.fused, early), 1).run(early, samples.feeds[0])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_layer_alone_keeps_its_per_channel_weights_in_the_simulation(tmp_path):
    """ORT quantizes a float weight between DequantizeLinear and QuantizeLinear to int8 per tensor
    (WeightBiasQuantization) unless told not to: a depthwise convolution whose channels differ a
    thousandfold in size lost its small channels, and the simulated layer looked 20 dB worse than
    its QDQ model (EfficientNet-Lite0's depthwise layers ranked most sensitive for it)."""
    from onnx import numpy_helper
    from helpers import save
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions
    from qtool.quantize.sensitivity import layer_exclusions, layer_variants
    m = small_convnet(seed=5)
    f = np.array([1, 1e-3, 1, 3e-3, 1, 1e-2, 1, 3e-2])  # channel sizes of the depthwise output
    inits = {t.name: t for t in m.graph.initializer}
    for name, scale in (("dw_g", f), ("dw_beta", f)):
        inits[name].CopyFrom(numpy_helper.from_array((numpy_helper.to_array(inits[name]) * scale).astype(np.float32), name))
    w = numpy_helper.to_array(inits["pw_w"]) / f[None, :, None, None]  # the next layer reads each channel alike
    inits["pw_w"].CopyFrom(numpy_helper.from_array(w.astype(np.float32), "pw_w"))
    model = save(m, tmp_path / "net.onnx")
    write_images(tmp_path / "data", 8, seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = calibrate(model, str(tmp_path / "data"),
                      CalibrateOptions(config=write_config(tmp_path / "cfg.toml"), method="minmax", threads=1, show_progress=False),
                      workdir=str(tmp_path / "work"))
    ctx = QuantizeContext(r.fused, r.table, "minmax", threads=1)
    samples = load_samples(r.fused, r.table, sorted(str(p) for p in (tmp_path / "data").iterdir()))
    sim = Simulator(ctx)
    picked, variants = layer_variants(sim, only=["dw_conv"])
    assert [d.name for _, d in picked] == ["dw_conv"] and variants[0].weights == {"dw_conv"}
    y = sim.run(samples, variants)[0]  # one variant: its quantizers fixed in its graph, around its weight
    want = _float_qdq(ctx, samples, layer_exclusions(sim, only=["dw_conv"])[1][0], prune_excluded=False)
    assert abs(sqnr_db(samples.reference, y) - sqnr_db(samples.reference, want)) < 0.1
    assert sqnr_db(want, y) > 60


def test_the_prefix_of_an_old_ir_model_loads(tmp_path):
    """IR 3 lists every initializer among the graph inputs; the prefix keeps only the real inputs."""
    from onnx import helper
    from helpers import save
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions
    m = small_convnet(seed=1)
    m.ir_version = 3
    for t in m.graph.initializer:
        m.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    write_images(tmp_path / "data", 4, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = calibrate(save(m, tmp_path / "m.onnx"), str(tmp_path / "data"),
                      CalibrateOptions(config=write_config(tmp_path / "c.toml"), method="minmax", threads=1, show_progress=False),
                      workdir=str(tmp_path / "w"))
    ctx = QuantizeContext(r.fused, r.table, "minmax", threads=1)
    samples = load_samples(r.fused, r.table, sorted(str(p) for p in (tmp_path / "data").iterdir()))
    sim = Simulator(ctx)
    assert sim.base.ir_version < 4
    cut = sim._frontier(3)
    pm, big = sim.prefix_model(cut)
    got = session(pm, 1, external=big).run(cut, samples.feeds[0])
    assert [g.shape[0] for g in got] == [len(samples)] * len(cut)


def test_a_shape_vector_crossing_a_cut_keeps_its_length():
    """A cut model's inputs leave axis 0 unnamed (the batch), but an int64 shape vector's axis 0 is its
    length: left unknown, ONNX Runtime took SLANet-plus's Resize `sizes`, a Concat of it, for an empty
    tensor and refused every experiment past that cut (exit 70 under --strict)."""
    from qtool.quantize.simulate import _dims
    assert _dims([1, 3, 8, 8]) == [None, 3, 8, 8]
    assert _dims([2], batched=False) == [2]
    assert _dims([None, 4], batched=False) == [None, 4]
    assert _dims(None, batched=False) is None


def _upscaler():
    """[N, 3, 64, 64] -> 1x1 Conv to 64 channels -> Resize x8 -> 1x1 Conv to 3: small inputs, 67 MB tensors per sample."""
    from onnx import helper

    from helpers import init, make_model, weight
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="c1"),
             helper.make_node("Resize", ["a", "", "sc"], ["b"], name="up", mode="nearest"),
             helper.make_node("Relu", ["b"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="c2")]
    return make_model(nodes, [weight(rng, "w1", 64, 3, 1, 1), init("sc", [1, 1, 8, 8]), weight(rng, "w2", 3, 64, 1, 1)],
                      [("x", ["N", 3, "H", "W"])], [("y", ["N", 3, "H8", "W8"])])


def test_batches_are_sized_by_what_a_run_holds():
    """Batches were sized by input bytes alone: waifu2x's CUNet (292 x 292 in, 64 channels at twice that) ran
    10 samples at once, its quantize at 5.7 GB where its fixed-batch copy took 2.0. The largest tensors at the
    samples' size bound it now, and the simulation's chunks and its profiling run take no more."""
    from qtool.quantize.samples import ACT_BYTES, BATCH, _batch_for
    m = _upscaler()
    x = np.zeros((16, 3, 64, 64), np.float32)
    assert _batch_for({"x": x}) == BATCH  # (16 inputs of 48 KB: the input bytes allow them all)
    per_sample = 4 * 3 * 64 * 512 * 512  # three 64 x 512 x 512 float tensors
    assert _batch_for({"x": x}, m) == max(1, ACT_BYTES // per_sample) < BATCH


def test_the_profiling_run_takes_the_samples_batch(setup, monkeypatch):
    ctx, samples = setup
    sim = Simulator(ctx)
    seen = []
    monkeypatch.setattr(sim, "_costs", lambda feed: seen.append(len(next(iter(feed.values())))) or np.ones(len(sim.nodes)))
    small = samples.subset(range(len(samples)))
    small.batch = 2
    sim.shares(small)
    assert seen == [2]
    assert all(n <= 2 for _, n in sim._chunks(small, []))


def _run_time_quantized(tmp_path):
    """LayerNorm -> MatMul m1 -> residual Add -> MatMul m2, batch free, calibrated on samples whose scales
    differ 30-fold: the two MatMuls quantize their inputs at run time (ctx.dynamic)."""
    from onnx import TensorProto, helper, numpy_helper
    from helpers import calibrate_samples
    from qtool.calibrate.table import load_table
    from qtool.quantize.samples import load_samples as load
    T, D, N = 8, 16, 24
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.uniform(0.5, 2.0, D).astype(np.float32), "gamma"),
             numpy_helper.from_array(np.zeros(D, np.float32), "beta"),
             numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((D, N)).astype(np.float32), "w2")]
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"], name="sq"),
             helper.make_node("MatMul", ["sq", "w1"], ["a"], name="m1"),
             helper.make_node("Add", ["a", "x"], ["r"], name="residual"),
             helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["n"], name="ln", axis=-1),
             helper.make_node("MatMul", ["n", "w2"], ["y"], name="m2")]
    g = helper.make_graph(nodes, "rt", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", T, D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", T, N])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    samples = [{"x": (rng.standard_normal((1, T, D)) * s).astype(np.float32)} for s in np.geomspace(0.1, 3, 8)]
    work = calibrate_samples(m, samples, tmp_path, method="minmax")
    import onnx
    fused = onnx.load(f"{work}/fused.onnx")
    table = load_table(f"{work}/calibration.json")
    ctx = QuantizeContext(fused, table, "minmax", threads=1, dynamic=frozenset({"m1", "m2"}))
    return ctx, load(fused, table, sorted(str(p) for p in (tmp_path / "data").iterdir()))


def test_a_layer_quantizing_its_input_at_run_time_is_simulated_so(tmp_path):
    """sensitivity measures a run-time quantized layer as the build writes it (DynamicQuantizeLinear, one
    range per sample), not with a static range: alone and switched among others, one sample a run."""
    ctx, samples = _run_time_quantized(tmp_path)
    sim = Simulator(ctx)
    names = [d.name for d in quantizable_layers(ctx.fused)]
    assert {"m1", "m2"} <= set(names)
    excl = [{n: "x" for n in names if n != name} for name in names]
    variants = [sim.variant(e, prune_excluded=False) for e in excl]
    assert [v.dynamic for v in variants if v.dynamic] == [{"m1": "sq"}, {"m2": "n"}]
    together = sim.run(samples, variants)
    alone = [sim.run(samples, [v])[0] for v in variants]
    for name, e, y, y1 in zip(names, excl, together, alone):
        q = ctx.build(e, prune_excluded=False).model
        assert any(n.op_type == "DynamicQuantizeLinear" for n in q.graph.node) == (name in ("m1", "m2"))
        want = np.concatenate([session(q, 1, basic=True).run(None, f)[0] for f in samples.single_feeds()])
        assert sqnr_db(want, y) > 60 and sqnr_db(want, y1) > 60, name
    # a static range in its place (what the simulation did before): far from the model the build writes
    static = ctx.build(excl[names.index("m1")], prune_excluded=False, dynamic=frozenset()).model
    y_static = np.concatenate([session(static, 1, basic=True).run(None, f)[0] for f in samples.single_feeds()])
    assert sqnr_db(samples.reference, together[names.index("m1")]) > sqnr_db(samples.reference, y_static) + 3
