"""Calibration data as tensors: a folder of .npy / .npz files, or any iterable of input dicts.

- `.npy`: one sample per file, for a model with one float input; shape [C, H, W] (the
  batch axis is added) or the model input's full rank ([1, C, H, W] or [N, C, H, W]).
- `.npz`: one sample per file, one array per model input, named by the input's name.
- Python: any iterable of {input name: array}, or of arrays for a one-input model
  (`qtool.api.calibrate(model, data=iterable)`).

Shapes come from the data: every static dim of the model input must match, dynamic dims
take whatever the sample has, and nothing is pinned, so dynamic dims stay dynamic in
the int8 model. Integer inputs (token ids, masks, sizes) are fed as they are and never
quantized. Every file is checked before any inference runs: a wrong shape or dtype, a
missing input, or images mixed with tensors is one QtoolError naming the file.
"""
from __future__ import annotations

import os
import zipfile

import numpy as np
import onnx
from onnx import helper

from qtool import graph as G
from qtool.data.images import IMAGE_EXTS
from qtool.errors import QtoolError
from qtool.limits import MAX_SAMPLE_BYTES, elems, human_bytes, regular_file, walk

TENSOR_EXTS = (".npy", ".npz")


class ModelInputSpec:
    """A real graph input: name, numpy dtype, dims (ints where static, None where dynamic)."""

    def __init__(self, vi: onnx.ValueInfoProto):
        self.name = vi.name
        et = vi.type.tensor_type.elem_type
        self.dtype = np.dtype(helper.tensor_dtype_to_np_dtype(et)) if et else np.dtype(np.float32)
        self.dims = [d if isinstance(d, int) else None for d in G.input_dims(vi)]
        self.has_shape = vi.type.tensor_type.HasField("shape")

    @property
    def is_float(self) -> bool:
        return self.dtype == np.float32

    def describe(self) -> str:
        kind = "string" if self.dtype == np.dtype(object) else self.dtype.name
        return f"{kind}[{', '.join('?' if d is None else str(d) for d in self.dims)}]"


def model_inputs(model: onnx.ModelProto) -> list:
    return [ModelInputSpec(i) for i in G.real_inputs(model)]


def classify_folder(folder: str) -> str:
    """'images', 'npy' or 'npz' for a data folder; one error if it mixes kinds or has none."""
    if not os.path.exists(folder):
        raise QtoolError(f"{folder}: no such data folder")
    if not os.path.isdir(folder):
        raise QtoolError(f"{folder}: not a folder")
    kinds = {}
    for root, dirs, names in walk(folder):
        dirs.sort()
        for n in sorted(names):
            low = n.lower()
            kind = "images" if low.endswith(IMAGE_EXTS) else low.rsplit(".", 1)[-1] if low.endswith(TENSOR_EXTS) else None
            if kind:
                kinds.setdefault(kind, os.path.join(root, n))
    if len(kinds) > 1:
        ex = ", ".join(f"{k} ({v})" for k, v in sorted(kinds.items()))
        raise QtoolError(f"{folder}: mixes data kinds: {ex}; one folder holds only images, only .npy or only .npz files")
    return next(iter(kinds), "images")


def list_tensor_files(folder: str, ext: str) -> list:
    files = []
    for root, dirs, names in walk(folder):
        dirs.sort()
        files.extend(os.path.join(root, n) for n in names if n.lower().endswith(ext))
    files.sort(key=lambda p: os.path.relpath(p, folder))
    return files


def _check_names(arrays: list, inputs: list, where: str) -> None:
    """One array per model input, by name: none missing, none extra."""
    names = {i.name for i in inputs}
    missing = [i.name for i in inputs if i.name not in arrays]
    if missing:
        raise QtoolError(f"{where}: no array for model input{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(repr(m) for m in missing)} (has: {', '.join(repr(k) for k in arrays) or 'none'})")
    extra = [k for k in arrays if k not in names]
    if extra:
        raise QtoolError(f"{where}: array{'s' if len(extra) > 1 else ''} {', '.join(repr(e) for e in extra)} "
                         f"match{'' if len(extra) > 1 else 'es'} no model input (inputs: {', '.join(sorted(names))})")


