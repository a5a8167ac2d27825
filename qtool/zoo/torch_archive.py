"""Read PyTorch checkpoints (``.pth`` / ``.pt``) into numpy arrays, without torch.

A checkpoint is a pickle. Unpickling runs whatever callables the file names, so
this reader never uses plain ``pickle.load``: a restricted unpickler maps the
handful of globals a weight file needs (``torch._utils._rebuild_tensor_v2``,
``torch.FloatStorage`` ..., ``collections.OrderedDict``) to local, side-effect
free stand-ins and refuses every other global with a ``TorchArchiveError`` that
names the file and the global. Nothing in the file is ever executed.

Two container formats are read:

- zip (torch >= 1.6 default): ``<name>/data.pkl`` holds the object tree,
  storages are referenced by persistent ids ``('storage', type, key, location,
  numel)`` and their raw bytes live in ``<name>/data/<key>``.
- legacy (``_use_new_zipfile_serialization=False``, torch < 1.6): five pickles
  in a row (magic number, protocol version, sys info, the object tree, the list
  of storage keys), then each storage as an int64 element count and raw bytes.

The even older tar format is refused with a clear error.

A tensor is (storage, element offset, size, stride); it is rebuilt with
``numpy.ndarray(buffer=..., offset=..., strides=...)`` after its bounds are
checked against the storage, then copied so it owns its memory.

``write_state_dict`` writes the zip format (what ``torch.save`` writes) from
numpy arrays; the tests use it to build archives without torch.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import zipfile
from typing import Any, Dict, Mapping

import numpy as np

from qtool.errors import QtoolError
from qtool.limits import elems, human_bytes, is_regular_file

__all__ = ["TorchArchiveError", "load", "load_state_dict", "write_state_dict"]

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
# sizes are checked before anything is allocated: storages together at most this many times the
# archive's size on disk (torch stores them uncompressed; a deflated zip bomb declares a thousandfold),
# and tensors together at most this many times their storages (tied weights view one storage twice)
MAX_EXPANSION = 16
MAX_VIEWS = 4
MIN_BUDGET = 16 << 20


class TorchArchiveError(QtoolError):
    """A checkpoint that cannot be read safely (bad format or a refused global)."""


# ---------------------------------------------------------------- storages and tensors

class _Frozen:
    """Base of every object ``find_class`` hands out: a pickle cannot modify it (BUILD fails)."""

    __slots__ = ()

    def __setattr__(self, name, value):
        raise TorchArchiveError(f"refused to modify {self!r}")

    def __setstate__(self, state):
        raise TorchArchiveError(f"refused to modify {self!r}")


class _StorageType(_Frozen):
    """Stand-in for ``torch.FloatStorage`` etc.: only carries the element dtype."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype: str):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "dtype", np.dtype(dtype))  # bfloat16 is read as uint16, widened later

    def __repr__(self):
        return f"torch.{self.name}"


# torch storage class name -> numpy dtype of one element (little-endian as stored)
_STORAGE_DTYPES = {
    "FloatStorage": "<f4", "DoubleStorage": "<f8", "HalfStorage": "<f2",
    "BFloat16Storage": "<u2", "LongStorage": "<i8", "IntStorage": "<i4",
    "ShortStorage": "<i2", "CharStorage": "i1", "ByteStorage": "u1", "BoolStorage": "?",
    "UntypedStorage": "u1",
}
_STORAGE_TYPES = {name: _StorageType(name, dt) for name, dt in _STORAGE_DTYPES.items()}


class _Storage:
    """Raw bytes of one storage (filled late for the legacy format), or a view of one."""

    def __init__(self, stype: _StorageType, numel: int, key: str, base=None, byte_offset=0):
        self.stype, self.numel, self.key = stype, int(numel), str(key)
        self.base, self.byte_offset = base, byte_offset
        self._data = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.stype.dtype.itemsize

    @property
    def data(self) -> bytes:
        if self.base is not None:
            return self.base.data[self.byte_offset:self.byte_offset + self.nbytes]
        if self._data is None:
            raise TorchArchiveError(f"storage {self.key!r} is referenced but its data is missing")
        return self._data

    def set_data(self, raw: bytes):
        if len(raw) != self.nbytes:
            raise TorchArchiveError(
                f"storage {self.key!r}: expected {self.nbytes} bytes "
                f"({self.numel} x {self.stype}), found {len(raw)}")
        self._data = raw


