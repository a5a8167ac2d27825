"""Graph cleanup and fusion: model -> fused fp32 graph computing the same function.

A model's local functions are first inlined (inline_functions); a model below opset 13 is upgraded to
13 (upgrade_opset), so that every later step sees the opset the int8 graph will have, and a float16
model is widened to compute in float32 (upcast_float16).

Each pass is one small module with a `run(model, ctx) -> changed` function, listed in
PASSES in the order they are tried; the list is applied until no pass changes anything.
FINAL_PASSES then run once on the simplified graph: fold_attention_bias, which proves its rewrite on the
whole graph's inferred shapes, and pair_channels, which chooses among equivalent graphs (it reorders
channels for ONNX Runtime's int16 pairs) instead of simplifying one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from qtool import graph as G
from qtool.fuse import (fold_attention_bias, fold_batchnorm, fold_constants, fold_mul_add, fold_pad, fold_reshape_shape, inline_functions,
                        pair_channels, remove_dead, remove_identity, upcast_float16, upgrade_opset)
from qtool.errors import QtoolError
from qtool.timing import Phases

PASSES = [
    ("remove_identity", remove_identity.run),
    ("fold_constants", fold_constants.run),
    ("fold_reshape_shape", fold_reshape_shape.run),
    ("fold_pad", fold_pad.run),
    ("fold_batchnorm", fold_batchnorm.run),
    ("fold_mul_add", fold_mul_add.run),
    ("remove_dead", remove_dead.run),
]
# once the graph is final: passes that read the whole simplified graph's shapes (one shape inference, not
# one a round) or choose among equivalent graphs rather than simplify one
FINAL_PASSES = [
    ("fold_attention_bias", fold_attention_bias.run),
    ("pair_channels", pair_channels.run),
]


@dataclass
class FuseContext:
    """What passes may read (pinned input dims) and where they say what they did."""

    input_pins: dict = field(default_factory=dict)  # input name -> [dims], 0/None = keep the model's
    messages: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)

    def log(self, pass_name: str, message: str) -> None:
        self.messages.append(f"{pass_name}: {message}")
        self.counts[pass_name] = self.counts.get(pass_name, 0) + 1


@dataclass
class FuseResult:
    model: onnx.ModelProto
    counts: dict
    messages: list
    ops_before: dict
    ops_after: dict
    seconds: dict = field(default_factory=dict)  # pass -> seconds (timing.Phases), for -v


def _op_counts(model):
    c = {}
    for n in model.graph.node:
        c[n.op_type] = c.get(n.op_type, 0) + 1
    return c


def pin_inputs(model: onnx.ModelProto, pins: dict) -> None:
    """Write pinned non-batch dims into the model's input shapes (batch stays as it is)."""
    for inp in model.graph.input:
        pin = pins.get(inp.name)
        if not pin:
            continue
        for k, d in enumerate(inp.type.tensor_type.shape.dim):
            if k > 0 and k < len(pin) and pin[k] and not (d.HasField("dim_value") and d.dim_value > 0):
                d.dim_value = int(pin[k])


def fuse_model(model: onnx.ModelProto, input_pins: dict | None = None, passes=None, max_rounds: int = 20,
               inplace: bool = False) -> FuseResult:
    """`inplace`: rewrite `model` itself (the caller no longer needs the original), instead of a copy:
    a model of several GB is then held once, not twice."""
    if inplace:
        m = model
    else:
        m = onnx.ModelProto()
        m.CopyFrom(model)
    ctx = FuseContext(input_pins=dict(input_pins or {}))
    before = _op_counts(m)
    if passes is None:
        notes = []
        try:
            m = inline_functions.inline(m, notes)
        except QtoolError as e:  # (the calls stay ops without a rule: fp32, and the note says why)
            notes.append(str(e))
        for line in notes:
            ctx.log("inline_functions", line)
        notes = []
        try:
            m = upgrade_opset.upgrade(m, notes)
        except QtoolError as e:  # (quantize, which needs opset 13, says so again; calibration can go on)
            notes.append(str(e))
        for line in notes:
            ctx.log("upgrade_opset", line)
        notes = []
        if upcast_float16.upcast(m, notes):
            ctx.log("upcast_float16", notes[0])
    pin_inputs(m, ctx.input_pins)
    phases = Phases()
    for _ in range(max_rounds):
        changed = False
        for name, fn in (passes or PASSES):
            with phases(name):
                changed |= bool(fn(m, ctx))
        if not changed:
            break
    for name, fn in ([] if passes else FINAL_PASSES):
        with phases(name):
            fn(m, ctx)
    del m.graph.value_info[:]
    G.name_nodes(m)
    return FuseResult(m, ctx.counts, ctx.messages, before, _op_counts(m), phases.seconds)