def check_sample(feeds: dict, inputs: list, where: str) -> dict:
    """Validate one sample against the model inputs; returns feeds with the batch axis present.

    A float input needs float32 (float64/float16 are refused, not silently cast: the caller
    should know its data is not what the model eats); an integer input needs its exact dtype.
    """
    _check_names(list(feeds), inputs, where)
    out = {}
    for spec in inputs:
        x = feeds[spec.name]
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
        if check_array(spec, x.shape, x.dtype, where) != x.shape:
            x = x[None]
        out[spec.name] = np.ascontiguousarray(x)
    return out


def check_array(spec: ModelInputSpec, shape: tuple, dtype, where: str) -> tuple:
    """The shape the array is fed with (the batch axis added when it lacks one), or one error."""
    shape = tuple(shape)
    # (a string input: ONNX Runtime takes a numpy unicode array as it is; object arrays would need pickle)
    text = spec.dtype == np.dtype(object) and np.dtype(dtype).kind == "U"
    if np.dtype(dtype) != spec.dtype and not text:
        raise QtoolError(f"{where}: input '{spec.name}' is {np.dtype(dtype).name} {list(shape)}, "
                         f"the model wants {spec.describe()}")
    if not spec.has_shape:
        return shape
    fed = (1,) + shape if len(shape) == len(spec.dims) - 1 else shape
    if len(fed) != len(spec.dims) or any(d is not None and d != s for d, s in zip(spec.dims, fed)):
        raise QtoolError(f"{where}: input '{spec.name}' has shape {list(shape)}, the model wants {spec.describe()}")
    return fed


def _array_header(f, where: str, size: int):
    """(shape, dtype) from a .npy stream positioned at its start, checked against the bytes that
    follow the header (`size`: the stream's total length) and MAX_SAMPLE_BYTES, before any data is read."""
    major, _ = np.lib.format.read_magic(f)
    shape, _fortran, dtype = (np.lib.format.read_array_header_1_0(f) if major == 1
                              else np.lib.format.read_array_header_2_0(f))
    if dtype.hasobject:
        raise QtoolError(f"{where}: holds Python objects, not numbers; refusing to unpickle them (strings for a "
                         f"string input: save a unicode array, np.array(words), which needs no pickle)")
    nbytes = elems(shape) * dtype.itemsize
    if nbytes > MAX_SAMPLE_BYTES:
        raise QtoolError(f"{where}: header declares {dtype.name} {list(shape)} ({human_bytes(nbytes)}), over the "
                         f"limit of {human_bytes(MAX_SAMPLE_BYTES)} per array")
    have = size - f.tell()
    if have < nbytes:
        raise QtoolError(f"{where}: header declares {dtype.name} {list(shape)} ({nbytes} bytes) but the file holds "
                         f"{max(have, 0)} bytes of data")
    return shape, dtype


def _npy_header(path: str):
    """(shape, dtype) of a .npy file without reading its data."""
    regular_file(path, ".npy file")
    try:
        with open(path, "rb") as f:
            return _array_header(f, path, os.fstat(f.fileno()).st_size)
    except (OSError, ValueError, EOFError) as e:
        raise QtoolError(f"{path}: not a readable .npy file ({e})") from None


def _npz_headers(path: str) -> dict:
    """array name -> (shape, dtype) of a .npz file, from each member's header (nothing is inflated
    beyond the headers: a 7 MB file may declare gigabytes)."""
    regular_file(path, ".npz file")
    out, total = {}, 0
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if info.is_dir():
                    continue
                name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                with zf.open(info) as f:
                    shape, dtype = _array_header(f, f"{path} ({name})", info.file_size)
                total += elems(shape) * dtype.itemsize
                if total > MAX_SAMPLE_BYTES:
                    raise QtoolError(f"{path}: its arrays total more than {human_bytes(MAX_SAMPLE_BYTES)}, the limit "
                                     f"per sample")
                out[name] = (shape, dtype)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, NotImplementedError) as e:
        raise QtoolError(f"{path}: not a readable .npz file ({e})") from None
    return out


