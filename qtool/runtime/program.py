"""What the compiler works on and hands to the session: the values it tracks while walking a QDQ
graph (dq views, quantized constants, slots) and the compiled Program."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper


@dataclass
class QView:
    """A float tensor that is DequantizeLinear(uint8 tensor `src`)."""
    src: str
    scale: np.float32
    zp: int


@dataclass
class QConst:
    """A constant that is DequantizeLinear(integer initializer)."""
    q: np.ndarray
    scale: np.ndarray
    zp: np.ndarray
    axis: int


@dataclass
class Val:
    slot: int
    kind: str                 # 'q' uint8 tensor, 'f' float/other runtime tensor
    nhwc: bool = False        # for 'q': stored NHWC when rank 4
    q: tuple | None = None    # (scale, zp) of the Q that produced it
    rank: int | None = None


@dataclass
class Entry:
    node: str
    op: str
    mode: str                 # int8 | fp32 | folded | fused | convert
    detail: str = ""


@dataclass
class Program:
    steps: list
    n_slots: int
    consts: dict              # slot -> array
    inputs: list              # [(name, slot, dims, elem_type)]
    outputs: list             # [(name, slot, kind, nhwc)]
    entries: list = field(default_factory=list)
    values: dict = field(default_factory=dict)  # tensor name -> (slot, kind, nhwc), for debugging


def node_attrs(node) -> dict:
    """A node's attributes as Python values (tensors as numpy arrays)."""
    out = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        out[a.name] = numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v
    return out
