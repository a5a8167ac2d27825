"""fuse/pair_channels: channel orders chosen so that ONNX Runtime's int16 pairs of int8 weights
cannot saturate, without changing what the graph computes."""
from __future__ import annotations

import numpy as np
from onnx import helper

from helpers import assert_same_function, init, make_model, weight
from qtool.fuse import FuseContext, fuse_model, pair_channels
from qtool.fuse.pair_channels import greedy_pairing, pair_cost_matrix, pairs_cost


def _cost(model, output):
    """Cost of the current channel order for the Conv writing `output`."""
    from onnx import numpy_helper
    inits = {t.name: t for t in model.graph.initializer}
    node = next(n for n in model.graph.node if n.output[0] == output)
    c = pair_cost_matrix([(numpy_helper.to_array(inits[node.input[1]]), 1)])
    return pairs_cost(c, np.arange(len(c)))


def _reordered(before, after, output, k=1):
    """Whether the constant input `k` of the node writing `output` changed (it is only ever reordered)."""
    from onnx import numpy_helper

    def const(m):
        node = next(n for n in m.graph.node if n.output[0] == output)
        return numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == node.input[k]))
    a, b = const(before), const(after)
    assert sorted(a.ravel().tolist()) == sorted(b.ravel().tolist())
    return not np.array_equal(a, b)