def _load_npy(path: str) -> np.ndarray:
    _npy_header(path)
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise QtoolError(f"{path}: not a readable .npy file ({e})") from None


def _load_npz(path: str) -> dict:
    _npz_headers(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, NotImplementedError) as e:
        raise QtoolError(f"{path}: not a readable .npz file ({e})") from None


def check_headers(headers: dict, inputs: list, where: str) -> None:
    """check_sample from headers alone: every model input present, no extra array, shapes and dtypes right."""
    _check_names(list(headers), inputs, where)
    for spec in inputs:
        check_array(spec, *headers[spec.name], where)


class TensorData:
    """Batches {input name: array} from .npy/.npz files or an iterable of dicts.

    Same interface as ImageData: `files`, `skipped`, `pins`, `__len__`, `batches()`.
    Consecutive samples of equal shapes are stacked into batches of up to `batch` when
    every input's batch dim is dynamic; otherwise each sample runs alone.
    """

    kind = "tensors"

    def _whole(self, shapes: dict) -> bool:
        """A file is one sample: where one of its arrays already has the model's rank and more than one
        row on axis 0, that axis is the sample's own (madmom's [frames, bins] spectrogram), not a batch
        to cut into rows or join with other files. Such files run one at a time, whole."""
        return any(spec.dims and spec.dims[0] is None and len(shapes[spec.name]) == len(spec.dims)
                   and shapes[spec.name][0] != 1 for spec in self.inputs if spec.name in shapes)

    def __init__(self, model: onnx.ModelProto, model_path: str, batch: int = 8):
        self.inputs = model_inputs(model)
        if not self.inputs:
            raise QtoolError(f"{model_path}: model has no inputs to feed")
        # (integer-only inputs, token or byte ids, are fine: the activations after the lookup are float)
        self.float_inputs = [i for i in self.inputs if i.is_float]
        dyn_batch = all(i.dims and i.dims[0] is None for i in self.inputs)
        self.batch = max(1, batch) if dyn_batch else 1
        self.files: list = []
        self.skipped: list = []
        self.cfg = None

    @property
    def pins(self) -> dict:
        return {}  # shapes come from the data; nothing is pinned, dynamic dims stay dynamic

    @property
    def input_name(self) -> str:
        return (self.float_inputs or self.inputs)[0].name

    def __len__(self):
        return len(self.files)

    def samples(self):
        """(name, feeds) per sample, validated."""
        raise NotImplementedError

    def batches(self):
        names, group = [], []

        def flush():
            feeds = {k: np.concatenate([g[k] for g in group]) if len(group) > 1 else group[0][k] for k in group[0]}
            return list(names), feeds

        for name, feeds in self.samples():
            if group and (len(group) >= self.batch or any(feeds[k].shape[1:] != group[0][k].shape[1:] for k in feeds)):
                yield flush()
                names, group = [], []
            names.append(name)
            group.append(feeds)
        if group:
            yield flush()


class NpyFolder(TensorData):
    kind = "npy"

    def __init__(self, folder: str, model: onnx.ModelProto, model_path: str, batch: int = 8,
                 files: list | None = None, limit: int | None = None):
        super().__init__(model, model_path, batch)
        if len(self.inputs) != 1:
            raise QtoolError(f"{folder}: .npy files hold one array, but {model_path} has {len(self.inputs)} inputs "
                             f"({', '.join(i.name for i in self.inputs)}); use .npz files with one array per input")
        files = list_tensor_files(folder, ".npy") if files is None else files
        if not files:
            raise QtoolError(f"{folder}: no .npy files")
        self.files = files[:limit] if limit else files
        whole = False
        for f in self.files:  # headers only: every file is checked before any inference runs
            shape, dtype = _npy_header(f)
            check_array(self.inputs[0], shape, dtype, f)
            whole = whole or self._whole({self.inputs[0].name: shape})
        self.batch = 1 if whole else self.batch

    def samples(self):
        for f in self.files:
            yield f, check_sample({self.inputs[0].name: _load_npy(f)}, self.inputs, f)


