"""Bring a model below opset 13 up to 13, before any other pass.

Per-axis DequantizeLinear (per-channel weights) exists from opset 13 on. The upgrade happens on the
cleaned graph, so calibration plans on the graph quantize will write: planned on opset 9, a Softmax
reading a pooled tensor was not an int8 reader, and quantize, on opset 13, asked for a range nobody
had recorded.
"""
from __future__ import annotations

import onnx

from qtool import graph as G
from qtool.errors import QtoolError
from qtool.modelio import PROVENANCE, set_provenance

MIN_OPSET = 13
KEY = PROVENANCE + "upgraded_from_opset"  # metadata: the opset the original model had


def _note(v) -> str:
    return f"opset upgraded from {v} to {MIN_OPSET} (per-channel DequantizeLinear needs {MIN_OPSET})"


def upgrade(model: onnx.ModelProto, notes: list) -> onnx.ModelProto:
    """`model` if its opset is 13 or more, else an upgraded copy (a note says so)."""
    v = G.opset(model)
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        return model  # (no ONNX-domain op at all, an ai.onnx.ml pipeline: nothing qtool quantizes, nothing to upgrade)
    if v >= MIN_OPSET:
        was = next((p.value for p in model.metadata_props if p.key == KEY), None)
        if was is not None:  # (upgraded when calibrate cleaned the graph: quantize's report says so too)
            notes.append(_note(was))
        return model
    from onnx import version_converter
    ir = model.ir_version
    # opset 13 needs IR 7; below IR 4 the converter also takes an initializer that is not listed as a graph
    # input for an undefined tensor (the caller's model is only borrowed: its version is put back)
    model.ir_version = max(ir, 7)
    try:
        up = version_converter.convert_version(model, MIN_OPSET)
    except Exception as e:
        raise QtoolError(f"model opset {v} has no per-axis DequantizeLinear and upgrading it to {MIN_OPSET} "
                         f"failed: {e}") from None
    finally:
        model.ir_version = ir
    up.ir_version = max(up.ir_version, 7)
    notes.append(_note(v))
    set_provenance(up, upgraded_from_opset=v)
    G.name_nodes(up)  # (the converter adds nodes without names: a Dropout-12's ratio Constant)
    return up
