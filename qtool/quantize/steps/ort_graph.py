"""The layers reported int8 that ONNX Runtime runs in float (ort_graph.py), read from its graph of the model written."""
from __future__ import annotations

from qtool.quantize.ort_graph import float_layers
from qtool.quantize.step import Step


def when(run) -> bool:
    """a model was written"""
    return run.path is not None and run.out is not None


def check(run) -> None:
    weighted = sorted(k for k, v in run.out.layers.items() if v.weight_sqnr_db is not None)
    found = float_layers(run.path, weighted)
    run.ort_float = {"checked": found is not None, "layers": found or {}}
    if found:
        names = ", ".join(sorted(found)[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        run.say(f"ONNX Runtime runs {len(found)} of the {len(weighted)} int8 layers with weights in float "
                f"(its graph of the model written: no int8 kernel for them in this form): {names}")


STEP = Step("ORT graph check", check, when, fallback="which layers ONNX Runtime runs in float not checked")
