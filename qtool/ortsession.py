"""The one place qtool opens ONNX Runtime sessions (CPU execution provider).

Every step (calibration, the experiments inside quantize, eval, bench) asks here, so the
settings that matter are set once: thread count, no spinning where another thread needs the
core, the memory arena, the optimization level, and one-line errors naming the file.
"""
from __future__ import annotations

import os
import stat

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from qtool.errors import QtoolError


LOAD_ERROR_CHARS = 200


def _one_line(e: Exception) -> str:
    """ORT's message on one line: its lines joined ("Got invalid dimensions for input: x for the following
    indices" says which only on the lines after it), at most 300 characters."""
    text = " ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())
    return (text or type(e).__name__)[:300]


class Session(ort.InferenceSession):
    """An InferenceSession whose failures at run time (a shape the model cannot take, an allocation
    that fails, a kernel that rejects an attribute) are one QtoolError naming the model, not ORT's
    multi-line C++ message as a traceback."""

    where = "the model"

    def run(self, *args, **kwargs):
        try:
            return super().run(*args, **kwargs)
        except Exception as e:  # ORT's Fail, InvalidArgument, RuntimeException ..., MemoryError, its ValueErrors
            raise QtoolError(f"{self.where}: ONNX Runtime failed to run it ({_one_line(e)})") from None

    def run_with_iobinding(self, *args, **kwargs):
        try:
            return super().run_with_iobinding(*args, **kwargs)
        except Exception as e:
            raise QtoolError(f"{self.where}: ONNX Runtime failed to run it ({_one_line(e)})") from None


_SHARED_ARENA = []  # registered once per process


def _shared_arena():
    if not _SHARED_ARENA:
        mem = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(mem, ort.OrtArenaCfg(0, -1, -1, -1))
        _SHARED_ARENA.append(mem)


def onnx_type(ort_type: str) -> int | None:
    """ONNX Runtime's type string ('tensor(int32)') as an onnx.TensorProto element type; None for a
    sequence, map or unknown type."""
    if not (ort_type.startswith("tensor(") and ort_type.endswith(")")):
        return None
    return getattr(onnx.TensorProto, ort_type[7:-1].upper(), None)


def session(model: onnx.ModelProto | str | bytes, threads: int = 0, arena: bool | str = True, spin: bool = True,
            basic: bool = False, where: str | None = None, external: dict | None = None,
            float_weights: bool = False) -> ort.InferenceSession:
    """`spin=False`: idle ORT workers sleep instead of spinning (they would take the core another
    thread of ours needs). `arena=False`: large outputs go back to the system after each run instead
    of pinning the peak. `arena="shared"`: one arena for every such session of the process, for many
    sessions alive at once that run one after another: memory of one run's peak, and none of the
    30-50 % that allocating from the system at every run costs (Lite0, batch 16). `basic=True`: only the basic graph optimizations, so a QDQ graph runs as
    written (float ops between Q/DQ) instead of on ORT's fused int8 kernels. `external` (name ->
    OrtValue): fills the initializers the graph marks as external (one array made once serves many
    sessions, none serialized).
    `float_weights=True`: a Conv/Gemm whose float weight sits between a DequantizeLinear and a
    QuantizeLinear computes with that weight as given. Without it ORT (WeightBiasQuantization, at
    every optimization level) quantizes such a weight to int8 per tensor: the simulated int8 layers
    carry their per-channel int8 weights dequantized, and a per-tensor scale rounds a depthwise
    convolution's small channels to zero."""
    so = _options(threads, arena)
    if external:
        so.add_external_initializers(list(external), list(external.values()))
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if basic:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    where = where or (model if isinstance(model, str) else "the model")
    if isinstance(model, str) and os.path.exists(model) and not stat.S_ISREG(os.stat(model).st_mode):
        raise QtoolError(f"{model}: not a regular file; refusing to read it as a model")
    src = model if isinstance(model, (str, bytes)) else model.SerializeToString()
    s = _load(src, so, where, ["WeightBiasQuantization"] if float_weights else None)
    s.where = where
    return s


def _options(threads: int, arena: bool | str) -> ort.SessionOptions:
    """Session options every qtool session takes: its threads (0: the cores, up to 8), its arena (session()),
    and no log lines of ORT's own."""
    so = ort.SessionOptions()
    if arena == "shared":
        _shared_arena()
        so.add_session_config_entry("session.use_env_allocators", "1")
    so.enable_cpu_mem_arena = bool(arena)
    so.intra_op_num_threads = threads or min(os.cpu_count() or 1, 8)
    so.log_severity_level = 4  # errors come back as one QtoolError, not also as ORT's own log lines
    return so


def _load(src, so: ort.SessionOptions, where: str, disabled: list | None = None) -> ort.InferenceSession:
    """The session of `src` (a path or the model's bytes), ORT's error as one QtoolError naming `where`."""
    try:
        return Session(src, so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)
    except Exception as e:  # ORT's own errors are long multi-line C++ messages
        raise QtoolError(f"{where}: ONNX Runtime cannot load it ({_one_line(e)[:LOAD_ERROR_CHARS]})") from None


def write_optimized(path: str, out: str) -> None:
    """The graph ONNX Runtime runs for the model at `path`, after its own fusions, written to `out`: the
    extended level (its int8 kernels: QLinearConv, MatMulIntegerToFloat, ...), not its CPU-specific layouts
    (quantize/ort_graph.py reads which layers it left float)."""
    so = _options(1, False)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = out
    _load(path, so, path)


def with_outputs(model: onnx.ModelProto, names: list) -> bytes:
    """The serialized model with `names` as extra outputs. The outputs are appended to the
    model itself only while it is serialized: no second copy of the weights in memory."""
    have = {o.name for o in model.graph.output}
    added = [n for n in dict.fromkeys(names) if n not in have]
    n0 = len(model.graph.output)
    # the model's own outputs lose their declared shapes too: exporters declare wrong ones (a CRNN's
    # [-1, 25, 6625] that runs as T = 80), which ORT lets pass in a plain run but not into a bound buffer
    own = [onnx.ValueInfoProto() for _ in range(n0)]
    for o, saved in zip(model.graph.output, own):
        saved.CopyFrom(o)
        for d in o.type.tensor_type.shape.dim:  # (the rank stays: every dim unknown)
            d.Clear()
    model.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in added)
    try:
        return model.SerializeToString()
    finally:
        del model.graph.output[n0:]
        for o, saved in zip(model.graph.output, own):
            o.CopyFrom(saved)


def run_first_output(model: onnx.ModelProto | str, feeds: list, threads: int = 0, where: str | None = None) -> np.ndarray:
    """The model's first output over a list of input dicts, concatenated."""
    s = session(model, threads, where=where)
    name = s.get_outputs()[0].name
    return np.concatenate([s.run([name], f)[0] for f in feeds])


def run_output(model: onnx.ModelProto, name: str, feeds: list, threads: int = 0, where: str | None = None):
    """Output `name` of the model (a graph output, or any tensor it computes) for each of a list of input dicts,
    one at a time as they are computed (the caller may place each before the next exists).
    The session's arena is the process's shared one: quantize's experiments build hundreds of sessions,
    two at a time, and their own arenas piled up (PP-OCRv5's recognizer, --exclude-sensitive: 14 GB)."""
    s = session(with_outputs(model, [name]), threads, arena="shared", where=where)
    for f in feeds:
        yield s.run([name], f)[0]
