"""Limits on what untrusted input may make qtool allocate, and the checks that apply them.

Models, weight archives, images and tensor files are untrusted: a few hundred bytes can declare
gigabytes (a 60000 x 1 PNG resized by its shorter side, a ConstantOfShape of [1e5, 1e5], a .npy
header claiming 114 GiB, a zip entry that inflates a thousandfold). Every reader checks here,
from headers and shapes, *before* it decodes, evaluates or allocates; what is over a limit is
refused with one line naming the file, or (images) skipped and counted.
"""
from __future__ import annotations

import math
import os
import stat

import numpy as np

from qtool.errors import QtoolError

# images: decoded pixels (Pillow reads the size from the header before decoding), and the size
# any resize may produce (the shorter side to 256 makes a 60000 x 1 PNG 256 x 15.36M pixels)
MAX_IMAGE_PIXELS = 1 << 26  # 67M: a 50-megapixel camera's photo
MAX_RESIZED_PIXELS = 1 << 24  # 16.7M: a 4096 x 4096 model input
MAX_INPUT_SIDE = 16384  # a preprocessing config's size / resize_to

# tensors: one array of a .npy / .npz sample, from its header
MAX_SAMPLE_BYTES = 1 << 30

# constants computed from the graph (fuse/fold_constants at load, the runtime's folding)
MAX_FOLD_ELEMS = 1 << 22  # one folded tensor
MAX_FOLD_TOTAL_BYTES = 1 << 28  # every value computed while folding one graph

# user data nested in depth: a data folder's subfolders, a TOML document's arrays and tables
MAX_FOLDER_DEPTH = 256
MAX_TOML_DEPTH = 32

# numeric options
MAX_BATCH = 1024
MAX_FEED_BYTES = 1 << 30  # one batch of generated inputs (bench)


def regular_file(path: str, what: str = "file") -> str:
    """`path` if it is a regular file (after symlinks); otherwise one error. A FIFO named
    x.jpg or model.onnx would block the reader forever, a device would never end."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise QtoolError(f"{path}: no such {what}") from None
    except OSError as e:
        raise QtoolError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise QtoolError(f"{path}: is a folder, not a {what}")
    if not stat.S_ISREG(st.st_mode):
        raise QtoolError(f"{path}: not a regular file ({_kind(st.st_mode)}); refusing to read it as a {what}")
    return path


def walk(folder: str):
    """os.walk(folder) (top down, symlinked folders not followed, unreadable ones skipped), each folder's
    entries sorted, without recursion: Python 3.11's os.walk recurses once per level, and a data folder
    nested 1,200 deep raised RecursionError. Past MAX_FOLDER_DEPTH levels: one error."""
    stack = [(folder, 0)]
    while stack:
        root, depth = stack.pop()
        try:
            with os.scandir(root) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        dirs, names, down = [], [], []
        for e in entries:
            try:
                is_dir = e.is_dir()
            except OSError:
                is_dir = False
            (dirs if is_dir else names).append(e.name)
            if is_dir and not e.is_symlink():
                down.append(e.name)
        yield root, dirs, names
        if down and depth >= MAX_FOLDER_DEPTH:
            raise QtoolError(f"{folder}: folders nested deeper than {MAX_FOLDER_DEPTH} levels (below {root[:200]}...)")
        stack.extend((os.path.join(root, d), depth + 1) for d in reversed(down))


def toml_depth_ok(text: str, source: str) -> None:
    """One error when a TOML document nests arrays or inline tables deeper than MAX_TOML_DEPTH (tomllib
    parses them recursively: a `qtool.config` of 50,000 brackets in a model's metadata raised
    RecursionError). Brackets in strings and comments are not counted; a table header's are closed at once."""
    depth, deepest, quote, k, n = 0, 0, None, 0, len(text)
    while k < n:
        ch = text[k]
        if quote:
            if text.startswith(quote, k):
                k += len(quote)
                quote = None
                continue
            k += 2 if ch == "\\" and quote in ('"', '"""') else 1
            continue
        if ch in "\"'":
            quote = text[k:k + 3] if text[k:k + 3] in ('"""', "'''") else ch
            k += len(quote)
            continue
        if ch == "#":
            end = text.find("\n", k)
            k = n if end < 0 else end
            continue
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_TOML_DEPTH:
                raise QtoolError(f"{source}: arrays or tables nested deeper than {MAX_TOML_DEPTH} levels")
        elif ch in "]}":
            depth = max(depth - 1, 0)
        k += 1


def is_regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a plain file"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def elems(shape) -> int:
    """Elements of a shape, as a Python int (never overflows); negative dims count as 0."""
    n = 1
    for d in shape:
        n *= max(int(d), 0)
    return n


# ---------------------------------------------------------------- folding: the size before evaluating

def _broadcast(shapes) -> int | None:
    out = []
    for s in shapes:
        s = list(s)
        if len(s) > len(out):
            out = [1] * (len(s) - len(out)) + out
        s = [1] * (len(out) - len(s)) + s
        for k, (a, b) in enumerate(zip(out, s)):
            if a != b and 1 not in (a, b):
                return None  # not broadcastable: the op fails, nothing to fear
            out[k] = max(a, b) if 0 not in (a, b) else 0
    return elems(out)


