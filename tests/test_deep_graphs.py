"""Graphs thousands of nodes deep (issue 14): every step works, and every graph walk is exact at any depth.

The chain (tests/deep_chain.py) has 3002 nodes: 852 1x1 Conv blocks with Relu or hard-swish, 18 residual
Adds (the last in the tail) and a Transpose/Reshape tail. Nothing is compared with ONNX Runtime's int8
output (not exact on CPUs without VNNI): the native runtime is compared with its numpy reference, bit for
bit, and the sensitivity pass's one-layer models with fp32.
"""
from __future__ import annotations

import functools
import json
import os
import random
import time
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import deep_chain
from qtool import cli
from qtool import graph as G
from qtool.errors import QtoolError
from qtool.quantize.qdq import BuildOptions

DEPTH = 3000
STEP_SECONDS = {}  # step -> seconds, printed at the end of the module (pytest -s shows it)


def qtool(*args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cli.main([str(a) for a in args])
        except SystemExit as e:
            return e.code
    return 0


def timed(step, fn, *args):
    t0 = time.perf_counter()
    r = fn(*args)
    STEP_SECONDS[step] = time.perf_counter() - t0
    return r


@pytest.fixture(scope="module", autouse=True)
def _print_timings():
    yield
    if STEP_SECONDS:
        print("\ndeep chain step times: " + ", ".join(f"{k} {v:.1f}s" for k, v in STEP_SECONDS.items()))


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """(folder, model path, Conv names in chain order) with four .npy samples in folder/data."""
    root = tmp_path_factory.mktemp("deep")
    model, convs = deep_chain.deep_chain(DEPTH)
    assert len(model.graph.node) >= DEPTH
    path = str(root / "chain.onnx")
    onnx.save(model, path)
    os.makedirs(root / "data")
    for k, x in enumerate(deep_chain.sample_inputs(4)):
        np.save(root / "data" / f"s{k}.npy", x[None])
    return root, path, convs


@pytest.fixture(scope="module")
def calibrated(chain):
    root, path, convs = chain
    work = root / "work"
    assert timed("calibrate", qtool, "calibrate", "--model", path, "--data", root / "data", "-w", work, "-q") == 0
    from qtool.quantize.inputs import load_inputs
    from qtool.workdir import Workdir
    from qtool.quantize.sensitivity import quantizable_layers
    inp = load_inputs(Workdir(str(work)))
    fused, table = inp.fused, inp.table
    layers = [d.name for d in quantizable_layers(fused)]  # a plan of the whole chain, made once
    return work, fused, table, layers


# --- every step on the 3000-node chain ----------------------------------------------------------------------

def test_inspect_plans_every_layer(chain, capsys):
    _, path, convs = chain
    residuals = sum(n.name.endswith("/residual") for n in onnx.load(path).graph.node)
    capsys.readouterr()
    assert timed("inspect", qtool, "inspect", path) == 0
    out = capsys.readouterr().out
    assert f"plan: {len(convs) + residuals} ops int8, 2 pass int8 through" in out  # + the tail's Transpose, Reshape


def test_default_quantize_with_sensitivity_then_native_matches_reference(chain, calibrated, monkeypatch, capsys):
    """The default `qtool quantize` (sensitivity on, 2 samples) on the deep chain. Each layer measured
    builds and loads a 3000-node model (about 1 s here), so the sensitivity pass measures a sample of
    layers: the first (3000 fp32 nodes after it, where the old recursion broke), one in the middle and
    the last; all the other layers stay fp32 in each measurement, as in the full pass."""
    import qtool.quantize.steps.sensitivity as run
    from qtool.quantize import sensitivity
    from qtool.runtime import NativeSession

    root, path, convs = chain
    work, _, _, names = calibrated
    sample = [names[0], names[len(names) // 2], names[-1]]
    monkeypatch.setattr(run, "layer_sensitivity", functools.partial(sensitivity.layer_sensitivity, only=sample))
    capsys.readouterr()
    assert timed("quantize (sensitivity on 3 layers)", qtool, "quantize", "-w", work, "--sensitivity-samples", 2,
                 "-q") == 0, capsys.readouterr().err
    sens = json.load(open(work / "sensitivity.json"))
    assert [l["name"] for l in sens["layers"]] == sample and sens["meta"]["samples"] == 2
    # one int8 layer in an fp32 chain stays near fp32 (the chain's heavy-tailed activations, up to 15
    # standard deviations, cost the tail's Add most: 11.6 dB); a misplaced Q/DQ pair gives about 0 dB
    assert all(l["output_sqnr_db"] > 8 for l in sens["layers"]), sens["layers"]

    int8 = str(work / "model.int8.onnx")
    x = deep_chain.sample_inputs(2, seed=7)
    native = timed("native runtime load", NativeSession, int8, 1)
    y = timed("native runtime run (batch 2)", native.run, None, {"x": x})[0]
    ref = NativeSession(int8, threads=1, backend="reference").run(None, {"x": x})[0]
    assert native.backend == "native"
    assert y.shape == (2, 128) and np.isfinite(y).all()
    np.testing.assert_array_equal(y, ref)


# --- the sensitivity pass's exclusion pattern: Q/DQ placement against brute force -----------------------------

def _brute_force_qdq(fused, int8_layers: set) -> set:
    """The activation tensors that get a Q/DQ pair when only `int8_layers` run int8, from plan.py's
    rules applied by hand to the chain: every activation input of an int8 layer is quantized; a
    Relu that alone reads a Conv is fused into the Conv's output quantizer, which therefore stays;
    any other output of an int8 layer is quantized only if some int8 node can be reached from it,
    found by following every path downstream; a Transpose/Reshape reading an int8 tensor passes it
    on in int8 (its output, unless a graph output, is quantized with the same parameters)."""
    consumers, outputs = G.consumers(fused), G.graph_output_names(fused)
    inits = G.initializers(fused)
    int8_nodes, int8_tensors, droppable = set(int8_layers), set(), set()
    for n in fused.graph.node:  # graph order is topological
        if n.op_type in ("Transpose", "Reshape") and n.input[0] in int8_tensors:
            int8_nodes.add(n.name)
            int8_tensors.update(o for o in n.output if o not in outputs)
        if n.name in int8_layers:
            int8_tensors.update(i for i in n.input if i not in inits)
            readers = consumers.get(n.output[0], [])
            if n.op_type == "Conv" and len(readers) == 1 and readers[0].op_type == "Relu":
                int8_tensors.add(readers[0].output[0])
            else:
                int8_tensors.add(n.output[0])
                droppable.add(n.output[0])

    def reaches_int8(t):
        stack, seen = [t], set()
        while stack:
            for c in consumers.get(stack.pop(), []):
                if c.name in int8_nodes:
                    return True
                for o in c.output:
                    if o not in seen:
                        seen.add(o)
                        stack.append(o)
        return False

    return {t for t in int8_tensors if t not in droppable or reaches_int8(t)}


def _qdq_tensors(model) -> set:
    inits = G.initializers(model)
    return {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in inits}


def _alone(names, keep):
    return {n: "sensitivity: only one layer int8" for n in names if n not in keep}


@pytest.mark.parametrize("where", ["first", "hard-swish", "middle", "last conv", "tail residual"])
def test_one_int8_layer_qdq_placement_matches_brute_force(calibrated, where):
    """Sensitivity's pattern: one layer int8, every other fp32 (prune_excluded=False, as the pass runs it)."""
    from qtool.quantize.qdq import quantize_graph
    _, fused, table, names = calibrated
    pick = {"first": names[0], "hard-swish": "block1/Conv", "middle": names[len(names) // 2],
            "last conv": [n for n in names if n.endswith("/Conv")][-1], "tail residual": "tail/residual"}[where]
    q = quantize_graph(fused, table, BuildOptions(method=None, exclude=_alone(names, {pick}), prune_excluded=False))
    want = _brute_force_qdq(fused, {pick})
    assert _qdq_tensors(q.model) == want
    assert want  # the layer's own input at least
    if where == "tail residual":  # the tail's Transpose and Reshape pass its output on in int8
        assert want == {"tail_res", "nhwc"} | set(next(n for n in fused.graph.node if n.name == pick).input)


def test_int8_layers_3000_nodes_apart_keep_the_quantizer_between(calibrated):
    """The second Conv (hard-swish after it, so its output pair is not a fused Relu) and the tail's Add
    int8, everything between fp32: the Conv's output is read, nearly 3000 nodes later, by an int8 op, so
    its Q/DQ pair stays (the old walk gave up after 200 nodes and dropped it, when it did not overflow
    the stack first)."""
    from qtool.quantize.qdq import quantize_graph
    _, fused, table, names = calibrated
    both = {"block1/Conv", "tail/residual"}
    q = quantize_graph(fused, table, BuildOptions(method=None, exclude=_alone(names, both), prune_excluded=False))
    want = _brute_force_qdq(fused, both)
    assert _qdq_tensors(q.model) == want
    assert "block1_conv" in want


# --- the graph walks themselves ------------------------------------------------------------------------------

def _chain_nodes(n):
    return [helper.make_node("Relu", [f"t{k}"], [f"t{k + 1}"], name=f"n{k}") for k in range(n)]


def _graph_model(nodes, inputs=("t0",), outputs=None):
    outputs = outputs or [nodes[-1].output[0]]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(i, TensorProto.FLOAT, [1]) for i in inputs],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1]) for o in outputs])
    return helper.make_model(g)