class _TensorRef:
    """What ``_rebuild_tensor_v2`` returns; turned into an ndarray once storages are read."""

    def __init__(self, storage, offset, size, stride):
        if not isinstance(storage, _Storage):
            raise TorchArchiveError(f"tensor rebuilt from {type(storage).__name__}, not a storage")
        self.storage, self.offset = storage, int(offset)
        self.size, self.stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
        if len(self.size) != len(self.stride):
            raise TorchArchiveError(f"tensor size {self.size} and stride {self.stride} differ in rank")

    def to_numpy(self, big_endian: bool) -> np.ndarray:
        st = self.storage.stype
        dtype = st.dtype.newbyteorder(">") if big_endian else st.dtype
        if any(d < 0 for d in self.size):
            raise TorchArchiveError(f"tensor with negative size {self.size}")
        n = elems(self.size)  # a python int: never wraps around
        if n > self.storage.numel:  # more elements than its storage holds: overlapping (stride-0) views
            raise TorchArchiveError(
                f"tensor of size {self.size} (stride {self.stride}) has {n} elements but its storage only "
                f"{self.storage.numel}; refusing to expand it")
        if n == 0:
            out = np.zeros(self.size, dtype=dtype)
        else:
            if self.offset < 0 or any(s < 0 for s in self.stride) or any(d < 0 for d in self.size):
                raise TorchArchiveError(
                    f"tensor with negative offset/size/stride: offset {self.offset}, "
                    f"size {self.size}, stride {self.stride}")
            last = self.offset + sum((d - 1) * s for d, s in zip(self.size, self.stride))
            if last >= self.storage.numel:
                raise TorchArchiveError(
                    f"tensor (offset {self.offset}, size {self.size}, stride {self.stride}) "
                    f"reaches element {last} of a storage of {self.storage.numel}")
            item = dtype.itemsize
            out = np.ndarray(self.size, dtype=dtype, buffer=self.storage.data,
                             offset=self.offset * item, strides=[s * item for s in self.stride]).copy()
        out = out.astype(dtype.newbyteorder("="), copy=False)
        if st.name == "BFloat16Storage":  # the high half of a float32
            out = (out.astype(np.uint32) << 16).view(np.float32)
        return out


# ---------------------------------------------------------------- safe stand-ins for globals

def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    return _TensorRef(storage, storage_offset, size, stride)


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _TensorRef(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    return data


def _rebuild_parameter_with_state(data, requires_grad=False, backward_hooks=None, state=None):
    return data


class _TensorClass(_Frozen):
    """Stand-in for ``torch.Tensor`` / ``torch.nn.parameter.Parameter`` as a type argument."""

    __slots__ = ("name",)

    def __init__(self, name):
        object.__setattr__(self, "name", name)

    def __repr__(self):
        return f"torch.{self.name}"


class _Global(_Frozen):
    """A local, side-effect free function standing in for the torch global it is named after."""

    __slots__ = ("name", "fn")

    def __init__(self, name, fn):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "fn", fn)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self):
        return self.name


def _rebuild_from_type_v2(func, new_type, args, state):
    if not (isinstance(func, _Global) and func.fn in _TENSOR_REBUILDERS) or not isinstance(new_type, _TensorClass):
        raise TorchArchiveError("tensor subclass rebuilt with an unexpected function or type")
    return func(*args)


_TENSOR_REBUILDERS = (_rebuild_tensor_v2, _rebuild_tensor, _rebuild_parameter, _rebuild_parameter_with_state)


