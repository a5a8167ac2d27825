"""Graph passes one by one and fuse_model end to end: every rewrite must compute the same function
(checked in ONNX Runtime at batch 1 and 3) and change the op counts as the pass's docstring says."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from helpers import assert_same_function, conv_bn, init, make_model, old_ir_conv_bn, ops, run, small_convnet, weight
from qtool import graph as G
from qtool.fuse import (FuseContext, fold_batchnorm, fold_constants, fold_mul_add, fold_pad, fold_reshape_shape,
                        fuse_model, remove_dead, remove_identity)


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _apply(pass_run, model, pins=None):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    ctx = FuseContext(input_pins=pins or {})
    changed = pass_run(m, ctx)
    onnx.checker.check_model(m)
    return m, changed, ctx


def _check_batches(before, after, c=3, hw=15):
    for n in (1, 3):
        assert_same_function(before, after, {"x": _x((n, c, hw, hw), seed=n)})


# --- fold_constants --------------------------------------------------------------------------------

def tf_same_pad_model(seed=0, hw=(15, 15)):
    """x [N,3,H,W] -> Pad(pads computed at run time from Shape(x), as torch exports TF 'SAME':
    total = max((ceil(H / s) - 1) * s + k - H, 0), before = total // 2, after = total - before) -> Conv s2."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"]),
        helper.make_node("Gather", ["shp", "hw_idx"], ["hw"], axis=0),
        helper.make_node("Add", ["hw", "s_minus_1"], ["t0"]),
        helper.make_node("Div", ["t0", "stride"], ["ceil"]),
        helper.make_node("Sub", ["ceil", "one"], ["t1"]),
        helper.make_node("Mul", ["t1", "stride"], ["t2"]),
        helper.make_node("Add", ["t2", "kernel"], ["t3"]),
        helper.make_node("Sub", ["t3", "hw"], ["t4"]),
        helper.make_node("Max", ["t4", "zero"], ["total"]),
        helper.make_node("Div", ["total", "two"], ["before"]),
        helper.make_node("Sub", ["total", "before"], ["after"]),
        helper.make_node("Concat", ["zeros2", "before", "zeros2", "after"], ["pads"], axis=0),
        helper.make_node("Pad", ["x", "pads"], ["xp"], mode="constant"),
        helper.make_node("Conv", ["xp", "w", "b"], ["y"], kernel_shape=[3, 3], strides=[2, 2]),
    ]
    i64 = np.int64
    inits = [init("hw_idx", [2, 3], i64), init("stride", [2], i64), init("s_minus_1", [1], i64), init("one", [1], i64),
             init("kernel", [3], i64), init("zero", [0], i64), init("two", [2], i64), init("zeros2", [0, 0], i64),
             weight(rng, "w", 4, 3, 3, 3), weight(rng, "b", 4)]
    return make_model(nodes, inits, [("x", ["N", 3, *hw])], [("y", ["N", 4, None, None])])


def test_fold_constants_folds_shape_chain_into_pad_constant():
    m0 = tf_same_pad_model()
    m1, changed, ctx = _apply(fold_constants.run, m0)
    assert changed and ctx.counts["fold_constants"] == 1
    # Shape(x) itself depends on the batch; it is left for remove_dead once nothing reads it
    m1, _, _ = _apply(remove_dead.run, m1)
    assert ops(m1) == {"Pad": 1, "Conv": 1}
    pads = G.const_value(m1, next(n for n in m1.graph.node if n.op_type == "Pad").input[1])
    assert pads.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    _check_batches(m0, m1)


def test_fold_constants_keeps_batch_dynamic():
    m1, _, _ = _apply(fold_constants.run, tf_same_pad_model())
    assert G.input_dims(m1.graph.input[0]) == ["N", 3, 15, 15]
    m1 = fuse_model(tf_same_pad_model()).model
    assert G.input_dims(m1.graph.input[0]) == ["N", 3, 15, 15]


