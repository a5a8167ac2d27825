"""Which layers the report calls int8 ONNX Runtime runs in float: its own optimized graph of the model written.

A QDQ layer is int8 in ONNX Runtime only in the forms its fusions take (DequantizeLinear -> Conv ->
QuantizeLinear becomes a QLinearConv; a MatMul may end float, as MatMulIntegerToFloat); any other form runs as
a float op on weights dequantized at every run: as slow as fp32 and no more exact than it. qtool's plan meant
every weighted int8 layer to take such a form, and once did not (eeg-spindle-seg: 21 convolutions into fp32
GELUs lost their output pair when its MatMuls went dynamic, reported int8 while ORT ran 1 QLinearConv of 22).
This reads what ORT made of the model written, so the report says it whatever the plan meant: a layer the
plan leaves with a float output before the graph output (a detector's last Conv, _drop_unread_outputs) is
listed too, as ORT runs it."""
from __future__ import annotations

import os
import tempfile

import onnx

from qtool.modelio import external_files
from qtool.ortsession import write_optimized

# ops that hold a weight and run float in ORT's graph (a fused float Conv keeps the layer's name)
FLOAT_WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "FusedConv", "FusedGemm", "FusedMatMul"})
MAX_BYTES = 1 << 30  # a larger model is not checked: ORT would write its optimized copy as big again


def float_layers(path: str, layers) -> dict | None:
    """{layer: the float op ONNX Runtime runs it as} for each of `layers` (node names reported int8 with a
    weight) that ORT's optimized graph of the model at `path` keeps as a float op; None: not checked (a model
    with external data, or one over MAX_BYTES: ORT would write its optimized copy, as large, inline)."""
    if os.path.getsize(path) > MAX_BYTES or external_files(path):
        return None
    names = set(layers)
    with tempfile.TemporaryDirectory(prefix="qtool-ortgraph-") as tmp:
        out = os.path.join(tmp, "optimized.onnx")
        write_optimized(path, out)
        graph = onnx.load(out, load_external_data=False).graph
    return {n.name: n.op_type for n in graph.node if n.op_type in FLOAT_WEIGHTED and n.name in names}
