"""Which of a model's outputs are an encoder's vectors, read from its graph; and which input is its mask.

An argmax over an output's last axis means something only where each coordinate is a class. A classifier's
head writes its scores by a projection onto its C classes: the last compute is a MatMul / Gemm / Conv with a
constant weight (a bias Add after it, perhaps a Softmax or Sigmoid), each coordinate one row of that weight.
An encoder's vectors come from something else, and the graph says so:

- token states [N, T, H]: a normalization ends the graph (LayerNormalization, an RMS norm, either written
  out as mean / variance / Sqrt / Div, or x / ||x||): each coordinate is a feature scaled by the whole
  vector's statistics, which no classifier's head ends with;
- a pooled vector [N, H]: such states pooled over the tokens (ReduceMean, a masked ReduceSum divided by
  the count, the first token Gathered or Sliced) with no weight in between, then perhaps normalized to
  length 1, or squashed by a Tanh after one dense layer (BERT's pooler).

Not used, and why: the output's name ("output", "461", "last_hidden_state" and "logits" are exporters'
words, and a renamed graph keeps its meaning); H alone (a head of 384 classes exists); values alone (a
LayerNorm's rows have no fixed length: only vectors of length 1 say what they are by value, and eval reads
that beside this rule); a sibling output's shape (a token classifier writes [N, T, C] logits beside its
states). A projection after the pooling (a sentence encoder's Dense layer, CLIP's text projection) ends
like a classifier's head and is judged as one unless its rows have length 1; a CNN's pooled channels
(GlobalAveragePool, no head) are not taken either, as a fully convolutional classifier (SqueezeNet) ends
the same way with its classes on the channels: `--task encoder` says what the rule cannot see.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from qtool import graph as G

# ops that pass a tensor on unchanged in meaning (a Concat of one input: torch's export of a pooled output)
CARRIERS = ("Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Cast", "Dropout")
NORMALIZATIONS = ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                  "SkipSimplifiedLayerNormalization", "LpNormalization")
POOLING = ("ReduceMean", "ReduceSum", "ReduceMax", "Gather", "Slice")  # over the tokens, or picking one of them
REDUCTIONS = ("ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2")
INDEX_CARRIERS = CARRIERS + ("Add", "Sub", "Expand")  # an id's way to its embedding table (a position offset)
DEPTH = 16  # producers walked back from an output at most


@dataclass(frozen=True)
class EncoderOutput:
    kind: str  # "tokens": one vector per token, [N, T, H]; "pooled": one per sample, [N, H]
    why: str  # what in the graph says so


def encoder_outputs(model: onnx.ModelProto) -> dict:
    """output name -> EncoderOutput, for the outputs the graph shows to be an encoder's vectors."""
    g = _Graph(model)
    found = {}
    for o in model.graph.output:
        e = g.vectors(o.name)
        if e is not None:
            found[o.name] = e
    return found


def encoder_output(model: onnx.ModelProto, tensor: str) -> EncoderOutput | None:
    """What encoder_outputs says of one tensor (an output, or the tensor quantize judges by)."""
    return _Graph(model).vectors(tensor)


def real_tokens(mask, shape: tuple):
    """The attention mask as a bool [N, T] of real tokens where it can say which positions of an output of
    `shape` ([N, T, ...]) are: its size that of the first two axes, every value 0 or 1, a real token in every
    row; else None (every position counts)."""
    if mask is None or len(shape) < 2:
        return None
    m = np.asarray(mask)
    if m.size != shape[0] * shape[1] or not np.isin(m, (0, 1)).all():
        return None
    m = m.reshape(shape[0], shape[1]) != 0
    return m if m.any(1).all() else None


def mask_input(model: onnx.ModelProto) -> str | None:
    """The attention mask among the graph inputs: the one 2-D input that no Gather reads as its indices, in a
    graph where another input is read so. Token, segment and position ids are looked up in embedding tables;
    a mask only weights the attention and the pooling. None where no single input is one."""
    cons = G.consumers(model)
    inputs = [i for i in G.real_inputs(model) if len(G.input_dims(i)) == 2]
    looked_up = {i.name for i in inputs if _indexes_a_table(i.name, cons)}
    masks = [i.name for i in inputs if i.name not in looked_up]
    return masks[0] if looked_up and len(masks) == 1 else None


def _indexes_a_table(name: str, cons: dict) -> bool:
    """Whether `name` reaches a Gather's indices through ops that only carry or shift it."""
    stack, seen = [(name, 0)], set()
    while stack:
        t, depth = stack.pop()
        if t in seen or depth > 4:
            continue
        seen.add(t)
        for n in cons.get(t, ()):
            if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == t:
                return True
            if n.op_type in INDEX_CARRIERS:
                stack.extend((o, depth + 1) for o in n.output if o)
    return False