# ops whose output has at most as many elements as their largest input (or all inputs together)
_NOT_GROWING = {
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos", "Cosh", "Erf", "Exp", "Floor", "Identity",
    "IsInf", "IsNaN", "Log", "Neg", "Not", "Reciprocal", "Relu", "Round", "Sigmoid", "Sign", "Sin", "Sinh", "Sqrt",
    "Tan", "Tanh", "Softplus", "Softsign", "HardSigmoid", "HardSwish", "LeakyRelu", "Elu", "Selu", "Celu", "Gelu",
    "Mish", "ThresholdedRelu", "Clip", "Cast", "CastLike", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten",
    "Slice", "Split", "Concat", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
    "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin", "Shape", "Size", "Softmax",
    "LogSoftmax", "Hardmax", "CumSum", "Trilu", "Compress", "TopK", "Unique", "ScatterElements", "ScatterND",
    "Scatter", "GatherElements", "DepthToSpace", "SpaceToDepth", "ReverseSequence", "Dropout", "NonZero",
    "BatchNormalization", "InstanceNormalization", "LayerNormalization", "LpNormalization", "MeanVarianceNormalization",
    "Det", "SplitToSequence", "QuantizeLinear", "DequantizeLinear",
}
_BROADCASTING = {
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Where", "Equal", "Less", "LessOrEqual",
    "Greater", "GreaterOrEqual", "And", "Or", "Xor", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "PRelu",
}


def _ints(v) -> list | None:
    try:
        return [int(x) for x in np.asarray(v).reshape(-1)]
    except (TypeError, ValueError, OverflowError):
        return None


def fold_elems(op: str, ins: list, attrs: dict) -> int | None:
    """An upper bound on the elements of the largest output of `op` on the constant inputs `ins`
    (numpy arrays, None for an absent optional input) with attributes `attrs` (python values),
    computed without running it; None when no bound is known (then it must not be evaluated)."""
    shapes = [() if x is None else np.shape(x) for x in ins]
    sizes = [0 if x is None else int(np.size(x)) for x in ins]
    biggest = max(sizes, default=1)
    try:
        if op in _NOT_GROWING:
            n = sum(sizes) if op in ("Concat",) else biggest
            return n * max(len(shapes[0]), 1) if op == "NonZero" else n
        if op in _BROADCASTING:
            return _broadcast(s for s, x in zip(shapes, ins) if x is not None)
        if op == "ConstantOfShape":
            v = _ints(ins[0]) if ins else None
            return None if v is None else elems(v)
        if op == "Expand":
            v = _ints(ins[1])
            return None if v is None else _broadcast([shapes[0], v])
        if op == "Tile":
            v = _ints(ins[1])
            return None if v is None or len(v) != len(shapes[0]) else elems(a * b for a, b in zip(shapes[0], v))
        if op == "Range":
            start, limit, delta = (float(np.asarray(x).reshape(-1)[0]) for x in ins[:3])
            if delta == 0 or not all(map(math.isfinite, (start, limit, delta))):
                return None
            return max(int(math.ceil((limit - start) / delta)), 0)
        if op == "Pad":
            pads = _ints(ins[1]) if len(ins) > 1 and ins[1] is not None else _ints(attrs.get("pads", []))
            r = len(shapes[0])
            if pads is None or len(pads) != 2 * r:
                return None  # (opset 18 axes: not bounded here)
            return elems(d + a + b for d, a, b in zip(shapes[0], pads[:r], pads[r:]))
        if op == "Gather":
            axis = int(attrs.get("axis", 0))
            d = shapes[0][axis] if shapes[0] else 1
            return sizes[1] * (sizes[0] // max(d, 1))
        if op == "OneHot":
            depth = _ints(ins[1])
            return None if not depth else sizes[0] * max(depth[0], 0)
        if op in ("MatMul", "Gemm", "MatMulInteger"):
            a, b = shapes[0], shapes[1]
            if op == "Gemm":
                m = a[1] if attrs.get("transA") else a[0]
                n = b[0] if attrs.get("transB") else b[1]
                return m * n
            if len(a) < 2 or len(b) < 2:
                return max(sizes[0], sizes[1])
            batch = _broadcast([a[:-2], b[:-2]])
            return None if batch is None else batch * a[-2] * b[-1]
        if op in ("Resize", "Upsample"):
            x = shapes[0]
            sizes_in = _ints(ins[3]) if len(ins) > 3 and ins[3] is not None and np.size(ins[3]) else None
            if sizes_in is not None:
                return elems(sizes_in)
            sc = ins[2] if op == "Resize" and len(ins) > 2 else ins[1] if op == "Upsample" and len(ins) > 1 else None
            scales = None if sc is None else np.asarray(sc, np.float64).reshape(-1)
            if scales is None or scales.size != len(x) or not np.all(np.isfinite(scales)):
                return None
            return elems(math.floor(d * s) for d, s in zip(x, scales))
    except (IndexError, TypeError, ValueError, OverflowError):
        return None
    return None