def _codecs_encode(text, encoding="latin1"):
    # pickle protocol 2 writes a bytes object as _codecs.encode(str, "latin1")
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise TorchArchiveError(f"_codecs.encode called with {type(text).__name__}, {encoding!r}")
    return text.encode("latin1")


class _OrderedDict(collections.OrderedDict):
    """``collections.OrderedDict`` that accepts only the ``_metadata`` state a state_dict carries.

    BUILD applied to the class itself (not an instance) calls this with one argument and fails.
    """

    def __setstate__(self, state):
        if not (isinstance(state, dict) and set(state) <= {"_metadata"}):
            raise TorchArchiveError(f"refused OrderedDict state with keys {sorted(map(str, state))[:5]}"
                                    if isinstance(state, dict) else "refused OrderedDict state")
        self.__dict__.update(state)


_ALLOWED: Dict[tuple, Any] = {
    ("collections", "OrderedDict"): _OrderedDict,
    ("torch", "Tensor"): _TensorClass("Tensor"),
    ("torch.nn.parameter", "Parameter"): _TensorClass("Parameter"),
}
for _mod, _fn in [("torch._utils", _rebuild_tensor_v2), ("torch._utils", _rebuild_tensor),
                  ("torch._utils", _rebuild_parameter), ("torch._utils", _rebuild_parameter_with_state),
                  ("torch._tensor", _rebuild_from_type_v2), ("_codecs", None)]:
    _name = _fn.__name__ if _fn is not None else "encode"
    _ALLOWED[(_mod, _name)] = _Global(f"{_mod}.{_name}", _fn or _codecs_encode)