def test_fold_constants_with_pinned_spatial_dims():
    """Dynamic H, W pinned to 15 x 15 (as calibrate pins them from the config): folded for that size."""
    r = fuse_model(tf_same_pad_model(hw=("H", "W")), input_pins={"x": [None, 3, 15, 15]})
    assert ops(r.model) == {"Conv": 1} and G.input_dims(r.model.graph.input[0]) == ["N", 3, 15, 15]
    assert G.attr(r.model.graph.node[0], "pads") == [1, 1, 1, 1]
    _check_batches(tf_same_pad_model(hw=("H", "W")), r.model)


def test_fold_constants_keeps_spatial_dependent_value_dynamic():
    m0 = tf_same_pad_model(hw=("H", "W"))
    m1 = fuse_model(m0).model
    for hw in (16, 15):
        assert_same_function(m0, m1, {"x": _x((1, 3, hw, hw))})


def test_fold_constants_leaves_batch_dependent_value():
    """y = x + batch size: Shape(x)[0] differs between batch 1 and 3, so it must stay computed at run time."""
    nodes = [helper.make_node("Shape", ["x"], ["shp"]),
             helper.make_node("Gather", ["shp", "i0"], ["n"], axis=0),
             helper.make_node("Cast", ["n"], ["nf"], to=onnx.TensorProto.FLOAT),
             helper.make_node("Add", ["x", "nf"], ["y"])]
    m0 = make_model(nodes, [init("i0", 0, np.int64)], [("x", ["N", 2, 4, 4])], [("y", ["N", 2, 4, 4])])
    m1, _, _ = _apply(fold_constants.run, m0)
    assert ops(m1).get("Shape") == 1 and ops(m1).get("Gather") == 1
    for n in (1, 3):
        x = _x((n, 2, 4, 4))
        np.testing.assert_allclose(run(m1, {"x": x})[0], x + n, rtol=1e-6)


@pytest.mark.parametrize("case", ["dim_is_one", "max_256"])
def test_fold_constants_keeps_thresholds_on_free_dims_dynamic(case):
    """Values that the usual stand-in sizes (7-200) all compute alike but a real size does not:
    pyannote branches on Shape(x)[1] == 1; swift-f0 pads to whole frames of max(length, 256)."""
    if case == "dim_is_one":  # y = x * (C == 1)
        nodes = [helper.make_node("Shape", ["x"], ["shp"]), helper.make_node("Gather", ["shp", "i1"], ["c"], axis=0),
                 helper.make_node("Equal", ["c", "i1"], ["eq"]),
                 helper.make_node("Cast", ["eq"], ["f"], to=onnx.TensorProto.FLOAT),
                 helper.make_node("Mul", ["x", "f"], ["y"])]
        inits = [init("i1", 1, np.int64)]
        sizes, want = (1, 5), lambda x: x * float(x.shape[1] == 1)
    else:  # y = x + (max(T, 256) - T)
        nodes = [helper.make_node("Shape", ["x"], ["shp"]), helper.make_node("Gather", ["shp", "i1"], ["t"], axis=0),
                 helper.make_node("Max", ["t", "k"], ["m"]), helper.make_node("Sub", ["m", "t"], ["d"]),
                 helper.make_node("Cast", ["d"], ["f"], to=onnx.TensorProto.FLOAT),
                 helper.make_node("Add", ["x", "f"], ["y"])]
        inits = [init("i1", 1, np.int64), init("k", 256, np.int64)]
        sizes, want = (100, 300), lambda x: x + float(max(x.shape[1], 256) - x.shape[1])
    shape = ["N", "C", 4] if case == "dim_is_one" else ["N", "T"]
    m0 = make_model(nodes, inits, [("x", shape)], [("y", shape)])
    m1, _, _ = _apply(fold_constants.run, m0)
    for size in sizes:
        x = _x((2, size, 4) if case == "dim_is_one" else (2, size))
        np.testing.assert_allclose(run(m1, {"x": x})[0], want(x), rtol=1e-6)


def test_fold_constants_does_not_fold_graph_output_computed_from_constants():
    nodes = [helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("Add", ["x", "c"], ["y"])]
    m0 = make_model(nodes, [init("a", [1.0, 2.0]), init("b", [3.0, 4.0])], [("x", [2])], [("y", [2])])
    m1, changed, _ = _apply(fold_constants.run, m0)
    assert changed and ops(m1) == {"Add": 1}
    assert G.const_value(m1, "c").tolist() == [4.0, 6.0]
    assert_same_function(m0, m1, {"x": np.array([1.0, -1.0], np.float32)})


