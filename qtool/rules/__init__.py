"""Op quantization rules: one small module per op family, found by op type in RULES.

A rule says which inputs of a node are activations to quantize (uint8, per tensor),
which input is a weight (int8, per channel along `axis`) and which is a bias (int32),
and whether the output gets its own quantization parameters ("compute") or carries the
input's unchanged ("passthrough": shape ops, Slice/Split/Resize/Pad, max pooling, data movement
(Gather, Expand, Tile, DepthToSpace ...) and ReduceMax/ReduceMin; every output of a passthrough node
shares its data input's parameters).
An op without a rule stays fp32 and the quantize summary says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from qtool.rules import add, concat, conv, elementwise, gemm, passthrough, pool, shape


@dataclass(frozen=True)
class OpRule:
    kind: str  # "compute" or "passthrough"
    act_inputs: Callable  # (node) -> list of input indices that are activations
    weight: Callable = lambda node, model: None  # (node, model) -> (index, axis) or None
    bias: Optional[int] = None
    check: Callable = lambda node, model: None  # (node, model) -> reason it cannot be int8, or None
    range_check: Callable = lambda node, ranges: None  # (node, tensor -> [lo, hi]) -> reason, once calibrated
    int8_input: bool = False  # only worth doing in int8 when some input already is (data movement, no arithmetic)


RULES: dict = {}
for _mod in (conv, gemm, add, concat, pool, passthrough, shape, elementwise):
    for _op, _spec in _mod.RULES.items():
        RULES[_op] = OpRule(**_spec)

# activations fused into the producer's output range (the Q clamp implements them)
FUSABLE_ACTIVATIONS = ("Relu", "Clip")
