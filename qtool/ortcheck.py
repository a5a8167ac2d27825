"""The model written runs: ONNX Runtime loads it and runs it once, on one input, before it is renamed into
place (modelio.save_model's `check`), so a model ONNX Runtime cannot load or run is never written.

The run is in a child process: on a model made from ranges no activation can have, ONNX Runtime died with
SIGFPE or SIGSEGV inside its kernels, which in quantize's own process ended it without a word. The input is
one calibration sample where quantize has one, else zeros at the sizes `zero_feed` finds.
"""
from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import onnx

from qtool import graph as G
from qtool.errors import QtoolError

# free dims tried, smallest first, for a zero input: the first at which shape inference computes every
# tensor with a positive size is taken (a 3x3 Conv without padding has no output at 1)
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 224, 256, 512)
_NUMPY = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
          onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32,
          onnx.TensorProto.INT8: np.int8, onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.BOOL: np.bool_}


def zero_feed(model: onnx.ModelProto, pins: dict | None = None) -> dict:
    """input name -> zeros for each real input of `model`: its static dims, `pins` (name -> dims, None
    where free) where given, batch 1, and every other free dim the smallest of SIZES at which shape inference
    gives every tensor a positive size (the last tried where none does)."""
    inputs = G.real_inputs(model)
    dims = {}
    for i in inputs:
        d = G.input_dims(i)
        pin = (pins or {}).get(i.name) or []
        dims[i.name] = [pin[k] if k < len(pin) and isinstance(pin[k], int) and pin[k] > 0 else v
                        for k, v in enumerate(d)]
    free = lambda size: {n: [v if isinstance(v, int) else (1 if k == 0 else size) for k, v in enumerate(d)]
                         for n, d in dims.items()}
    shapes = free(SIZES[-1])
    if any(not isinstance(v, int) for d in dims.values() for v in d[1:]):
        for size in SIZES:
            if _computes(model, free(size)):
                shapes = free(size)
                break
    types = {i.name: _NUMPY.get(i.type.tensor_type.elem_type, np.float32) for i in inputs}
    return {n: np.zeros(s, types[n]) for n, s in shapes.items()}


def _computes(model: onnx.ModelProto, shapes: dict) -> bool:
    """Shape inference at these input sizes gives every tensor a positive size (in a forked child: onnx's
    inference can abort the process at a size the model cannot take, graph.infer_shapes_guarded)."""
    sk = G.skeleton(model)
    for i in sk.graph.input:
        if i.name in shapes:
            dims = i.type.tensor_type.shape.dim
            del dims[:]
            for v in shapes[i.name]:
                dims.add().dim_value = int(v)
    try:
        inf = G.infer_shapes_guarded(sk, strict_mode=True, data_prop=True)
    except Exception:  # noqa: BLE001 - a size inference refuses
        return False
    for vi in list(inf.graph.value_info) + list(inf.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value <= 0:
                return False
    return True


def check_runs(path: str, feed: dict, fp32_path: str | None = None) -> None:
    """ONNX Runtime loads the model at `path` and runs it on `feed`, in a child process; one QtoolError when
    it cannot (its error, or the signal that killed it). `fp32_path`: where the feed is a guess (zeros at
    sizes qtool chose), the fp32 model is run on it too when the int8 one fails: a feed the fp32 model
    refuses as well says nothing against the int8 model, and passes."""
    why = _child(path, feed)
    if why is None:
        return
    if fp32_path is not None and _child(fp32_path, feed) is not None:
        return  # (a size the model does not take: nothing learnt)
    raise QtoolError(f"the int8 model does not run in ONNX Runtime ({why}); it was not written")


# what the child runs: onnxruntime and numpy only (importing qtool.ortsession, which imports onnx, took 2-3 s of
# the child's 3 on a busy machine; the session is made as ortsession.session makes one: one thread, no log)
_CHILD = """
import io, sys
import numpy as np
import onnxruntime as ort
with np.load(io.BytesIO(sys.stdin.buffer.read())) as z:
    feed = {k: z[k] for k in z.files}
so = ort.SessionOptions()
so.intra_op_num_threads, so.log_severity_level, so.enable_cpu_mem_arena = 1, 4, False
try:
    ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"]).run(None, feed)
except Exception as e:
    print(" ".join(str(e).split()) or type(e).__name__, file=sys.stderr)
    sys.exit(1)
"""


def _child(path: str, feed: dict) -> str | None:
    """None when the child ran the model on `feed`, else why not, in one line."""
    buf = io.BytesIO()
    np.savez(buf, **feed)
    p = subprocess.run([sys.executable, "-c", _CHILD, path], input=buf.getvalue(), capture_output=True)
    if p.returncode == 0:
        return None
    if p.returncode < 0:
        return f"it died of signal {-p.returncode} running the model"
    lines = p.stderr.decode("utf-8", "replace").strip().splitlines()
    return lines[-1][:300] if lines else f"exit {p.returncode}"