def _net(rng, c=16, concat=True):
    """stem -> [expand 1x1 -> Relu -> depthwise -> Clip -> project 1x1] + residual -> Relu -> GAP ->
    Flatten -> Gemm, and a Concat reading the stem, which fixes the order of the stem's channels, so
    of the residual stream's. The project conv reads large weights of one sign from its first 16
    channels and of the other sign from the rest: in the given order neighbours saturate, paired
    k with k + 16 none does."""
    e = 2 * c
    w_exp = rng.standard_normal((e, c, 1, 1)).astype(np.float32) * 0.2
    w_proj = rng.standard_normal((c, e, 1, 1)).astype(np.float32) * 0.05
    w_proj[:, :e // 2] += 0.8
    w_proj[:, e // 2:] -= 0.8
    nodes = [helper.make_node("Conv", ["x", "ws", "bs"], ["s"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["s"], ["s_r"]),
             helper.make_node("Conv", ["s_r", "we", "be"], ["e"]),
             helper.make_node("Relu", ["e"], ["e_r"]),
             helper.make_node("Conv", ["e_r", "wd", "bd"], ["d"], group=e, pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["d", "lo", "hi"], ["d_r"]),
             helper.make_node("Mul", ["d_r", "per_ch"], ["d_m"]),
             helper.make_node("Conv", ["d_m", "wp"], ["p"]),
             helper.make_node("Add", ["p", "s_r"], ["res"]),
             helper.make_node("Relu", ["res"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1)]
    if concat:
        nodes += [helper.make_node("Conv", ["s_r", "wc"], ["cc"]),
                  helper.make_node("Concat", ["cc", "s_r"], ["cat"], axis=1),
                  helper.make_node("Conv", ["cat", "wk"], ["y2"])]
    inits = [weight(rng, "ws", c, 3, 3, 3), weight(rng, "bs", c, scale=0.1), init("we", w_exp),
             weight(rng, "be", e, scale=0.1), weight(rng, "wd", e, 1, 3, 3), weight(rng, "bd", e, scale=0.1),
             init("lo", 0.0), init("hi", 6.0), init("per_ch", rng.uniform(0.5, 2, (e, 1, 1))), init("wp", w_proj),
             weight(rng, "wf", 5, c), weight(rng, "bf", 5, scale=0.1), weight(rng, "wc", 4, c, 1, 1),
             weight(rng, "wk", 6, 4 + c, 1, 1)]
    if not concat:
        inits = inits[:-2]
    outputs = [("y", ["N", 5])] + ([("y2", ["N", 6, 8, 8])] if concat else [])
    return make_model(nodes, inits, [("x", ["N", 3, 8, 8])], outputs)


def test_reordering_keeps_the_function_and_removes_saturating_pairs():
    rng = np.random.default_rng(0)
    m = _net(rng)
    ctx = FuseContext()
    from onnx import ModelProto
    after = ModelProto()
    after.CopyFrom(m)
    assert pair_channels.run(after, ctx)
    assert_same_function(m, after, {"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)})
    assert _cost(m, "p") > 1e5 and _cost(after, "p") == 0.0
    # the expand conv's outputs, the depthwise conv, the per-channel Mul and the project conv's inputs
    # follow the new order; everything on the residual stream keeps the order the Concat fixes
    assert all(_reordered(m, after, t, k) for t, k in (("p", 1), ("e", 1), ("e", 2), ("d", 1), ("d", 2), ("d_m", 1)))
    assert not any(_reordered(m, after, t) for t in ("s", "y", "y2", "cc"))
    assert len(ctx.messages) == ctx.counts["pair_channels"] >= 1
    again = FuseContext()
    assert not pair_channels.run(after, again)  # idempotent: the order it chose is kept


def test_fuse_model_runs_it_once_at_the_end():
    rng = np.random.default_rng(1)
    m = _net(rng)
    r = fuse_model(m)
    assert r.counts.get("pair_channels", 0) >= 1
    assert_same_function(m, r.model, {"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)})


def test_greedy_pairing_finds_the_free_pairing():
    # channels 0..5: the only cheap pairs are (0, 3), (1, 4), (2, 5)
    c = np.full((6, 6), 10.0)
    for i, j in ((0, 3), (1, 4), (2, 5)):
        c[i, j] = c[j, i] = 0.0
    order = greedy_pairing(c)
    assert sorted(order.tolist()) == list(range(6)) and pairs_cost(c, order) == 0.0
    odd = greedy_pairing(np.ones((5, 5)))
    assert sorted(odd.tolist()) == list(range(5))


def test_cost_counts_only_same_sign_pairs_past_the_limit():
    w = np.array([[127.0, 10.0, -127.0, 2.0]])  # one output channel, max 127: steps of 1
    c = pair_cost_matrix([(w, 1)])
    assert c[0, 1] == (127 + 10 - 128) ** 2 and c[1, 0] == c[0, 1]
    assert c[0, 2] == 0.0 and c[0, 3] == (127 + 2 - 128) ** 2 and c[1, 3] == 0.0
    assert c[2, 0] == 0.0 and c[2, 3] == 0.0


def test_a_residual_stream_is_reordered_as_one():
    """Without the Concat, the stem, the project conv (both writing the stream through the Add), the
    expand conv and the classifier (reading it through Relu, pooling and Flatten) share one order."""
    rng = np.random.default_rng(2)
    m = _net(rng, concat=False)
    w = next(t for t in m.graph.initializer if t.name == "wf")
    from onnx import numpy_helper
    wf = numpy_helper.to_array(w).copy()
    wf[:, :8], wf[:, 8:] = 1.0, -1.0  # classifier: large same-sign weights on neighbouring stream channels
    w.CopyFrom(numpy_helper.from_array(wf, "wf"))
    ctx = FuseContext()
    from onnx import ModelProto
    after = ModelProto()
    after.CopyFrom(m)
    assert pair_channels.run(after, ctx)
    assert_same_function(m, after, {"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)})
    assert all(_reordered(m, after, t) for t in ("s", "p", "e", "y"))


def _reader_sets(rng):
    """Reader weights as pairing meets them: Conv [Cout, C, k, k] read on axis 1, Gemm [C, N] on 0;
    ties (weights on a coarse grid), channels of zeros, outlier channels whose runs of charged
    weights pass numpy's 8- and 128-value pairwise-sum thresholds."""
    for t in range(24):
        c = int(rng.integers(2, 90))
        readers = []
        for _ in range(int(rng.integers(1, 4))):
            if t % 4 == 3:
                w = rng.standard_normal((c, int(rng.integers(1, 30))))
                axis = 0
            else:
                k = int(rng.choice([1, 3]))
                w = rng.standard_normal((int(rng.integers(1, 300 if t % 3 == 0 else 40)), c, k, k))
                axis = 1
            if t % 2:
                w = np.round(w * 3) / 3
            if t % 5 == 0:
                np.moveaxis(w, axis, 0)[0] = 0.0
            if t % 3 == 0:
                np.moveaxis(w, axis, 0)[: min(3, c)] *= 5.0
            readers.append((w, axis))
        yield readers, int(rng.choice([1, 7, 64, 129, 4096]))
    for rows in (700, 3000):  # one column's run past 128 (halves of halves) and past a block of 4096
        w = rng.standard_normal((rows, 24))
        w[:, :4] *= 8.0
        yield [(w, 1)], 4096


def test_native_cost_matrix_is_the_reference_bit_for_bit_on_every_isa():
    """The C loop against the numpy reference (np.add.reduceat's float32 sums: a run's first row plus
    numpy's pairwise sum of the others), on every thread count: pairing decisions depend on ties."""
    if pair_channels._native is None:
        import pytest
        pytest.skip("the native cost matrix is not built")
    rng = np.random.default_rng(7)
    native = pair_channels._native
    for readers, block in _reader_sets(rng):
        ref = pair_cost_matrix(readers, block, native=False)
        for isa, threads in (("avx512", 1), ("avx512", 3), ("avx2", 1), ("avx2", 3), ("scalar", 1)):
            pair_channels.THREADS = threads
            prev = native.set_isa(isa)  # (capped at what this CPU has: the paths below it run too)
            try:
                got = pair_cost_matrix(readers, block, native=True)
            finally:
                pair_channels.THREADS = None
                native.set_isa(prev)
            assert got.dtype == ref.dtype and np.array_equal(got, ref), \
                (block, isa, threads, [w.shape for w, _ in readers], np.argwhere(got != ref)[:4])


def test_steps_are_each_output_channels_weights_over_its_max_over_127():
    """The weights in steps, in float64 then float32 (pairing's costs, and so its decisions, depend on
    every bit): the formula written out, on weights of each dtype, a channel of zeros included."""
    rng = np.random.default_rng(5)
    for shape, axis in (((12, 6, 3, 3), 1), ((20, 9), 0), ((9, 20), 1)):
        for dtype in (np.float32, np.float16, np.float64):
            w = (rng.standard_normal(shape) * 0.1).astype(dtype)
            np.moveaxis(w, axis, -1)[0] = 0
            rows = np.moveaxis(w.astype(np.float64), axis, -1)
            s = np.abs(rows).reshape(len(rows), -1).max(axis=1) / 127
            want = (rows / np.where(s > 0, s, 1.0).reshape((-1,) + (1,) * (rows.ndim - 1))).reshape(-1, shape[axis])
            assert np.array_equal(pair_channels._steps(w, axis), want.astype(np.float32))