class _Graph:
    def __init__(self, model: onnx.ModelProto):
        self.prods = G.producers(model)
        self.consts = {t.name for t in model.graph.initializer} | {
            o for n in model.graph.node if n.op_type == "Constant" for o in n.output}

    def _through(self, t: str) -> tuple:
        """(tensor, its producer) past the ops that only carry it."""
        for _ in range(DEPTH):
            n = self.prods.get(t)
            if n is None or not (n.op_type in CARRIERS or (n.op_type == "Concat" and len([i for i in n.input if i]) == 1)):
                return t, n
            t = next(i for i in n.input if i)
        return t, self.prods.get(t)

    def _variable(self, n) -> list:
        return [i for i in n.input if i and i not in self.consts]

    def vectors(self, out: str) -> EncoderOutput | None:
        t, n = self._through(out)
        if n is None:
            return None
        norm = self.normalized(n)
        if norm is not None:
            x, what = norm
            pooled = self.pooled_from(x)
            if pooled:
                return EncoderOutput("pooled", f"{pooled}, then normalized ({what})")
            return EncoderOutput("tokens", f"a normalization writes it ({what}), not a projection onto classes")
        pooled = self.pooled_from(t)
        if pooled:
            return EncoderOutput("pooled", pooled)
        if n.op_type == "Tanh":  # BERT's pooler: tanh(dense(the first token's state))
            dense = self._dense_input(n.input[0])
            pooled = dense and self.pooled_from(dense)
            if pooled:
                return EncoderOutput("pooled", f"a Tanh over a dense layer on {pooled} (a BERT-style pooler)")
        return None

    def _dense_input(self, t: str) -> str | None:
        """The input of a MatMul / Gemm with a constant weight (and a constant bias Add) that writes t."""
        t, n = self._through(t)
        if n is not None and n.op_type == "Add" and len(self._variable(n)) == 1:
            t, n = self._through(self._variable(n)[0])
        if n is not None and n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in self.consts:
            return n.input[0]
        return None

    def normalized(self, n) -> tuple | None:
        """(the tensor normalized, how) where node n writes a normalization of it, else None: a normalization
        op, or one written out: (x - mean) / sqrt(var + eps) or x / ||x||, perhaps times gamma plus beta."""
        if n.op_type in NORMALIZATIONS:
            return n.input[0], n.op_type
        for _ in range(2):  # (beta, then gamma: constant operands)
            if n is None or n.op_type not in ("Add", "Mul") or len(self._variable(n)) != 1 or len(n.input) != 2:
                break
            n = self._through(self._variable(n)[0])[1]
        if n is not None and n.op_type == "Div" and len(n.input) == 2 and self._is_norm(n.input[1]):
            return n.input[0], "divided by a norm: " + self._norm_ops(n.input[1])
        return None

    def _divisor_ops(self, t: str) -> list:
        """The op types within a few producers of a divisor."""
        ops, stack, seen = [], [(t, 0)], set()
        while stack:
            t, depth = stack.pop()
            n = self.prods.get(t)
            if n is None or t in seen or depth > 4:
                continue
            seen.add(t)
            ops.append(n.op_type)
            stack.extend((i, depth + 1) for i in self._variable(n))
        return ops

    def _is_norm(self, t: str) -> bool:
        """A square root (or an L2 reduction) of a reduction: a standard deviation or a vector's length, where a
        mean pooling's divisor is a count (no root) and attention's sqrt(d) reduces nothing."""
        ops = self._divisor_ops(t)
        return ("Sqrt" in ops or "ReduceL2" in ops) and any(o in REDUCTIONS for o in ops)

    def _norm_ops(self, t: str) -> str:
        return "/".join(dict.fromkeys(o for o in self._divisor_ops(t) if o in REDUCTIONS + ("Sqrt",)))

    def pooled_from(self, t: str) -> str | None:
        """Where t is token states pooled over the tokens with no weight in between (mask products and a
        divide by the count allowed): what pools which normalization, else None."""
        stack, seen = [(t, (), 0)], set()
        while stack:
            t, pools, depth = stack.pop()
            n = self.prods.get(t)
            pooled = any(p in POOLING for p in pools)
            if n is None or (t, pooled) in seen or depth > DEPTH:
                continue
            seen.add((t, pooled))
            norm = self.normalized(n) if pooled else None
            if norm is not None:
                return f"a pooling over the tokens ({'/'.join(dict.fromkeys(reversed(pools)))}) of states a " \
                       f"normalization writes ({norm[1]})"
            if n.op_type in CARRIERS or n.op_type == "Concat" and len(self._variable(n)) == 1:
                stack.extend((i, pools, depth + 1) for i in self._variable(n)[:1])
            elif n.op_type in POOLING and n.input[0] not in self.consts:
                stack.append((n.input[0], pools + (n.op_type,), depth + 1))
            elif n.op_type == "Mul":  # (by the mask: either side may be the states)
                stack.extend((i, pools, depth + 1) for i in self._variable(n))
            elif n.op_type == "Div" and n.input[0] not in self.consts:  # (by the count of real tokens)
                stack.append((n.input[0], pools + ("Div",), depth + 1))
        return None
