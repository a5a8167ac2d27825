"""fuse/fold_attention_bias.py: an attention's key bias dropped (Softmax cancels it) and its value bias moved
into the output projection's (the attention's rows sum to 1), proven on shapes, never where the proof fails."""
from __future__ import annotations

import numpy as np
from helpers import assert_same_function, attention_block as _attention, ops

from qtool.fuse import FuseContext, fold_attention_bias, fuse_model

B, S, D = 2, 5, 16


def _feeds(seed=1):
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, 1, 1, S), np.float32)
    mask[1, ..., -2:] = -10000.0  # the second sentence padded
    return {"x": rng.standard_normal((B, S, D)).astype(np.float32), "mask": mask}


def _fold(model):
    """fuse_model's passes (the key's computed shape becomes a constant), this one among them: (the graph,
    how many biases it dropped or moved)."""
    r = fuse_model(model, {})
    return r.model, r.counts.get("fold_attention_bias", 0)


def test_the_key_bias_goes_and_the_value_bias_moves_into_the_output_projection():
    m = _attention()
    folded = fuse_model(m, {}).model
    assert_same_function(m, folded, _feeds(), rtol=1e-4)
    adds = {n.name for n in folded.graph.node if n.op_type == "Add"}
    assert "k_add" not in adds and "v_add" not in adds and {"q_add", "o_add", "masked"} <= adds
    # the key's Shape reads the projection's output instead (the same shape)
    assert ops(folded)["Add"] == ops(m)["Add"] - 2


def test_reshapes_from_constants_are_followed_too():
    m = _attention(dynamic_key_shape=False)
    folded, n = _fold(m)
    assert n == 2
    assert_same_function(m, folded, _feeds(), rtol=1e-4)


def test_the_pass_alone_proves_nothing_where_shape_inference_cannot_follow_a_computed_shape():
    """Before fold_reshape_shape makes the key's shape a constant, ONNX's inference leaves it unknown: the
    pass run alone changes nothing rather than guess."""
    m = _copy(_attention())
    assert not fold_attention_bias.run(m, FuseContext())


def test_a_softmax_over_another_axis_cancels_nothing():
    """Over the queries' axis the key's term varies along the Softmax: nothing is proven, nothing changes;
    nor do those rows sum to 1 along the axis the context MatMul reduces."""
    _, n = _fold(_attention(softmax_axis=2))
    assert n == 0


def test_weights_that_are_no_softmax_keep_the_value_bias():
    m = _attention(value_from="sigmoid")
    folded, _ = _fold(m)
    adds = {n.name for n in folded.graph.node if n.op_type == "Add"}
    assert "v_add" in adds
    assert_same_function(m, folded, _feeds(), rtol=1e-4)


def test_a_key_read_elsewhere_keeps_its_bias():
    m = _attention(key_read_elsewhere=True)
    folded, _ = _fold(m)
    adds = {n.name for n in folded.graph.node if n.op_type == "Add"}
    assert "k_add" in adds and "v_add" not in adds
    assert_same_function(m, folded, _feeds(), rtol=1e-4)


def _copy(m):
    import onnx
    c = onnx.ModelProto()
    c.CopyFrom(m)
    return c
