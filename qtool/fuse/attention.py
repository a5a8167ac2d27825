"""How a per-channel quantity travels through an attention block, proven on the graph's inferred shapes: a
bias (constant along the token axes) is followed as a small tensor (1 along the axes it
is constant on, the true sizes along the others) through Reshape, Transpose and Mul/Div by a scalar, to the
MatMul that reads it. Used by fuse/fold_attention_bias.py (biases Softmax cancels or passes through).

A Reshape is followed only where ONNX shape inference (with data propagation) shows it keeps the leading
axes (the same dims, known or the same symbol) and splits or merges only axes the tensor varies along.
Every tensor on the way has no reader but the next op (and Shape ops, whose result does not change).
"""
from __future__ import annotations

import numpy as np

from qtool import graph as G

LAYOUT = ("Reshape", "Transpose")
SCALE = ("Mul", "Div")


class Walk:
    """The graph's indexes and inferred shapes, and the steps and checks of a path through an attention."""

    def __init__(self, model):
        self.model = model
        self.inits = G.initializers(model)
        self.prod, self.cons = G.producers(model), G.consumers(model)
        self.outputs = G.graph_output_names(model)
        self.dims = G.inferred_shapes(model, symbols=True)  # ({}: nothing is proven, nothing moves)

    def next_op(self, tensor: str):
        """The one reader of `tensor` that uses its values (Shape readers only use its shape), where it is no
        graph output; else None."""
        readers = [n for n in self.cons.get(tensor, []) if n.op_type != "Shape"]
        return readers[0] if len(readers) == 1 and tensor not in self.outputs else None

    def only_reader(self, tensor: str, node) -> bool:
        return self.next_op(tensor) is node

    def softmax_last(self, node) -> bool:
        """`node` is a Softmax over its output's last axis (of a known rank)."""
        rank = len(self.dims.get(node.output[0]) or [])
        return node.op_type == "Softmax" and rank > 0 and G.attr(node, "axis", -1) in (-1, rank - 1)

    def scalar(self, name: str):
        v = G.const_value(self.model, name, self.inits)
        if v is None or v.size != 1 or not np.issubdtype(v.dtype, np.floating):
            return None
        return float(v.reshape(()))

    def follow(self, node, small: np.ndarray, tensor: str):
        """The bias tensor `small` after `node` (which reads `tensor`), or None where not proven."""
        if node.op_type == "Transpose":
            perm = G.attr(node, "perm")
            perm = list(perm) if perm is not None else list(range(small.ndim))[::-1]
            return small.transpose(perm) if len(perm) == small.ndim else None
        if node.op_type in SCALE:
            if node.input[0] != tensor or (k := self.scalar(node.input[1])) is None or k == 0:
                return None
            return small * k if node.op_type == "Mul" else small / k
        if node.op_type == "Reshape":
            if node.input[0] != tensor:
                return None
            a, b = self.dims.get(tensor), self.dims.get(node.output[0])
            if a is None or b is None or len(a) != small.ndim:
                return None
            p = 0
            while p < min(len(a), len(b)) and a[p] is not None and a[p] == b[p]:
                p += 1
            # below the kept leading axes: only axes the bias varies along, of known sizes, on both sides
            if any(small.shape[k] != a[k] or not isinstance(a[k], int) for k in range(p, len(a))):
                return None
            tail = b[p:]
            if not all(isinstance(d, int) for d in tail) or int(np.prod(tail)) != int(np.prod(small.shape[p:])):
                return None
            return small.reshape(small.shape[:p] + tuple(tail))
        return None

    def to_matmul(self, tensor: str, small: np.ndarray):
        """Follow the bias from `tensor` through layout and scalar ops to the MatMul that reads it:
        (that MatMul, the tensor it reads, the bias there) or None."""
        for _ in range(16):
            node = self.next_op(tensor)
            if node is None:
                return None
            if node.op_type == "MatMul":
                return node, tensor, small
            if node.op_type not in LAYOUT + SCALE:
                return None
            small = self.follow(node, small, tensor)
            if small is None:
                return None
            tensor = node.output[0]
        return None

    def softmax_after(self, matmul):
        """The Softmax over the last axis that the scores of `matmul` reach through [Mul/Div k] [Add], each
        the one reader of the one before; None otherwise."""
        tensor = matmul.output[0]
        for _ in range(4):
            node = self.next_op(tensor)
            if node is None:
                return None
            if node.op_type == "Softmax":
                return node if self.softmax_last(node) else None
            if node.op_type in SCALE and (node.input[0] != tensor or self.scalar(node.input[1]) in (None, 0.0)):
                return None
            if node.op_type not in SCALE + ("Add",):
                return None
            tensor = node.output[0]
        return None

    def projection(self, add):
        """Add(MatMul(X, W), b) with W and b constants, b varying only along the last axis: (matmul, b, rank of
        the output) or None."""
        for k in (0, 1):
            src = self.prod.get(add.input[k])
            b = G.const_value(self.model, add.input[1 - k], self.inits)
            if src is not None and src.op_type == "MatMul" and b is not None:
                break
        else:
            return None
        w = G.const_value(self.model, src.input[1], self.inits)
        dims = self.dims.get(add.output[0])
        if w is None or w.ndim != 2 or not dims or len(dims) < 2 or not np.issubdtype(b.dtype, np.floating):
            return None
        if b.ndim > len(dims) or any(s != 1 for s in b.shape[:-1]) or b.shape[-1] != w.shape[1]:
            return None
        if not self.only_reader(src.output[0], add):
            return None
        return src, b.reshape(-1), len(dims)

