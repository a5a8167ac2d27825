"""The graph a calibration pass runs: one session reading out every observed tensor, or, when one sample's
observed tensors would outgrow memory (GROUPED_ABOVE), the graph's nodes cut into segments run one after
another, each node still run once (plan). ShapesAt: the shape inference at a batch's shapes that both the
plan and the calibration budget read."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from qtool import graph as G
from qtool.ortsession import with_outputs


class ShapesAt:
    """Shape inference of a graph at a batch's input shapes, kept for the last shapes asked: the
    calibration budget (the first batch's MACs) and the plan of the pass (the first batch's observed
    bytes) read the same inference, of the whole graph with data propagation (0.1 s on MiniLM-L3 or
    PP-OCRv5 det; more on larger graphs). What it returns is shared: read it, never change it."""

    def __init__(self, model: onnx.ModelProto):
        self.model, self.key, self.shapes = model, None, None

    @staticmethod
    def inputs(feeds: dict) -> dict:
        return {k: np.shape(v) for k, v in feeds.items()}

    def __call__(self, feeds: dict) -> dict:
        key = self.inputs(feeds)
        if key != self.key:
            self.key, self.shapes = key, G.inferred_shapes(self.model, key)
        return self.shapes


GROUPED_ABOVE = 1 << 30  # observed bytes per sample beyond which the graph is run in segments
GROUP_BYTES = 384 << 20  # observed bytes per sample a segment writes out, about


@dataclass
class Segment:
    """A run of the graph's nodes, a session of its own: it reads `inputs` from the values carried
    along (the samples' inputs, what earlier segments wrote), writes `outputs` (the observed tensors
    it computes, and what later segments read), after which `observe` is observed and `drop` dropped."""
    model: bytes
    inputs: list
    outputs: list
    observe: list
    drop: list = field(default_factory=list)


def plan(model: onnx.ModelProto, wanted: list, feeds: dict | None, shapes: ShapesAt, cut: bool) -> tuple:
    """The whole graph as one segment reading out `wanted`, or, when one sample's values of them exceed
    GROUPED_ABOVE, its nodes (in graph order) cut into segments that each write about GROUP_BYTES of
    them: each node runs once, and only one segment's values and the tensors crossing the cuts are
    held. Sizes from shape inference at the batch's input shapes (`shapes`); a tensor of unknown size
    counts as the largest known one. -> (segments, the observed bytes per sample at these shapes)"""
    if not feeds:
        return [Segment(with_outputs(model, wanted), [], wanted, wanted)], 0
    # inferred at the batch's own shapes, one sample's share taken after: at one row, onnx's data propagation
    # aborted the process (a std::clamp assertion) on madmom's onsets CNN, whose axis 0 is time
    at = shapes(feeds)
    rows = max(1, len(next(iter(feeds.values())))) if cut and np.ndim(next(iter(feeds.values()))) else 1
    size = {t: 4 * int(np.prod(at[t])) // rows for t in wanted if at.get(t) is not None and all(at[t])}
    big = max(size.values(), default=0)
    total = sum(size.get(t, big) for t in wanted)
    if total <= GROUPED_ABOVE:  # (the whole graph serialized only now: a cut graph never needs it)
        return [Segment(with_outputs(model, wanted), [], wanted, wanted)], total
    return _cut(model, wanted, lambda t: size.get(t, big)), total


def _cut(model: onnx.ModelProto, wanted: list, size) -> list:
    """The graph's nodes, in order, as segments each writing about GROUP_BYTES of `wanted` (`size(t)`:
    a tensor's bytes per sample)."""
    from qtool.plan import elem_types
    nodes = G.topological_order(model)
    want = set(wanted)
    cuts, used = [0], 0
    for k, n in enumerate(nodes):
        out = sum(size(o) for o in n.output if o in want)
        if used and used + out > GROUP_BYTES:
            cuts.append(k)
            used = 0
        used += out
    cuts.append(len(nodes))
    reads = [G.node_reads(n) for n in nodes]
    inits = {t.name: t for t in model.graph.initializer}
    types = elem_types(model)
    graph_inputs = [i.name for i in G.real_inputs(model)]
    segs = []
    for a, b in zip(cuts, cuts[1:]):
        made = {o for n in nodes[a:b] for o in n.output if o}
        later = set().union(*reads[b:]) if b < len(nodes) else set()
        ins = sorted(set().union(*reads[a:b]) - made - set(inits))
        outs = [t for t in wanted if t in made] + sorted((made & later) - want)
        seen = set(graph_inputs) if a == 0 else set()
        g = helper.make_graph(nodes[a:b], f"segment{len(segs)}",
                              [helper.make_tensor_value_info(t, types.get(t, onnx.TensorProto.FLOAT), None) for t in ins],
                              [helper.make_empty_tensor_value_info(t) for t in outs],
                              [inits[t] for t in sorted(set().union(*reads[a:b]) & set(inits))])
        m = helper.make_model(g, opset_imports=model.opset_import)
        m.ir_version = max(model.ir_version, 8)
        segs.append(Segment(m.SerializeToString(), ins, outs, [t for t in wanted if t in made or t in seen & want]))
    for k, seg in enumerate(segs):  # what no later segment reads goes once this one is done
        ahead = set().union(*(s.inputs for s in segs[k + 1:])) if k + 1 < len(segs) else set()
        seg.drop = [t for t in seg.outputs + seg.inputs if t not in ahead]
    return segs