# --- fold_reshape_shape ----------------------------------------------------------------------------

def reshape_chain_model():
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Shape", ["r"], ["shp"]),
             helper.make_node("Gather", ["shp", "i0"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"]),
             helper.make_node("Concat", ["n1", "m1"], ["target"], axis=0),
             helper.make_node("Reshape", ["r", "target"], ["y"])]
    inits = [init("i0", 0, np.int64), init("ax0", [0], np.int64), init("m1", [-1], np.int64)]
    return make_model(nodes, inits, [("x", ["N", 3, 4, 4])], [("y", ["N", 48])])


def test_fold_reshape_shape_makes_copy_and_infer_target():
    m0 = reshape_chain_model()
    m1, changed, ctx = _apply(fold_reshape_shape.run, m0)
    assert changed and ctx.counts["fold_reshape_shape"] == 1
    rs = next(n for n in m1.graph.node if n.op_type == "Reshape")
    assert G.const_value(m1, rs.input[1]).tolist() == [0, -1]
    m2, _, _ = _apply(remove_dead.run, m1)
    assert ops(m2) == {"Relu": 1, "Reshape": 1}
    for n in (1, 3):
        assert_same_function(m0, m2, {"x": _x((n, 3, 4, 4), n)})
        assert run(m2, {"x": _x((n, 3, 4, 4))})[0].shape == (n, 48)


def test_fold_reshape_shape_leaves_constant_target_alone():
    nodes = [helper.make_node("Reshape", ["x", "t"], ["y"])]
    m0 = make_model(nodes, [init("t", [0, -1], np.int64)], [("x", ["N", 3, 4, 4])], [("y", ["N", 48])])
    _, changed, _ = _apply(fold_reshape_shape.run, m0)
    assert not changed


# --- fold_pad ----------------------------------------------------------------------------------------

def pad_conv_model(pads, value=None, mode="constant", conv_pads=(0, 0, 0, 0), seed=0):
    rng = np.random.default_rng(seed)
    pad_in = ["x", "pads"] + (["value"] if value is not None else [])
    inits = [init("pads", pads, np.int64), weight(rng, "w", 4, 3, 3, 3), weight(rng, "b", 4)]
    if value is not None:
        inits.append(init("value", value))
    nodes = [helper.make_node("Pad", pad_in, ["xp"], mode=mode),
             helper.make_node("Conv", ["xp", "w", "b"], ["y"], kernel_shape=[3, 3], pads=list(conv_pads))]
    return make_model(nodes, inits, [("x", ["N", 3, 15, 15])], [("y", None)])


def test_fold_pad_zero_pad_into_conv_pads():
    m0 = pad_conv_model([0, 0, 1, 2, 0, 0, 2, 0], value=0.0, conv_pads=(1, 0, 1, 1))
    m1, changed, _ = _apply(fold_pad.run, m0)
    assert changed and ops(m1) == {"Conv": 1}
    conv = m1.graph.node[0]
    assert conv.input[0] == "x" and G.attr(conv, "pads") == [2, 2, 3, 1]
    _check_batches(m0, m1)


@pytest.mark.parametrize("kw", [dict(value=0.5), dict(mode="reflect"), dict(mode="edge")],
                         ids=["nonzero-value", "reflect", "edge"])
def test_fold_pad_leaves_non_zero_padding_alone(kw):
    m0 = pad_conv_model([0, 0, 1, 1, 0, 0, 1, 1], **kw)
    m1, changed, _ = _apply(fold_pad.run, m0)
    assert not changed and ops(m1) == {"Pad": 1, "Conv": 1}


def test_fold_pad_leaves_channel_padding_alone():
    m0 = pad_conv_model([0, 1, 0, 0, 0, 0, 0, 0])
    rng = np.random.default_rng(0)
    G.set_initializer(m0, "w", rng.standard_normal((4, 4, 3, 3)).astype(np.float32))
    _, changed, _ = _apply(fold_pad.run, m0)
    assert not changed


# --- fold_batchnorm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("group", [1, 3])
def test_fold_batchnorm_conv(bias, group):
    nodes, inits = conv_bn(np.random.default_rng(1), "x", "y", 3, 6, "l", group=group, bias=bias, relu=False)
    m0 = make_model(nodes, inits, [("x", ["N", 3, 15, 15])], [("y", None)])
    m1, changed, ctx = _apply(fold_batchnorm.run, m0)
    assert changed and ops(m1) == {"Conv": 1} and ctx.counts["fold_batchnorm"] == 1
    assert len(m1.graph.node[0].input) == 3  # a bias was created when there was none
    assert not any(t.name.startswith("l_mean") or t.name.startswith("l_var") for t in m1.graph.initializer)
    _check_batches(m0, m1)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_fold_batchnorm_gemm(trans_b):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((5, 6) if trans_b else (6, 5)).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=trans_b),
             helper.make_node("BatchNormalization", ["g", "s", "o", "mu", "v"], ["y"], epsilon=1e-5)]
    inits = [init("w", w), weight(rng, "b", 5), init("s", rng.uniform(0.5, 2, 5)), weight(rng, "o", 5),
             weight(rng, "mu", 5), init("v", rng.uniform(0.2, 3, 5))]
    m0 = make_model(nodes, inits, [("x", ["N", 6])], [("y", ["N", 5])])
    m1, changed, _ = _apply(fold_batchnorm.run, m0)
    assert changed and ops(m1) == {"Gemm": 1}
    for n in (1, 3):
        assert_same_function(m0, m1, {"x": _x((n, 6), n)})


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("affine", ["bn", "mul_add"])
def test_fold_into_conv_transpose(group, affine):
    """A decoder's upsampling ConvTranspose (W [Cin, Cout / group, kh, kw]) followed by BatchNormalization,
    or by its Mul + Add: folded, with the output channels of each group scaled as their own."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["t"], strides=[2, 2], group=group,
                              kernel_shape=[3, 3], pads=[1, 1, 1, 1], output_padding=[1, 1])]
    inits = [weight(rng, "w", 4, 6 // group, 3, 3), weight(rng, "b", 6)]
    if affine == "bn":
        nodes.append(helper.make_node("BatchNormalization", ["t", "s", "o", "mu", "v"], ["y"], epsilon=1e-5))
        inits += [init("s", rng.uniform(0.5, 2, 6)), weight(rng, "o", 6), weight(rng, "mu", 6),
                  init("v", rng.uniform(0.2, 3, 6))]
    else:
        nodes += [helper.make_node("Mul", ["t", "s"], ["m"]), helper.make_node("Add", ["m", "o"], ["y"])]
        inits += [init("s", rng.uniform(0.5, 2, (6, 1, 1))), weight(rng, "o", 1, 6, 1, 1)]
    m0 = make_model(nodes, inits, [("x", ["N", 4, 7, 7])], [("y", None)])
    m1 = fuse_model(m0).model
    assert ops(m1) == {"ConvTranspose": 1}
    assert_same_function(m0, m1, {"x": _x((2, 4, 7, 7))})


def test_fold_batchnorm_leaves_conv_with_second_consumer():
    nodes, inits = conv_bn(np.random.default_rng(3), "x", "bn", 3, 4, "l", relu=False)
    nodes.append(helper.make_node("Add", ["bn", "l_c"], ["y"]))  # the conv output is read twice
    m0 = make_model(nodes, inits, [("x", ["N", 3, 15, 15])], [("y", None)])
    m1, changed, _ = _apply(fold_batchnorm.run, m0)
    assert not changed and ops(m1) == ops(m0)
    assert_same_function(m0, fuse_model(m0).model, {"x": _x((2, 3, 15, 15))})


# --- fold_mul_add -----------------------------------------------------------------------------------

def conv_affine_model(mul_shape, add_shape, seed=4):
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c", "k"], ["m"]),
             helper.make_node("Add", ["d", "m"], ["y"])]  # constant first: either order must fold
    inits = [weight(rng, "w", 4, 3, 3, 3), init("k", rng.uniform(0.5, 2, mul_shape)), weight(rng, "d", *add_shape)]
    return make_model(nodes, inits, [("x", ["N", 3, 15, 15])], [("y", None)])


@pytest.mark.parametrize("mul_shape,add_shape", [((1, 4, 1, 1), (4, 1, 1)), ((4, 1, 1), (1, 4, 1, 1)), ((1,), (1,))])
def test_fold_mul_add_per_channel(mul_shape, add_shape):
    m0 = conv_affine_model(mul_shape, add_shape)
    m1, changed, ctx = _apply(fold_mul_add.run, m0)
    assert changed and ops(m1) == {"Conv": 1} and ctx.counts["fold_mul_add"] == 2
    _check_batches(m0, m1)


@pytest.mark.parametrize("mul_shape,add_shape", [((1, 1, 15, 15), (4, 1, 1)), ((1, 4, 1, 1), (1, 1, 1, 15))])
def test_fold_mul_add_leaves_spatial_constant(mul_shape, add_shape):
    m0 = conv_affine_model(mul_shape, add_shape)
    m1, _, _ = _apply(fold_mul_add.run, m0)
    spatial = "k" if mul_shape[-1] == 15 else "d"
    assert any(spatial in n.input for n in m1.graph.node), "the spatially varying constant was folded"
    _check_batches(m0, m1)


def test_fold_mul_add_gemm():
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=1),
             helper.make_node("Mul", ["g", "k"], ["m"]), helper.make_node("Add", ["m", "d"], ["y"])]
    inits = [weight(rng, "w", 5, 6), weight(rng, "b", 5), init("k", rng.uniform(-2, 2, (1, 5))), weight(rng, "d", 5)]
    m0 = make_model(nodes, inits, [("x", ["N", 6])], [("y", ["N", 5])])
    m1, changed, _ = _apply(fold_mul_add.run, m0)
    assert changed and ops(m1) == {"Gemm": 1}
    assert_same_function(m0, m1, {"x": _x((3, 6))})


# --- remove_identity / remove_dead ------------------------------------------------------------------

def test_remove_identity_and_dropout():
    nodes = [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Dropout", ["b"], ["c"]), helper.make_node("Neg", ["c"], ["y"])]
    m0 = make_model(nodes, [], [("x", ["N", 4])], [("y", ["N", 4])])
    m1, changed, ctx = _apply(remove_identity.run, m0)
    assert changed and ops(m1) == {"Relu": 1, "Neg": 1} and ctx.counts["remove_identity"] == 2
    assert_same_function(m0, m1, {"x": _x((3, 4))})


def test_remove_identity_producing_graph_output():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["y"])]
    m0 = make_model(nodes, [], [("x", ["N", 4])], [("y", ["N", 4])])
    m1, changed, _ = _apply(remove_identity.run, m0)
    assert changed and ops(m1) == {"Relu": 1} and m1.graph.node[0].output[0] == "y"
    assert_same_function(m0, m1, {"x": _x((3, 4))})


def test_remove_identity_keeps_identity_from_input_to_output():
    m0 = make_model([helper.make_node("Identity", ["x"], ["y"])], [], [("x", [4])], [("y", [4])])
    m1, changed, _ = _apply(remove_identity.run, m0)
    assert not changed and ops(m1) == {"Identity": 1}


def test_remove_identity_keeps_output_identity_when_source_has_other_readers():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["y"]),
             helper.make_node("Neg", ["a"], ["z"])]
    m0 = make_model(nodes, [], [("x", [4])], [("y", [4]), ("z", [4])])
    m1, _, _ = _apply(remove_identity.run, m0)
    assert_same_function(m0, m1, {"x": _x((4,))})


def test_remove_dead_drops_unused_nodes_and_initializers():
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Mul", ["x", "k"], ["unused"]),
             helper.make_node("Neg", ["unused"], ["unused2"])]
    m0 = make_model(nodes, [init("k", [2.0])], [("x", [4])], [("y", [4])])
    m1, changed, ctx = _apply(remove_dead.run, m0)
    assert changed and ops(m1) == {"Relu": 1} and not m1.graph.initializer
    assert ctx.counts["remove_dead"] == 1
    _, changed2, _ = _apply(remove_dead.run, m1)
    assert not changed2


# --- fuse_model end to end ----------------------------------------------------------------------------

def test_fuse_model_end_to_end_tf_same_net():
    """Identity + Shape/Pad chain + Conv + BN + Mul/Add + Reshape chain + dead branch, all cleaned."""
    rng = np.random.default_rng(6)
    m = tf_same_pad_model()
    g = m.graph
    # conv output y -> Identity -> BN -> Mul -> Relu -> Shape-based Reshape -> out
    conv = next(n for n in g.node if n.op_type == "Conv")
    conv.output[0] = "c0"
    g.node.extend([
        helper.make_node("Identity", ["c0"], ["c1"]),
        helper.make_node("BatchNormalization", ["c1", "g", "be", "mu", "va"], ["c2"]),
        helper.make_node("Mul", ["c2", "k"], ["c3"]),
        helper.make_node("Relu", ["c3"], ["r"]),
        helper.make_node("Shape", ["r"], ["rs"]),
        helper.make_node("Gather", ["rs", "i0"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"]),
        helper.make_node("Concat", ["n1", "m1"], ["target"], axis=0),
        helper.make_node("Reshape", ["r", "target"], ["out"]),
        helper.make_node("Sigmoid", ["r"], ["dead"]),
    ])
    g.initializer.extend([init("g", rng.uniform(0.5, 1.5, 4)), weight(rng, "be", 4), weight(rng, "mu", 4),
                          init("va", rng.uniform(0.5, 2, 4)), init("k", rng.uniform(0.5, 2, (1, 4, 1, 1))),
                          init("i0", 0, np.int64), init("ax0", [0], np.int64), init("m1", [-1], np.int64)])
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, ["N", 256]))
    onnx.checker.check_model(m)
    r = fuse_model(m)
    onnx.checker.check_model(r.model)
    assert r.ops_after == ops(r.model) == {"Conv": 1, "Relu": 1, "Reshape": 1}
    for k in ("remove_identity", "fold_constants", "fold_reshape_shape", "fold_pad", "fold_batchnorm",
              "fold_mul_add", "remove_dead"):
        assert r.counts.get(k, 0) >= 1, (k, r.counts)
    assert G.input_dims(r.model.graph.input[0])[0] == "N"
    assert len({n.name for n in r.model.graph.node}) == len(r.model.graph.node) and all(n.name for n in r.model.graph.node)
    _check_batches(m, r.model)


def test_fuse_model_does_not_modify_its_input():
    m = small_convnet()
    before = m.SerializeToString()
    r = fuse_model(m)
    assert m.SerializeToString() == before
    assert "BatchNormalization" not in r.ops_after and r.ops_before["BatchNormalization"] == 3
    assert_same_function(m, r.model, {"x": _x((3, 3, 16, 16))})


def test_fuse_model_old_ir_weights_listed_as_inputs():
    """Old exporters list every initializer as a graph input too; folded-away BN parameters must not
    remain as inputs ORT then asks the caller to feed."""
    m0 = old_ir_conv_bn(hw=8)
    r = fuse_model(m0)
    inits_after = {t.name for t in r.model.graph.initializer}
    dangling = [i.name for i in r.model.graph.input if i.name != "x" and i.name not in inits_after]
    assert dangling == [], f"graph inputs with no initializer after folding: {dangling}"
    assert_same_function(m0, r.model, {"x": _x((1, 3, 8, 8))})


# --- more shapes of the same patterns -----------------------------------------------------------------------

def test_fold_pad_opset9_attribute_form():
    rng = np.random.default_rng(8)
    nodes = [helper.make_node("Pad", ["x"], ["xp"], pads=[0, 0, 1, 1, 0, 0, 1, 1], mode="constant", value=0.0),
             helper.make_node("Conv", ["xp", "w"], ["y"], kernel_shape=[3, 3])]
    m0 = make_model(nodes, [weight(rng, "w", 4, 3, 3, 3)], [("x", ["N", 3, 8, 8])], [("y", ["N", 4, 8, 8])], opset=9)
    m1, changed, _ = _apply(fold_pad.run, m0)
    assert changed and ops(m1) == {"Conv": 1} and G.attr(m1.graph.node[0], "pads") == [1, 1, 1, 1]
    assert_same_function(m0, m1, {"x": _x((2, 3, 8, 8))})


def test_fuse_shape_with_start_attribute_reshape():
    """opset 15 Shape(start=1) -> ReduceProd -> Concat([-1, C*H*W]) -> Reshape: becomes a constant target."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1), helper.make_node("ReduceProd", ["s"], ["p"], keepdims=1),
             helper.make_node("Concat", ["m1", "p"], ["t"], axis=0), helper.make_node("Reshape", ["x", "t"], ["y"])]
    m0 = make_model(nodes, [init("m1", [-1], np.int64)], [("x", ["N", 3, 4, 4])], [("y", ["N", 48])], opset=15)
    r = fuse_model(m0)
    assert ops(r.model) == {"Reshape": 1}
    assert G.const_value(r.model, r.model.graph.node[0].input[1]).tolist() == [-1, 48]
    for n in (1, 3):
        assert_same_function(m0, r.model, {"x": _x((n, 3, 4, 4), n)})