class NpzFolder(TensorData):
    kind = "npz"

    def __init__(self, folder: str, model: onnx.ModelProto, model_path: str, batch: int = 8,
                 files: list | None = None, limit: int | None = None):
        super().__init__(model, model_path, batch)
        files = list_tensor_files(folder, ".npz") if files is None else files
        if not files:
            raise QtoolError(f"{folder}: no .npz files")
        self.files = files[:limit] if limit else files
        whole = False
        for f in self.files:  # headers only: every file is checked before any inference runs
            headers = _npz_headers(f)
            check_headers(headers, self.inputs, f)
            whole = whole or self._whole({k: sh for k, (sh, _) in headers.items()})
        self.batch = 1 if whole else self.batch

    def samples(self):
        for f in self.files:
            yield f, check_sample(_load_npz(f), self.inputs, f)


class IterableData(TensorData):
    """Any iterable of {input name: array}, or of plain arrays for a one-input model (one sample
    [C, H, W] or a batch [N, C, H, W] each); checked sample by sample as it streams (calibration
    writes nothing until the whole iterable has been consumed)."""

    kind = "iterable"

    def __init__(self, data, model: onnx.ModelProto, model_path: str, batch: int = 8, limit: int | None = None):
        super().__init__(model, model_path, batch)
        if isinstance(data, dict):
            raise QtoolError("data: pass an iterable of input dicts (e.g. a list of them), not one dict")
        self._data = data
        self.limit = limit
        try:
            self._n = len(data) if limit is None else min(len(data), limit)
        except TypeError:
            self._n = limit or 0

    def __len__(self):
        return self._n

    def samples(self):
        for k, feeds in enumerate(self._data):
            if self.limit is not None and k >= self.limit:
                break
            where = f"sample {k}"
            if not isinstance(feeds, dict):
                if len(self.inputs) != 1 or isinstance(feeds, (str, bytes, tuple)) or not hasattr(feeds, "__array__") \
                        and not isinstance(feeds, list):
                    need = ("a dict input name -> array" if len(self.inputs) != 1 else
                            f"an array for input '{self.inputs[0].name}' (or a dict input name -> array)")
                    raise QtoolError(f"{where}: expected {need}, got {type(feeds).__name__}"
                                     + (" (a (data, label) pair? pass the data only)" if isinstance(feeds, tuple) else ""))
                feeds = {self.inputs[0].name: feeds}  # a one-input model: the array alone
            self.files.append(where)
            # copied: batching reads the next sample before the last batch goes out, and a
            # caller may refill one array for every sample
            yield where, {k: np.array(v) for k, v in check_sample(feeds, self.inputs, where).items()}


def tensor_source(data, model: onnx.ModelProto, model_path: str, batch: int = 8, files: list | None = None,
                  limit: int | None = None, every: int = 1):
    """The tensor data source for `data` (folder or iterable), or None when `data` is an image folder."""
    if not isinstance(data, (str, os.PathLike)):
        if every != 1:
            data = (x for k, x in enumerate(data) if k % every == 0)
        return IterableData(data, model, model_path, batch, limit)
    folder = os.fspath(data)
    kind = classify_folder(folder)
    if kind == "images":
        return None
    files = list_tensor_files(folder, "." + kind) if files is None else files
    files = files[::every]
    cls = NpyFolder if kind == "npy" else NpzFolder
    return cls(folder, model, model_path, batch, files=files, limit=limit)


def tensor_batches(files: list, model: onnx.ModelProto, model_path: str, batch: int = 8):
    """(names, feeds) batches for a list of recorded .npy or .npz files (as the calibrate manifest lists
    them): what later steps (sensitivity, eval) use to re-read tensor calibration data."""
    if not files:
        return
    ext = os.path.splitext(files[0])[1].lower()
    if ext not in TENSOR_EXTS or any(os.path.splitext(f)[1].lower() != ext for f in files):
        raise QtoolError(f"{files[0]}: expected only .npy or only .npz files")
    cls = NpyFolder if ext == ".npy" else NpzFolder
    yield from cls(os.path.dirname(files[0]), model, model_path, batch, files=files).batches()


def is_tensor_file(path: str) -> bool:
    return path.lower().endswith(TENSOR_EXTS)
