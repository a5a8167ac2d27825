#!/usr/bin/env python3
"""Graph cleaning on long chains: seconds of `qtool inspect` (load, fuse, plan) and of the fuse passes
alone (clean), on chains of N nodes, so that a pass quadratic in the graph shows as a figure, not as a
timed unit test.

Two chains, each a repeated block on a [1, 2, 4, 4] tensor:
  identity: Relu -> Identity -> Dropout (remove_identity: two of every three nodes go)
  mixed:    Conv 1x1 -> BatchNormalization -> Identity -> Mul(c) -> Add(d) -> Pad(0) -> Conv 1x1 -> Relu
            -> Dropout (remove_identity, fold_batchnorm, fold_mul_add, fold_pad: 6 of 9 nodes go)

  python benchmarks/bench_graph_passes.py [--nodes 3000 10000 100000] [--kind identity mixed]

A chain past qtool's node limit (1,000,000, modelio.MAX_NODES) is refused in one line by load_model:
that refusal is timed too.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

C = 2


def chain(n_nodes: int, kind: str) -> onnx.ModelProto:
    """An opset-13 model of about `n_nodes` nodes in one chain."""
    nodes, inits = [], []
    cur, k = "x", 0
    one = lambda name, v: inits.append(numpy_helper.from_array(np.asarray(v, np.float32), name))
    if kind == "mixed":
        w = np.eye(C, dtype=np.float32).reshape(C, C, 1, 1)
        one("w", w)
        one("b", np.zeros(C))
        one("g", np.ones(C))
        one("beta", np.zeros(C))
        one("mean", np.zeros(C))
        one("var", np.ones(C))
        one("c", np.full((1, C, 1, 1), 1.0))
        one("d", np.zeros((1, C, 1, 1)))
        inits.append(numpy_helper.from_array(np.array([0, 0, 0, 0, 0, 0, 0, 0], np.int64), "pads"))
    while len(nodes) < n_nodes:
        p = f"b{k}_"
        if kind == "identity":
            nodes += [helper.make_node("Relu", [cur], [p + "r"], name=p + "relu"),
                      helper.make_node("Identity", [p + "r"], [p + "i"], name=p + "id"),
                      helper.make_node("Dropout", [p + "i"], [p + "o"], name=p + "drop")]
        else:
            nodes += [helper.make_node("Conv", [cur, "w", "b"], [p + "c"], name=p + "conv"),
                      helper.make_node("BatchNormalization", [p + "c", "g", "beta", "mean", "var"], [p + "bn"],
                                       name=p + "bn"),
                      helper.make_node("Identity", [p + "bn"], [p + "i"], name=p + "id"),
                      helper.make_node("Mul", [p + "i", "c"], [p + "m"], name=p + "mul"),
                      helper.make_node("Add", [p + "m", "d"], [p + "a"], name=p + "add"),
                      helper.make_node("Pad", [p + "a", "pads"], [p + "p"], name=p + "pad"),
                      helper.make_node("Conv", [p + "p", "w", "b"], [p + "c2"], name=p + "conv2"),
                      helper.make_node("Relu", [p + "c2"], [p + "r"], name=p + "relu"),
                      helper.make_node("Dropout", [p + "r"], [p + "o"], name=p + "drop")]
        cur, k = p + "o", k + 1
    g = helper.make_graph(nodes, f"{kind}_chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, 4, 4])],
                          [helper.make_tensor_value_info(cur, TensorProto.FLOAT, [1, C, 4, 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[3000, 10000, 100000])
    ap.add_argument("--kind", nargs="+", default=["identity", "mixed"], choices=["identity", "mixed"])
    args = ap.parse_args(argv)
    from qtool.errors import QtoolError
    from qtool.fuse import fuse_model
    from qtool.inspect import inspect_model
    from qtool.modelio import load_model
    print(f"{'chain':>9} {'nodes':>9} {'clean s':>8} {'inspect s':>10}  after")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kind:
            for n in args.nodes:
                m = chain(n, kind)
                count = len(m.graph.node)
                path = os.path.join(tmp, f"{kind}{n}.onnx")
                onnx.save(m, path)
                t0 = time.perf_counter()
                try:
                    fused = fuse_model(load_model(path), inplace=True).model
                    clean, after = time.perf_counter() - t0, f"{len(fused.graph.node)} nodes"
                except QtoolError as e:
                    clean, after = time.perf_counter() - t0, f"refused: {e}"
                del m
                t0 = time.perf_counter()
                try:
                    inspect_model(path, [], {})
                except QtoolError:
                    pass
                print(f"{kind:>9} {count:>9} {clean:>8.2f} "
                      f"{time.perf_counter() - t0:>10.2f}  {after}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