def test_remove_identity_chain_to_output_and_casts():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Cast", ["a"], ["b"], to=onnx.TensorProto.FLOAT),
             helper.make_node("Identity", ["b"], ["c"]), helper.make_node("Identity", ["c"], ["y"]),
             helper.make_node("Cast", ["a"], ["i"], to=onnx.TensorProto.INT32),
             helper.make_node("Cast", ["i"], ["z"], to=onnx.TensorProto.FLOAT)]
    m0 = make_model(nodes, [], [("x", [4])], [("y", [4]), ("z", [4])])
    r = fuse_model(m0)
    # the float->float Cast and one Identity go; the int round trip stays, and so does the Identity that
    # names output y, since Relu's output has a second reader and cannot simply be renamed
    assert ops(r.model) == {"Relu": 1, "Cast": 2, "Identity": 1}
    assert_same_function(m0, r.model, {"x": np.array([-1.5, 0.4, 2.6, 3.0], np.float32)})


def test_fold_mul_scalar_into_conv_without_bias():
    rng = np.random.default_rng(9)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]), helper.make_node("Mul", ["c", "k"], ["m"]),
             helper.make_node("Add", ["m", "d"], ["y"])]
    m0 = make_model(nodes, [weight(rng, "w", 4, 3, 1, 1), init("k", -2.0), init("d", 0.5)],
                    [("x", ["N", 3, 4, 4])], [("y", ["N", 4, 4, 4])])
    r = fuse_model(m0)
    assert ops(r.model) == {"Conv": 1} and len(r.model.graph.node[0].input) == 3
    assert_same_function(m0, r.model, {"x": _x((2, 3, 4, 4))})


