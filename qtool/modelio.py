"""Loading and saving ONNX models safely.

Models are untrusted input: external-data paths must stay inside the model's folder,
and every failure becomes one line naming the file.
"""
from __future__ import annotations

import hashlib
import os
import tempfile

import onnx
from onnx import external_data_helper

from qtool.errors import QtoolError


def _check_external_paths(model: onnx.ModelProto, base: str, path: str) -> None:
    root = os.path.realpath(base)
    for t in external_data_helper._get_all_tensors(model):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        full = os.path.realpath(os.path.join(root, loc))
        if os.path.isabs(loc) or os.path.commonpath([root, full]) != root:
            raise QtoolError(f"{path}: tensor '{t.name}' points to external data outside the model's folder ({loc!r}); refusing to read it")
        if not os.path.isfile(full):
            raise QtoolError(f"{path}: external data file {loc!r} of tensor '{t.name}' is missing")


def _parse_failure(e: Exception) -> str:
    # protobuf parses nested messages recursively and stops at 100 levels: subgraphs (If/Loop/Scan
    # bodies) nested about 30 deep. A long chain of nodes is never deep in that sense.
    if "MaxDepth" in str(e) or "recursion" in str(e).lower():
        return "subgraphs (If/Loop/Scan bodies) nested deeper than protobuf's parser allows, 100 message levels"
    return type(e).__name__


def load_model(path: str, check: bool = True) -> onnx.ModelProto:
    """Read an ONNX file (with external data from its own folder only)."""
    if not os.path.exists(path):
        raise QtoolError(f"{path}: no such model file")
    if os.path.isdir(path):
        raise QtoolError(f"{path}: is a folder, not an ONNX model file")
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf raises several types on garbage
        raise QtoolError(f"{path}: not a valid ONNX model ({_parse_failure(e)})") from None
    if not model.graph.node and not model.graph.output:
        raise QtoolError(f"{path}: not a valid ONNX model (empty graph)")
    base = os.path.dirname(os.path.abspath(path))
    _check_external_paths(model, base, path)
    try:
        external_data_helper.load_external_data_for_model(model, base)
    except Exception as e:
        raise QtoolError(f"{path}: cannot read external data ({e})") from None
    if check:
        try:
            # the structure is what can be wrong; checking a copy without the large weights
            # spares serializing hundreds of MB a second time
            from qtool.graph import skeleton
            onnx.checker.check_model(skeleton(model))
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise QtoolError(f"{path}: ONNX checker rejects the model: {msg}") from None
    return model


def model_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write to a temporary file in the same folder, then rename: never a half-written file."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    try:
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=d)
    except OSError as e:
        raise QtoolError(f"{path}: cannot write ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise QtoolError(f"{path}: cannot write ({e.strerror or e})") from None
        raise


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def json_safe(o):
    """Plain JSON (no NaN/Infinity, which strict parsers reject): inf becomes +-1e308, NaN None."""
    import math
    if isinstance(o, float) and not math.isfinite(o):
        return None if math.isnan(o) else (1e308 if o > 0 else -1e308)
    if isinstance(o, dict):
        return {k: json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    return o


def save_model(model: onnx.ModelProto, path: str) -> None:
    """Atomic save; models over 2 GB go to one external-data file beside them."""
    if model.ByteSize() < (2 << 30) - (64 << 20):
        atomic_write_bytes(path, model.SerializeToString())
        return
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".tmp-{os.getpid()}-{os.path.basename(path)}")
    data = os.path.basename(path) + ".data"
    try:
        onnx.save_model(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True, location=data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
