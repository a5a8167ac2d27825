#!/usr/bin/env python3
"""ResNet-50 v1.5 as ONNX, with seeded weights and BatchNorm statistics that keep activations sane.

A benchmark model for speed and for quantization stress, not a classifier: the weights are
random, but every layer sees activations in the range a trained network has, so int8
quantization meets realistic ranges through all 50 layers.

Graph (NCHW, opset 13, names as torchvision's ``resnet50``)::

    input [N,3,224,224] -> conv1 7x7 s2 -> bn1 -> Relu -> MaxPool 3x3 s2
    layer1..layer4: [3, 4, 6, 3] bottlenecks, widths 64, 128, 256, 512, expansion 4
        bottleneck: conv1 1x1 -> bn1 -> Relu -> conv2 3x3 (stride here: v1.5) -> bn2 -> Relu
                    -> conv3 1x1 -> bn3, + identity (or downsample: 1x1 stride s -> BN), Relu
    GlobalAveragePool -> Flatten -> fc (Gemm, 1000) -> logits [N,1000]
    Conv without bias, each followed by an unfolded BatchNormalization (epsilon 1e-5).

Weights: He normal, std sqrt(2 / fan_in), from ``numpy.random.default_rng(seed)``.
BatchNorm statistics: the graph is first run with every BatchNormalization replaced by its
training-mode form (normalise with the batch's own per-channel mean and variance, which are
also returned as outputs) on a batch of smooth synthetic images; those means and variances
become running_mean / running_var. Since the statistics of each layer are taken with all
earlier layers already normalised, this is the same as setting them layer by layer, in one
pass. Every BN output is then gamma * (unit-variance) + beta, with gamma ~ U(0.7, 1.3) and
beta ~ N(0, 0.1), except the last BN of each residual branch (bn3), whose gamma is
U(0.2, 0.5) so that the residual sums grow slowly. The fc weights are scaled so the logits
have a standard deviation of about 1.5 on that batch (about 4-5 on real photos), and the fc bias cancels the batch's mean
feature, so different images get different top-1 classes.

  python benchmarks/resnet50_builder.py --out models/resnet50.onnx [--seed 0] [--batch N] [--check]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Dict, List, Optional

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

STAGES = ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2))  # (blocks, width, first stride)
EXPANSION = 4
BN_EPS = 1e-5
OPSET = 13
LOGIT_STD = 1.5


class _Net:
    """Collects nodes and parameters; ``bn_mode`` 'eval' writes BatchNormalization, 'stats' its training form."""

    def __init__(self, rng: np.random.Generator, bn_mode: str, params: Optional[Dict[str, np.ndarray]] = None):
        self.rng, self.bn_mode = rng, bn_mode
        self.params: Dict[str, np.ndarray] = params if params is not None else {}
        self.nodes: List[onnx.NodeProto] = []
        self.extra_inits: List[onnx.TensorProto] = []
        self.stat_outputs: List[str] = []
        self.bn_names: List[str] = []

    def param(self, name, make):
        if name not in self.params:
            self.params[name] = make().astype(np.float32)
        return name

    def conv(self, name, x, cin, cout, k, stride, pad):
        w = self.param(f"{name}.weight",
                       lambda: self.rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k)))
        y = f"{name}.out"
        self.nodes.append(helper.make_node("Conv", [x, w], [y], name=name, kernel_shape=[k, k],
                                           strides=[stride, stride], pads=[pad] * 4))
        return y

    def bn(self, name, x, c, last_in_branch=False):
        lo, hi = (0.2, 0.5) if last_in_branch else (0.7, 1.3)
        g = self.param(f"{name}.weight", lambda: self.rng.uniform(lo, hi, c))
        b = self.param(f"{name}.bias", lambda: self.rng.normal(0.0, 0.1, c))
        m = self.param(f"{name}.running_mean", lambda: np.zeros(c))
        v = self.param(f"{name}.running_var", lambda: np.ones(c))
        self.bn_names.append(name)
        y = f"{name}.out"
        if self.bn_mode == "eval":
            self.nodes.append(helper.make_node("BatchNormalization", [x, g, b, m, v], [y], name=name,
                                               epsilon=BN_EPS))
            return y
        # training form: y = (x - mean_b) / sqrt(var_b + eps) * gamma + beta, batch stats as outputs
        shape = f"{name}.c11"
        if not any(i.name == "bnstat.shape" for i in self.extra_inits):
            self.extra_inits.append(numpy_helper.from_array(np.array([1, -1, 1, 1], np.int64), "bnstat.shape"))
            self.extra_inits.append(numpy_helper.from_array(np.array(BN_EPS, np.float32), "bnstat.eps"))
        mean, var = f"{name}.batch_mean", f"{name}.batch_var"
        n = self.nodes
        n.append(helper.make_node("ReduceMean", [x], [mean], axes=[0, 2, 3], keepdims=1))
        n.append(helper.make_node("Sub", [x, mean], [f"{name}.d"]))
        n.append(helper.make_node("Mul", [f"{name}.d", f"{name}.d"], [f"{name}.d2"]))
        n.append(helper.make_node("ReduceMean", [f"{name}.d2"], [var], axes=[0, 2, 3], keepdims=1))
        n.append(helper.make_node("Add", [var, "bnstat.eps"], [f"{name}.ve"]))
        n.append(helper.make_node("Sqrt", [f"{name}.ve"], [f"{name}.sd"]))
        n.append(helper.make_node("Div", [f"{name}.d", f"{name}.sd"], [f"{name}.z"]))
        n.append(helper.make_node("Reshape", [g, "bnstat.shape"], [f"{shape}.g"]))
        n.append(helper.make_node("Reshape", [b, "bnstat.shape"], [f"{shape}.b"]))
        n.append(helper.make_node("Mul", [f"{name}.z", f"{shape}.g"], [f"{name}.zg"]))
        n.append(helper.make_node("Add", [f"{name}.zg", f"{shape}.b"], [y]))
        self.stat_outputs += [mean, var]
        return y

    def relu(self, name, x):
        y = f"{name}.out"
        self.nodes.append(helper.make_node("Relu", [x], [y], name=name))
        return y


def _bottleneck(net: _Net, p: str, x: str, cin: int, width: int, stride: int) -> str:
    cout = width * EXPANSION
    y = net.relu(f"{p}.relu1", net.bn(f"{p}.bn1", net.conv(f"{p}.conv1", x, cin, width, 1, 1, 0), width))
    y = net.relu(f"{p}.relu2", net.bn(f"{p}.bn2", net.conv(f"{p}.conv2", y, width, width, 3, stride, 1), width))
    y = net.bn(f"{p}.bn3", net.conv(f"{p}.conv3", y, width, cout, 1, 1, 0), cout, last_in_branch=True)
    short = x
    if stride != 1 or cin != cout:
        short = net.bn(f"{p}.downsample.1", net.conv(f"{p}.downsample.0", x, cin, cout, 1, stride, 0), cout)
    net.nodes.append(helper.make_node("Add", [y, short], [f"{p}.add.out"], name=f"{p}.add"))
    return net.relu(f"{p}.relu3", f"{p}.add.out")


def _graph(net: _Net, batch, image_size: int, base_width: int = 64):
    x = net.relu("relu", net.bn("bn1", net.conv("conv1", "input", 3, base_width, 7, 2, 3), base_width))
    net.nodes.append(helper.make_node("MaxPool", [x], ["maxpool.out"], name="maxpool",
                                      kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    x, cin, stage_outs = "maxpool.out", base_width, []
    for s, (blocks, width, stride) in enumerate(STAGES):
        width = width * base_width // 64
        for i in range(blocks):
            x = _bottleneck(net, f"layer{s + 1}.{i}", x, cin, width, stride if i == 0 else 1)
            cin = width * EXPANSION
        stage_outs.append(x)
    net.nodes.append(helper.make_node("GlobalAveragePool", [x], ["avgpool.out"], name="avgpool"))
    net.nodes.append(helper.make_node("Flatten", ["avgpool.out"], ["flatten.out"], name="flatten", axis=1))
    w = net.param("fc.weight", lambda: net.rng.standard_normal((1000, cin)) / np.sqrt(cin))
    b = net.param("fc.bias", lambda: net.rng.normal(0.0, 0.01, 1000))
    net.nodes.append(helper.make_node("Gemm", ["flatten.out", w, b], ["logits"], name="fc", transB=1))
    n = batch if batch is not None else "N"
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [n, 3, image_size, image_size])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [n, 1000])]
    inits = [numpy_helper.from_array(v, k) for k, v in net.params.items()] + net.extra_inits
    graph = helper.make_graph(net.nodes, "resnet50_v1.5", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="qtool benchmarks/resnet50_builder.py")
    model.ir_version = 8
    return model, stage_outs


def synthetic_images(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """Smooth, image-like noise (sum of upsampled random fields), roughly like normalised photos."""
    out = np.zeros((n, 3, size, size), np.float32)
    for cells in (4, 16, 56):
        f = rng.standard_normal((n, 3, cells, cells)).astype(np.float32)
        f += rng.standard_normal((n, 1, cells, cells)).astype(np.float32)  # correlated colours
        rep = -(-size // cells)
        out += np.repeat(np.repeat(f, rep, axis=2), rep, axis=3)[:, :, :size, :size] / np.sqrt(2 * 3)
    return np.clip(out, -2.2, 2.7)


def _session(model: onnx.ModelProto, outputs=()):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for name in outputs:
        m.graph.output.append(helper.make_empty_tensor_value_info(name))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def build_resnet50_model(seed: int = 0, batch: Optional[int] = None, image_size: int = 224,
                         calib_images: int = 8, base_width: int = 64) -> onnx.ModelProto:
    """The ResNet-50 v1.5 ModelProto with calibrated BatchNorm statistics (see the module docstring)."""
    rng = np.random.default_rng(seed)
    stats_net = _Net(rng, "stats")
    stats_model, _ = _graph(stats_net, None, image_size, base_width)
    x = synthetic_images(np.random.default_rng(seed + 1), calib_images, image_size)
    sess = _session(stats_model, stats_net.stat_outputs + ["flatten.out"])
    res = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"input": x})))
    params = stats_net.params
    for name in stats_net.bn_names:
        params[f"{name}.running_mean"] = res[f"{name}.batch_mean"].reshape(-1).astype(np.float32)
        params[f"{name}.running_var"] = res[f"{name}.batch_var"].reshape(-1).astype(np.float32)
    # centre the classifier on the batch's mean feature, so logits follow what differs between images
    feat = res["flatten.out"].astype(np.float64)
    mu = feat.mean(axis=0)
    dev_rms = float(np.sqrt(np.mean((feat - mu) ** 2)))
    w = params["fc.weight"].astype(np.float64) * (LOGIT_STD / max(dev_rms, 1e-6))
    params["fc.weight"] = w.astype(np.float32)
    params["fc.bias"] = (params["fc.bias"] - w @ mu).astype(np.float32)
    model, _ = _graph(_Net(rng, "eval", params), batch, image_size, base_width)
    onnx.checker.check_model(model)
    return model


def build_resnet50(path, seed: int = 0, batch: Optional[int] = None, **kw) -> str:
    """Write ResNet-50 v1.5 to path (atomically); batch None means a dynamic batch dimension."""
    model = build_resnet50_model(seed=seed, batch=batch, **kw)
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".onnx", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model.SerializeToString())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def activation_report(path, images: np.ndarray) -> List[str]:
    """Per-stage std / max |x| and logit statistics of the written model on images."""
    model = onnx.load(os.fspath(path))
    taps = ["relu.out", "maxpool.out"] + [f"layer{s + 1}.{b - 1}.relu3.out" for s, (b, _, _) in enumerate(STAGES)]
    sess = _session(model, taps)
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"input": images})))
    lines = []
    for t in taps:
        a = outs[t]
        lines.append(f"{t:22s} shape {str(list(a.shape)):20s} std {a.std():7.3f}  max|x| {np.abs(a).max():8.3f}  "
                     f"zeros {np.mean(a == 0):.2f}")
    lg = outs["logits"]
    lines.append(f"{'logits':22s} shape {str(list(lg.shape)):20s} std {lg.std():7.3f}  max|x| {np.abs(lg).max():8.3f}  "
                 f"finite {bool(np.isfinite(lg).all())}  distinct top-1 {len(set(lg.argmax(1).tolist()))}/{len(lg)}")
    return lines


def load_photos(directory, n: int) -> np.ndarray:
    """Up to n photos: shorter side 256 (bilinear), centre crop 224, (x / 255 - mean) / std, NCHW."""
    from PIL import Image
    exts = (".jpg", ".jpeg", ".png")
    files = sorted(f for f in os.listdir(directory) if f.lower().endswith(exts))[:n]
    if not files:
        raise SystemExit(f"no images in {directory}")
    mean, std = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)
    out = []
    for f in files:
        im = Image.open(os.path.join(directory, f)).convert("RGB")
        s = 256 / min(im.size)
        im = im.resize((round(im.size[0] * s), round(im.size[1] * s)), Image.BILINEAR)
        left, top = (im.size[0] - 224) // 2, (im.size[1] - 224) // 2
        a = np.asarray(im.crop((left, top, left + 224, top + 224)), np.float32) / 255.0
        out.append(((a - mean) / std).transpose(2, 0, 1))
    return np.stack(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Write ResNet-50 v1.5 (seeded weights, calibrated BatchNorm) as ONNX.")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=None, help="fixed batch size (default: dynamic)")
    ap.add_argument("--check", action="store_true",
                    help="print per-stage activation statistics on fresh synthetic images")
    ap.add_argument("--images", help="with --check, also on up to 8 photos from this directory "
                                     "(resize 256, centre crop 224, ImageNet mean/std)")
    a = ap.parse_args(argv)
    t = time.time()
    build_resnet50(a.out, seed=a.seed, batch=a.batch)
    print(f"wrote {a.out} ({os.path.getsize(a.out) / 1e6:.1f} MB, {time.time() - t:.1f} s)")
    if a.check:
        imgs = synthetic_images(np.random.default_rng(a.seed + 100), a.batch or 4, 224)
        print("synthetic images:")
        print("\n".join(activation_report(a.out, imgs)))
        if a.images:
            print(f"photos from {a.images}:")
            print("\n".join(activation_report(a.out, load_photos(a.images, 8))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