def test_remove_dropout_whose_mask_nobody_reads():
    """Opset 7-11 exports write Dropout's mask; unread, the Dropout is still an identity."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Dropout", ["a"], ["b", "mask"], ratio=0.5),
             helper.make_node("Neg", ["b"], ["y"])]
    m0 = make_model(nodes, [], [("x", ["N", 4])], [("y", ["N", 4])], opset=11)
    m1, changed, _ = _apply(remove_identity.run, m0)
    assert changed and ops(m1) == {"Relu": 1, "Neg": 1}
    assert_same_function(m0, m1, {"x": _x((3, 4))})


def test_keep_dropout_whose_mask_is_read_or_that_trains():
    read = [helper.make_node("Dropout", ["x"], ["b", "mask"]), helper.make_node("Cast", ["mask"], ["mf"], to=1),
            helper.make_node("Add", ["b", "mf"], ["y"])]
    m0 = make_model(read, [], [("x", ["N", 4])], [("y", ["N", 4])], opset=11)
    assert not _apply(remove_identity.run, m0)[1]
    train = [helper.make_node("Dropout", ["x", "", "t"], ["y"])]
    m0 = make_model(train, [init("t", np.array(True), np.bool_)], [("x", ["N", 4])], [("y", ["N", 4])], opset=13)
    assert not _apply(remove_identity.run, m0)[1]
    off = [helper.make_node("Dropout", ["x", "", "t"], ["b"]), helper.make_node("Neg", ["b"], ["y"])]
    m0 = make_model(off, [init("t", np.array(False), np.bool_)], [("x", ["N", 4])], [("y", ["N", 4])], opset=13)
    assert _apply(remove_identity.run, m0)[1]


def _crop_after_valid_conv(h="H"):
    """Conv 3x3 without padding, then a crop of 4 rows each side (waifu2x's CUNet crops so): at a height of 1
    the Conv's rows are -1 and onnx's shape inference with data propagation aborts the process (SIGABRT)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             # (Constant nodes, as the opset upgrade writes a Slice-9's attributes: fold_constants has work to do)
             helper.make_node("Constant", [], ["st"], value=helper.make_tensor("st", 7, [1], [4]), name="k0"),
             helper.make_node("Constant", [], ["en"], value=helper.make_tensor("en", 7, [1], [-4]), name="k1"),
             helper.make_node("Slice", ["c", "st", "en", "ax"], ["y"], name="crop")]
    inits = [weight(rng, "w", 2, 1, 3, 3), init("ax", [2], np.int64)]
    return make_model(nodes, inits, [("x", [1, 1, h, 16])], [("y", [1, 2, None, 14])])


