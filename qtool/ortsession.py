"""The one place qtool opens ONNX Runtime sessions (CPU execution provider).

Every step (calibration, the experiments inside quantize, eval, bench) asks here, so the
settings that matter are set once: thread count, no spinning where another thread needs the
core, the memory arena, the optimization level, and one-line errors naming the file.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from qtool.errors import QtoolError


def session(model: onnx.ModelProto | str | bytes, threads: int = 0, arena: bool = True, spin: bool = True,
            basic: bool = False) -> ort.InferenceSession:
    """`spin=False`: idle ORT workers sleep instead of spinning (they would take the core another
    thread of ours needs). `arena=False`: large outputs go back to the system after each run instead
    of pinning the peak. `basic=True`: only the basic graph optimizations, so a QDQ graph runs as
    written (float ops between Q/DQ) instead of on ORT's fused int8 kernels."""
    so = ort.SessionOptions()
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.enable_cpu_mem_arena = arena
    so.intra_op_num_threads = threads or min(os.cpu_count() or 1, 8)
    so.log_severity_level = 3
    if basic:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    src = model if isinstance(model, (str, bytes)) else model.SerializeToString()
    try:
        return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT's own errors are long multi-line C++ messages
        where = model if isinstance(model, str) else "the model"
        raise QtoolError(f"{where}: ONNX Runtime cannot load it ({str(e).strip().splitlines()[0][:200]})") from None


def with_outputs(model: onnx.ModelProto, names: list) -> bytes:
    """The serialized model with `names` as extra outputs. The outputs are appended to the
    model itself only while it is serialized: no second copy of the weights in memory."""
    have = {o.name for o in model.graph.output}
    added = [n for n in dict.fromkeys(names) if n not in have]
    n0 = len(model.graph.output)
    model.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in added)
    try:
        return model.SerializeToString()
    finally:
        del model.graph.output[n0:]


def run_first_output(model: onnx.ModelProto | str, feeds: list, threads: int = 0) -> np.ndarray:
    """The model's first output over a list of input dicts, concatenated."""
    s = session(model, threads)
    name = s.get_outputs()[0].name
    return np.concatenate([s.run([name], f)[0] for f in feeds])
