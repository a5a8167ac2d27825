"""Graph passes linear in the graph (issue 51, case 2): a pass renames the readers of every node it removes
in one walk and keeps its indexes up to date as it goes, instead of a walk (or an index made again) per
node; the results stay those of removing nodes one at a time. The seconds are benchmarks/bench_graph_passes.py's:
here the walks are counted."""
from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import make_model
from qtool import graph as G
from qtool.errors import QtoolError
from qtool.fuse import FuseContext, fold_batchnorm, fold_mul_add, fold_pad, fuse_model, remove_identity

sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "benchmarks"))
from bench_graph_passes import chain  # noqa: E402


def _calls(monkeypatch, *names) -> dict:
    """Count the calls of graph.<name> for each name, wherever a pass calls it."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(G, name)

        def counted(*a, _real=real, _name=name, **k):
            counts[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(G, name, counted)
    return counts


def test_remove_identity_renames_in_one_walk(monkeypatch):
    m = chain(600, "identity")  # 200 Relu, each followed by an Identity and a Dropout
    walks = _calls(monkeypatch, "_rename_reads", "consumers", "producers")
    assert remove_identity.run(m, FuseContext())
    assert [n.op_type for n in m.graph.node] == ["Relu"] * 200
    assert walks == {"_rename_reads": 1, "consumers": 0, "producers": 1}, walks  # (was 400 walks)
    assert [n.input[0] for n in m.graph.node] == ["x"] + [f"b{k}_r" for k in range(199)]


def test_fold_passes_make_their_indexes_once(monkeypatch):
    m = chain(900, "mixed")  # 100 blocks of Conv, BatchNormalization, Identity, Mul, Add, Pad, Conv, Relu, Dropout
    walks = _calls(monkeypatch, "consumers", "producers", "initializers", "taken_names")
    ctx = FuseContext()
    for p in (remove_identity, fold_batchnorm, fold_mul_add, fold_pad):
        assert p.run(m, ctx)
    assert ctx.counts == {"remove_identity": 200, "fold_batchnorm": 100, "fold_mul_add": 200, "fold_pad": 100}
    assert sum(walks.values()) <= 12, walks  # (a fold made them again: 600 index builds, 600 name scans)
    # (the names the folds chose are the ones naming one at a time gave: w_folded, w_folded_1, ...)
    assert [list(m.graph.node[k].input[1:]) for k in (0, 3, -3)] == [
        ["w_folded_folded_folded", "b_bias_folded_bias_folded_bias_folded"],
        ["w_folded_1_folded_folded", "b_bias_folded_1_bias_folded_bias_folded"],
        ["w_folded_99_folded_folded", "b_bias_folded_99_bias_folded_bias_folded"]]
    assert [n.op_type for n in m.graph.node[:3]] == ["Conv", "Conv", "Relu"]


def test_unique_name_finds_the_same_names_in_one_step_each():
    m = make_model([helper.make_node("Relu", ["x"], ["w_2"])], [], [("x", [1])], [("w_2", [1])])
    taken = G.taken_names(m)
    assert [G.unique_name(m, "w", taken) for _ in range(4)] == ["w", "w_1", "w_3", "w_4"]
    assert [G.unique_name(m, "w") for _ in range(2)] == ["w", "w"]  # (no `taken`: the model's names each time)


def _if(cond, then_nodes, then_out, else_out, name, direct):
    """If(cond) whose then branch runs `then_nodes` and returns `then_out`, whose else branch returns the
    outer tensor `else_out`: itself (`direct`; ONNX Runtime refuses it, the checker lets it pass), or a copy."""
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [2])
    then_g = helper.make_graph(then_nodes, name + "_then", [], [vi(then_out)])
    else_g = helper.make_graph([], name + "_else", [], [vi(else_out)]) if direct else helper.make_graph(
        [helper.make_node("Identity", [else_out], [name + "_copy"])], name + "_else", [], [vi(name + "_copy")])
    return helper.make_node("If", [cond], [name + "_y"], name=name, then_branch=then_g, else_branch=else_g)


def _one_at_a_time(model):
    """remove_identity as it was: each node removed and its readers renamed before the next is looked at."""
    out = G.graph_output_names(model)
    for node in list(model.graph.node):
        if node.op_type not in ("Identity", "Dropout"):
            continue
        x, y = node.input[0], node.output[0]
        if y in out:
            prod = G.producers(model).get(x)
            if prod is None or len(G.consumers(model).get(x, [])) != 1 or x in out:
                continue
            prod.output[list(prod.output).index(x)] = y
        else:
            G.rewire(model, y, x)
        model.graph.node.remove(node)


def _branchy(direct=True):
    """Identity chains read by If branches by name, a branch whose own tensor hides an outer name, a branch
    returning an outer tensor, and graph outputs written through an Identity. `direct`: False for ONNX
    Runtime, which takes neither a branch returning an outer tensor nor one hiding an outer name."""
    n = helper.make_node
    own = "i3" if direct else "own"
    nodes = [n("Relu", ["x"], ["a"], name="relu"),
             n("Identity", ["a"], ["i1"], name="id1"),
             n("Identity", ["i1"], ["i2"], name="id2"),
             n("Dropout", ["i2"], ["i3"], name="drop"),
             _if("c", [n("Neg", ["i3"], ["t1"], name="neg_outer"), n("Add", ["t1", "i1"], ["t2"], name="add_outer")],
                 "t2", "i2", "if1", direct),
             # the then branch writes its own i3: its Neg reads that one, not the outer
             _if("c", [n("Abs", ["x"], [own], name="own_i3"), n("Neg", [own], ["t3"], name="neg_own")],
                 "t3", "i3", "if2", direct),
             n("Add", ["if1_y", "if2_y"], ["s"], name="sum"),
             n("Identity", ["s"], ["out"], name="id_out"),
             n("Sigmoid", ["i3"], ["sig"], name="sig"),
             n("Identity", ["sig"], ["out2"], name="id_out2"),
             n("Identity", ["i3"], ["out3"], name="id_out3")]
    vi = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [2])
    g = helper.make_graph(nodes, "branchy", [vi("x"), helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [vi("out"), vi("out2"), vi("out3")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_remove_identity_gives_what_removing_one_at_a_time_gave():
    a, b = _branchy(), _branchy()
    _one_at_a_time(a)
    remove_identity.run(b, FuseContext())
    assert b.SerializeToString() == a.SerializeToString()
    reads = {n.name: list(n.input) for n in b.graph.node}
    assert "id_out3" in reads and "id_out" not in reads  # (a.i3 has other readers: its Identity to out3 stays)
    branches = {g.name: g for n in b.graph.node for g in G._subgraphs(n)}
    assert list(branches["if1_then"].node[0].input) == ["a"] and list(branches["if1_then"].node[1].input) == ["t1", "a"]
    assert branches["if1_else"].output[0].name == "a"
    assert list(branches["if2_then"].node[1].input) == ["i3"]  # (its own i3, not renamed)
    assert branches["if2_else"].output[0].name == "a"
    import onnxruntime as ort
    before, after = _branchy(direct=False), _branchy(direct=False)
    remove_identity.run(after, FuseContext())
    assert len(after.graph.node) == len(before.graph.node) - 5
    for c in (True, False):
        x = {"x": np.array([-1.0, 2.0], np.float32), "c": np.array(c)}
        want, got = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)
                     for m in (before, after))
        assert all(np.array_equal(u, v) for u, v in zip(want, got))


def test_a_graph_of_a_million_nodes_is_refused_in_one_line(tmp_path):
    from qtool.modelio import MAX_INLINED_NODES, load_model
    m = chain(3, "identity")
    relu = m.graph.node[0]
    del m.graph.node[:]
    m.graph.node.extend([relu] * MAX_INLINED_NODES)  # (the same node: refused before any check reads them)
    path = tmp_path / "big.onnx"
    onnx.save(m, path)
    with pytest.raises(QtoolError, match="big.onnx: the graph holds 1,000,000 nodes or more"):
        load_model(str(path))