def test_topological_order_of_a_reversed_20000_node_chain():
    nodes = _chain_nodes(20000)
    assert [n.name for n in G.topological_order(_graph_model(list(reversed(nodes))))] == [n.name for n in nodes]


def test_topological_order_keeps_a_sorted_graph_as_it_is():
    m = deep_chain.deep_chain(600)[0]
    assert [n.name for n in G.topological_order(m)] == [n.name for n in m.graph.node]


def test_topological_order_waits_for_tensors_a_subgraph_reads():
    """An If whose branch reads an outer tensor by name runs after that tensor's producer."""
    branch = helper.make_graph([helper.make_node("Identity", ["late"], ["b"])], "then", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])])
    nested = helper.make_graph([helper.make_node("If", ["c"], ["b2"], then_branch=branch, else_branch=branch)],
                               "outer_then", [], [helper.make_tensor_value_info("b2", TensorProto.FLOAT, [1])])
    nodes = [helper.make_node("If", ["c"], ["y"], name="if", then_branch=nested, else_branch=nested),
             helper.make_node("Relu", ["x"], ["late"], name="producer")]
    m = _graph_model(nodes, inputs=("x", "c"), outputs=["y"])
    assert [n.name for n in G.topological_order(m)] == ["producer", "if"]


def test_topological_order_names_a_cycle():
    nodes = [helper.make_node("Relu", ["b"], ["a"], name="p"), helper.make_node("Relu", ["a"], ["b"], name="q")]
    with pytest.raises(QtoolError, match="cycle"):
        G.topological_order(_graph_model(nodes, inputs=("x",), outputs=["a"]))