for _name, _st in _STORAGE_TYPES.items():
    _ALLOWED[("torch", _name)] = _st
    _ALLOWED[("torch.storage", _name)] = _st


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals in ``_ALLOWED``; storages come through ``persistent_load``."""

    def __init__(self, fp, path, persistent_load):
        super().__init__(fp, encoding="utf-8")
        self._path = path
        self._persistent = persistent_load

    def find_class(self, module, name):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise TorchArchiveError(
                f"{self._path}: refused to load global '{module}.{name}': this reader only "
                f"accepts plain tensors and dicts of tensors (weights), never code") from None

    def persistent_load(self, pid):
        return self._persistent(pid)


def _unpickle(fp, path, persistent_load=None):
    def no_persistent(pid):
        raise TorchArchiveError(f"{path}: unexpected persistent id {pid!r}")
    try:
        return _RestrictedUnpickler(fp, path, persistent_load or no_persistent).load()
    except TorchArchiveError:
        raise
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError,
            IndexError, KeyError, UnicodeDecodeError, struct.error, OverflowError) as e:
        raise TorchArchiveError(f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})") from None
    except RecursionError:
        raise TorchArchiveError(f"{path}: not a readable PyTorch checkpoint (objects nested too deeply)") from None
    except MemoryError:
        raise TorchArchiveError(f"{path}: not a readable PyTorch checkpoint (it declares more memory than there is)") from None


def _storage_type(obj, path):
    if isinstance(obj, _StorageType):
        return obj
    raise TorchArchiveError(f"{path}: storage type {obj!r} is not a known torch storage class")


class _Capped:
    """A file whose read(n) never asks for more than the file has left: the unpickler trusts the
    lengths a pickle declares, and FileIO.read(n) allocates n bytes before it reads."""

    def __init__(self, f, size):
        self.f, self.size = f, size

    def _left(self, n):
        left = max(self.size - self.f.tell(), 0)
        return left if n is None or n < 0 else min(n, left)

    def read(self, n=-1):
        return self.f.read(self._left(n))

    def readinto(self, b):
        return self.f.readinto(memoryview(b)[:self._left(len(b))])

    def readline(self, n=-1):
        return self.f.readline(self._left(n))

    def tell(self):
        return self.f.tell()


def _materialize_all(obj, big_endian, path, storage_bytes):
    """_materialize, after checking that the tensors together stay within MAX_VIEWS x their storages."""
    total, stack, seen = 0, [obj], 0
    while stack:
        o = stack.pop()
        seen += 1
        if seen > 10_000_000:
            raise TorchArchiveError(f"{path}: too many objects")
        if isinstance(o, _TensorRef):
            total += elems(o.size) * o.storage.stype.dtype.itemsize
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    budget = MAX_VIEWS * storage_bytes + MIN_BUDGET
    if total > budget:
        raise TorchArchiveError(f"{path}: its tensors would take {human_bytes(total)}, more than {MAX_VIEWS}x the "
                                f"{human_bytes(storage_bytes)} of data it holds; refusing to expand them")
    try:
        return _materialize(obj, big_endian)
    except RecursionError:
        raise TorchArchiveError(f"{path}: objects nested too deeply") from None


def _materialize(obj, big_endian):
    """Replace every _TensorRef in a tree of dicts/lists/tuples by an ndarray."""
    if isinstance(obj, _TensorRef):
        return obj.to_numpy(big_endian)
    if isinstance(obj, dict):
        out = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _materialize(v, big_endian)
        return out
    if isinstance(obj, list):
        return [_materialize(v, big_endian) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_materialize(v, big_endian) for v in obj)
    return obj


# ---------------------------------------------------------------- the two formats

def _budget(path) -> int:
    return max(MAX_EXPANSION * os.path.getsize(path), MIN_BUDGET)


def _load_zip(path) -> Any:
    budget = _budget(path)
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        pkls = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            hint = " (a TorchScript archive?)" if any(n.endswith("constants.pkl") for n in names) else ""
            raise TorchArchiveError(f"{path}: zip checkpoint needs exactly one <name>/data.pkl, "
                                    f"found {len(pkls)}{hint}")
        prefix = pkls[0][: -len("data.pkl")]
        big_endian = False
        if prefix + "byteorder" in names:
            big_endian = zf.read(prefix + "byteorder").strip() == b"big"
        storages: Dict[str, _Storage] = {}
        used = [0]
        pkl = zf.getinfo(pkls[0])
        if pkl.file_size > budget:
            raise TorchArchiveError(f"{path}: {pkls[0]} unpacks to {human_bytes(pkl.file_size)}; refusing to inflate it")

        def persistent_load(pid):
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                raise TorchArchiveError(f"{path}: unexpected persistent id {pid!r}")
            _, stype, key, _location, numel = pid
            key = str(key)
            if key not in storages:
                st = _Storage(_storage_type(stype, path), numel, key)
                entry = f"{prefix}data/{key}"
                if entry not in names:
                    raise TorchArchiveError(f"{path}: storage {entry} is missing")
                size = zf.getinfo(entry).file_size
                if size != st.nbytes:  # checked before reading: no decompression bombs
                    raise TorchArchiveError(f"{path}: storage {entry} holds {size} bytes, "
                                            f"its tensors expect {st.nbytes} ({st.numel} x {st.stype})")
                used[0] += size
                if used[0] > budget:
                    raise TorchArchiveError(f"{path}: its storages unpack to more than {human_bytes(budget)}, "
                                            f"{MAX_EXPANSION}x the archive's size; refusing to inflate it")
                st.set_data(zf.read(entry))
                storages[key] = st
            return storages[key]

        with zf.open(pkls[0]) as fp:
            obj = _unpickle(io.BytesIO(fp.read()), path, persistent_load)
    return _materialize_all(obj, big_endian, path, sum(st.nbytes for st in storages.values()))


def _load_legacy(path, fp) -> Any:
    size = os.fstat(fp.fileno()).st_size
    fp = _Capped(fp, size)

    def header(what):
        try:
            return _unpickle(fp, path)
        except TorchArchiveError as e:
            raise TorchArchiveError(f"{path}: not a PyTorch checkpoint (reading {what}: {e})") from None

    magic = header("magic number")
    if magic != LEGACY_MAGIC:
        raise TorchArchiveError(f"{path}: not a PyTorch checkpoint (bad magic number; the oldest "
                                f"tar-based torch format is not supported)")
    version = header("protocol version")
    if version != LEGACY_PROTOCOL:
        raise TorchArchiveError(f"{path}: legacy checkpoint protocol {version!r} is not supported")
    sys_info = header("system info")
    big_endian = isinstance(sys_info, dict) and sys_info.get("little_endian") is False
    storages: Dict[str, _Storage] = {}

    def persistent_load(pid):
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            kind = pid[0] if isinstance(pid, tuple) and pid else pid
            raise TorchArchiveError(f"{path}: refused persistent id {kind!r} (whole pickled "
                                    f"modules are not supported; save a state_dict)")
        _, stype, root_key, _location, numel, view = pid
        stype = _storage_type(stype, path)
        root_key = str(root_key)
        if root_key not in storages:
            storages[root_key] = _Storage(stype, numel, root_key)
        root = storages[root_key]
        if view is None:
            return root
        view_key, offset, view_size = view
        view_key = str(view_key)
        if view_key not in storages:
            storages[view_key] = _Storage(stype, view_size, view_key, base=root,
                                          byte_offset=int(offset) * stype.dtype.itemsize)
        return storages[view_key]

    obj = _unpickle(fp, path, persistent_load)
    keys = header("storage keys")
    if not isinstance(keys, list):
        raise TorchArchiveError(f"{path}: storage key list is a {type(keys).__name__}")
    for key in keys:
        st = storages.get(str(key))
        if st is None or st.base is not None:
            raise TorchArchiveError(f"{path}: storage key {key!r} was never referenced")
        raw = fp.read(8)
        if len(raw) != 8:
            raise TorchArchiveError(f"{path}: truncated before storage {key!r}")
        (numel,) = struct.unpack("<q" if not big_endian else ">q", raw)
        if numel != st.numel:
            raise TorchArchiveError(f"{path}: storage {key!r} holds {numel} elements, "
                                    f"tensors expect {st.numel}")
        left = size - fp.tell()
        if st.nbytes > left:  # checked before reading: a count of 1e12 allocates nothing
            raise TorchArchiveError(f"{path}: storage {key!r} declares {st.nbytes} bytes, the file has {left} left")
        st.set_data(fp.read(st.nbytes))
    return _materialize_all(obj, big_endian, path, sum(st.nbytes for st in storages.values() if st.base is None))


# ---------------------------------------------------------------- public API

def load(path) -> Any:
    """The object tree of a checkpoint, with every tensor as a numpy array.

    Dicts stay dicts (OrderedDicts stay ordered), lists and tuples stay as they
    are. Raises ``TorchArchiveError`` for anything else, without running it.
    """
    path = os.fspath(path)
    if os.path.exists(path) and not is_regular_file(path):  # a FIFO would block the reader for ever
        raise TorchArchiveError(f"{path}: cannot read (not a regular file)")
    try:
        if zipfile.is_zipfile(path):
            return _load_zip(path)
        with open(path, "rb") as fp:
            return _load_legacy(path, fp)
    except OSError as e:
        raise TorchArchiveError(f"{path}: cannot read ({e.strerror or e})") from None
    except (zipfile.BadZipFile, NotImplementedError) as e:
        raise TorchArchiveError(f"{path}: damaged zip checkpoint ({e})") from None


def _flatten(obj, prefix, out):
    for k, v in obj.items():
        name = f"{prefix}{k}"
        if isinstance(v, np.ndarray):
            out[name] = v
        elif isinstance(v, Mapping):
            _flatten(v, name + ".", out)


def load_state_dict(path) -> Dict[str, np.ndarray]:
    """Parameter name -> numpy array, in the file's order.

    A training checkpoint that wraps the weights (``{"state_dict": ...}``,
    ``{"model_state_dict": ...}``, ``{"model": ...}``) is unwrapped; nested dicts
    are flattened with dots; entries that are not tensors are dropped.
    """
    obj = load(path)
    if not isinstance(obj, Mapping):
        raise TorchArchiveError(f"{path}: holds a {type(obj).__name__}, not a dict of tensors")
    for key in ("state_dict", "model_state_dict", "model"):
        if isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    out: Dict[str, np.ndarray] = collections.OrderedDict()
    _flatten(obj, "", out)
    if not out:
        raise TorchArchiveError(f"{path}: no tensors found")
    return out


# ---------------------------------------------------------------- writer (zip format)

_DTYPE_TO_STORAGE = {
    np.dtype(np.float32): "FloatStorage", np.dtype(np.float64): "DoubleStorage",
    np.dtype(np.float16): "HalfStorage", np.dtype(np.int64): "LongStorage",
    np.dtype(np.int32): "IntStorage", np.dtype(np.int16): "ShortStorage",
    np.dtype(np.int8): "CharStorage", np.dtype(np.uint8): "ByteStorage",
    np.dtype(np.bool_): "BoolStorage",
}


class _OpWriter:
    """Just enough pickle protocol 2 opcodes to write a state_dict as torch.save does."""

    def __init__(self):
        self.buf = io.BytesIO()
        self.buf.write(b"\x80\x02")  # PROTO 2

    def op(self, b: bytes):
        self.buf.write(b)

    def glob(self, module, name):
        self.op(b"c" + module.encode() + b"\n" + name.encode() + b"\n")  # GLOBAL

    def string(self, s: str):
        raw = s.encode("utf-8")
        self.op(b"X" + struct.pack("<I", len(raw)) + raw)  # BINUNICODE

    def int(self, v: int):
        if 0 <= v < 2 ** 31:
            self.op(b"J" + struct.pack("<i", v))  # BININT
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.op(b"\x8a" + bytes([len(raw)]) + raw)  # LONG1

    def int_tuple(self, values):
        self.op(b"(")  # MARK
        for v in values:
            self.int(int(v))
        self.op(b"t")  # TUPLE

    def empty_ordered_dict(self):
        self.glob("collections", "OrderedDict")
        self.op(b")R")  # EMPTY_TUPLE, REDUCE


def write_state_dict(path, arrays: Mapping[str, np.ndarray], archive_name: str = "archive"):
    """Write name -> array as a zip-format checkpoint that ``torch.load`` reads.

    Each array gets its own contiguous storage. Written atomically (temp file +
    os.replace).
    """
    path = os.fspath(path)
    w = _OpWriter()
    w.empty_ordered_dict()
    w.op(b"(")  # MARK for SETITEMS
    blobs = []
    for i, (name, arr) in enumerate(arrays.items()):
        arr = np.asarray(arr)
        stype = _DTYPE_TO_STORAGE.get(arr.dtype)
        if stype is None:
            raise TorchArchiveError(f"{name}: dtype {arr.dtype} has no torch storage type")
        key = str(i)
        blobs.append((key, np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()))
        w.string(name)
        w.glob("torch._utils", "_rebuild_tensor_v2")
        w.op(b"(")  # MARK args
        w.op(b"(")  # MARK persistent id
        w.string("storage")
        w.glob("torch", stype)
        w.string(key)
        w.string("cpu")
        w.int(arr.size)
        w.op(b"tQ")  # TUPLE, BINPERSID
        w.int(0)
        w.int_tuple(arr.shape)
        strides = [s // arr.itemsize for s in np.ascontiguousarray(arr).strides] if arr.ndim else []
        w.int_tuple(strides)
        w.op(b"\x89")  # NEWFALSE (requires_grad)
        w.empty_ordered_dict()  # backward_hooks
        w.op(b"tR")  # TUPLE, REDUCE
    w.op(b"u.")  # SETITEMS, STOP
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
            zf.writestr(f"{archive_name}/data.pkl", w.buf.getvalue())
            zf.writestr(f"{archive_name}/byteorder", "little")
            for key, raw in blobs:
                zf.writestr(f"{archive_name}/data/{key}", raw)
            zf.writestr(f"{archive_name}/version", "3\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