def test_shape_inference_that_aborts_is_a_failure_not_a_crash():
    m = _crop_after_valid_conv(h=1)
    with pytest.raises(ValueError, match="signal 6"):
        G.infer_shapes_guarded(m, strict_mode=False, data_prop=True)
    assert G.infer_shapes_guarded(_crop_after_valid_conv(h=32), data_prop=True).graph.output[0].type.tensor_type.shape.dim[2].dim_value == 22


def test_fold_constants_survives_sizes_the_model_cannot_take():
    """fold_constants instantiates free dims at 1 (among others); calibrate died there (exit 134)."""
    fused = fuse_model(_crop_after_valid_conv())
    x = np.random.default_rng(1).standard_normal((1, 1, 40, 16)).astype(np.float32)
    assert_same_function(_crop_after_valid_conv(), fused.model, {"x": x})


def test_fold_constants_evaluates_what_no_size_changes_once(monkeypatch):
    """A value that cannot depend on the free dims (a Constant node, arithmetic on weights) is evaluated
    once for the six instantiations; what follows a Shape is evaluated in each. The folded graph is the
    same either way."""
    from onnx import TensorProto, helper as H, numpy_helper
    from qtool.fuse import FuseContext, fold_constants as F

    nodes = [H.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.full(4, 2.0, np.float32))),
             H.make_node("Mul", ["c", "w"], ["cw"]),
             H.make_node("Shape", ["x"], ["s"]),
             H.make_node("Gather", ["s", "one"], ["n"], axis=0),
             H.make_node("Reshape", ["x", "shape"], ["x2"]),
             H.make_node("Add", ["x2", "cw"], ["y"])]
    g = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                     [H.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]),
                      H.make_tensor_value_info("n", TensorProto.INT64, [])],
                     [numpy_helper.from_array(np.ones(4, np.float32), "w"),
                      numpy_helper.from_array(np.array(1, np.int64), "one"),
                      numpy_helper.from_array(np.array([-1, 4], np.int64), "shape")])
    model = H.make_model(g, opset_imports=[H.make_opsetid("", 13)])
    seen = []
    real = F.ReferenceEvaluator

    class Counting(real):
        def __init__(self, node, *a, **k):
            seen.append(node.op_type)
            super().__init__(node, *a, **k)

    monkeypatch.setattr(F, "ReferenceEvaluator", Counting)
    assert F.run(model, FuseContext())
    assert seen.count("Constant") == 1 and seen.count("Mul") == 1
    assert seen.count("Gather") == len(F.VARIANTS) + len(F.VETOS)  # (after a Shape: once per size)
    assert "cw" in {t.name for t in model.graph.initializer}
    assert "n" not in {t.name for t in model.graph.initializer}  # the batch stays dynamic