def test_tensors_reaching_agrees_with_every_path_on_random_dags():
    rng = random.Random(3)
    for _ in range(20):
        n = 300
        nodes = []
        for k in range(n):
            srcs = {"x"} | {f"v{rng.randrange(k)}" for _ in range(rng.randint(1, 3)) if k}
            nodes.append(helper.make_node("Sum", sorted(srcs), [f"v{k}"], name=f"n{k}"))
        m = _graph_model(nodes, inputs=("x",), outputs=[f"v{n - 1}"])
        targets = {f"n{k}" for k in rng.sample(range(n), 3)}
        readers = G.consumers(m)

        def reaches(t):  # every path, explicitly
            stack, seen = [t], {t}
            while stack:
                for c in readers.get(stack.pop(), []):
                    if c.name in targets:
                        return True
                    if c.output[0] not in seen:
                        seen.add(c.output[0])
                        stack.append(c.output[0])
            return False

        tensors = {"x"} | {f"v{k}" for k in range(n)}
        assert G.tensors_reaching(m, targets) == {t for t in tensors if reaches(t)}


def test_tensors_reaching_is_exact_far_past_200_nodes():
    nodes = _chain_nodes(5000)
    assert G.tensors_reaching(_graph_model(nodes), {"n4999"}) == {f"t{k}" for k in range(5000)}


# --- subgraphs nested deep: protobuf's parser has a limit, qtool says so ------------------------------------

def _varint(n):
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num, payload):
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _nested_if_model(depth) -> bytes:
    """If nodes nested `depth` deep, the innermost body reading the outer input x; encoded by hand,
    since the protobuf library refuses to build what it cannot parse."""
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"])], "leaf", [],
                          [helper.make_tensor_value_info("r", TensorProto.FLOAT, [2])]).SerializeToString()
    for _ in range(depth):  # GraphProto.node(1) -> NodeProto.attribute(5) -> AttributeProto.g(6)
        attr = _field(1, b"then_branch") + _varint(20 << 3) + _varint(onnx.AttributeProto.GRAPH) + _field(6, g)
        g = _field(1, _field(1, b"c") + _field(2, b"r") + _field(4, b"If") + _field(5, attr)) + _field(2, b"g")
    top = helper.make_graph([], "top", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                                        helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                            [helper.make_tensor_value_info("r", TensorProto.FLOAT, [2])]).SerializeToString()
    model = helper.make_model(helper.make_graph([], "t", [], []), opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    # a message field written twice merges: the graph gets top's inputs and outputs, then the nested If
    return model.SerializeToString() + _field(7, top + g)


def test_nested_subgraphs_read_outer_tensors_at_any_nesting():
    m = onnx.load_from_string(_nested_if_model(12))
    assert G.node_reads(m.graph.node[0]) == {"c", "x"}


def test_subgraphs_nested_past_protobufs_limit_are_one_line(tmp_path, capsys):
    (tmp_path / "nested.onnx").write_bytes(_nested_if_model(40))
    assert qtool("inspect", tmp_path / "nested.onnx") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nested.onnx" in err and "nested deeper than protobuf" in err
