"""A deep, narrow test model: thousands of nodes in one chain, as real exporters' deep graphs are.

x [N, C, H, W] -> blocks -> residual Add -> Transpose -> Reshape -> y [N, H*W*C]

A block is a 1x1 Conv followed by Relu (2 nodes) or by hard-swish written as PyTorch and
Paddle export it, Add(3) -> Clip(0, 6) -> Mul(x, .) -> Div(6) (5 nodes); every `residual_every`
blocks, and once more before the tail, a residual Add joins the chain to its value two blocks
earlier. Weights (near the identity) are scaled on the spot by a numpy forward pass over the same
seeded inputs, so every Conv output has unit spread: values stay finite however deep the chain is.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

OPSET = 13


def _hardswish(x):
    return x * np.clip(x + 3.0, 0.0, 6.0) / 6.0


def _conv1x1(rng, x, c):
    """W, b of a 1x1 conv scaled so that its output on `x` has unit standard deviation."""
    w = 0.2 * rng.standard_normal((c, c)) / np.sqrt(c) + np.eye(c)
    b = rng.normal(0.0, 0.1, c)
    y = np.einsum("oc,nchw->nohw", w, x) + b[None, :, None, None]
    s = 1.0 / max(float(y.std()), 1e-3)
    return (w * s).astype(np.float32), (b * s).astype(np.float32)


def sample_inputs(n: int, c: int = 8, hw: int = 4, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, c, hw, hw)).astype(np.float32)


def deep_chain(min_nodes: int = 3000, c: int = 8, hw: int = 4, residual_every: int = 50, seed: int = 0):
    """The model (opset 13, batch dynamic) with at least `min_nodes` nodes, blocks alternating
    Relu and hard-swish, and the names of its Conv nodes in chain order."""
    rng = np.random.default_rng(seed)
    x = sample_inputs(4, c, hw, seed + 1).astype(np.float64)
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
              (("three", 3.0), ("zero", 0.0), ("six", 6.0))]
    nodes, inits, convs = [], list(consts), []
    cur, inputs = "x", []  # inputs: (tensor, value) entering each block
    k = 0
    while len(nodes) < min_nodes - 3:
        inputs.append((cur, x))
        w, b = _conv1x1(rng, x, c)
        inits += [numpy_helper.from_array(w.reshape(c, c, 1, 1), f"w{k}"), numpy_helper.from_array(b, f"b{k}")]
        name = f"block{k}"
        t = f"{name}_conv"
        nodes.append(helper.make_node("Conv", [cur, f"w{k}", f"b{k}"], [t], name=f"{name}/Conv", kernel_shape=[1, 1]))
        convs.append(f"{name}/Conv")
        y = np.einsum("oc,nchw->nohw", w.astype(np.float64), x) + b[None, :, None, None]
        if k % 2 == 0:
            nodes.append(helper.make_node("Relu", [t], [f"{name}_out"], name=f"{name}/Relu"))
            y = np.maximum(y, 0.0)
        else:
            nodes += [helper.make_node("Add", [t, "three"], [f"{name}_p3"], name=f"{name}/hs_add"),
                      helper.make_node("Clip", [f"{name}_p3", "zero", "six"], [f"{name}_gate"], name=f"{name}/hs_clip"),
                      helper.make_node("Mul", [t, f"{name}_gate"], [f"{name}_prod"], name=f"{name}/hs_mul"),
                      helper.make_node("Div", [f"{name}_prod", "six"], [f"{name}_out"], name=f"{name}/hs_div")]
            y = _hardswish(y)
        cur = f"{name}_out"
        if k % residual_every == residual_every - 1:
            nodes.append(helper.make_node("Add", [cur, inputs[-2][0]], [f"{name}_res"], name=f"{name}/residual"))
            y, cur = y + inputs[-2][1], f"{name}_res"
        x, k = y, k + 1
    nodes += [helper.make_node("Add", [cur, inputs[-2][0]], ["tail_res"], name="tail/residual"),
              helper.make_node("Transpose", ["tail_res"], ["nhwc"], name="tail/Transpose", perm=[0, 2, 3, 1]),
              helper.make_node("Reshape", ["nhwc", "flat_shape"], ["y"], name="tail/Reshape")]
    inits.append(numpy_helper.from_array(np.array([0, -1], np.int64), "flat_shape"))
    g = helper.make_graph(nodes, "deep_chain",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", hw * hw * c])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 8
    return m, convs
