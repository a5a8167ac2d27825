"""Small ONNX models and image folders for the unit tests: seeded, tiny, built on the spot."""
from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

OPSET = 13


def init(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def weight(rng, name, *shape, scale=0.5):
    return init(name, rng.standard_normal(shape) * scale)


def ctc_probabilities(rng, n=12, t=20, c=6):
    """fp32's probabilities [n, t, c] of a CTC recognizer: blank (0) at most steps, a symbol every 4th."""
    logits = rng.standard_normal((n, t, c)) * 0.1
    logits[:, :, 0] += 3.0
    for k in range(0, t, 4):
        logits[np.arange(n), k, rng.integers(1, c, n)] += 6.0
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def make_model(nodes, inits, inputs, outputs, opset=OPSET, ir_version=8):
    """inputs/outputs: (name, shape) pairs (float32; None/str dims are dynamic; shape None = rank 4, all unknown)."""
    g = helper.make_graph(
        nodes, "t",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None] * 4 if s is None else s) for n, s in outputs],
        initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir_version
    onnx.checker.check_model(m)
    return m


def run(model, feeds, outputs=None):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(outputs, feeds)


def assert_same_function(before, after, feeds, rtol=1e-5):
    """Every graph output of `after` equals `before`'s within rtol of the output's range."""
    a, b = run(before, feeds), run(after, feeds)
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.shape == v.shape
        span = max(float(np.ptp(u)), float(np.abs(u).max()), 1e-6)
        err = float(np.abs(u.astype(np.float64) - v).max())
        assert err <= rtol * span, f"max |diff| {err:.3g} > {rtol} x range {span:.3g}"


def ops(model):
    c = {}
    for n in model.graph.node:
        c[n.op_type] = c.get(n.op_type, 0) + 1
    return c


def conv_bn(rng, x, y, cin, cout, prefix, k=3, group=1, bias=True, relu=True, stride=1):
    """Conv(+bias) -> BatchNormalization (-> Relu): nodes and initializers."""
    p = k // 2
    inits = [weight(rng, f"{prefix}_w", cout, cin // group, k, k, scale=1.0 / np.sqrt(cin // group * k * k))]
    ins = [x, f"{prefix}_w"]
    if bias:
        inits.append(weight(rng, f"{prefix}_b", cout, scale=0.1))
        ins.append(f"{prefix}_b")
    inits += [init(f"{prefix}_g", rng.uniform(0.5, 1.5, cout)), init(f"{prefix}_beta", rng.normal(0, 0.2, cout)),
              init(f"{prefix}_mean", rng.normal(0, 0.2, cout)), init(f"{prefix}_var", rng.uniform(0.5, 2.0, cout))]
    conv_out, bn_out = f"{prefix}_c", (f"{prefix}_bn" if relu else y)
    nodes = [helper.make_node("Conv", ins, [conv_out], name=f"{prefix}_conv", kernel_shape=[k, k],
                              pads=[p] * 4, group=group, strides=[stride, stride]),
             helper.make_node("BatchNormalization", [conv_out, f"{prefix}_g", f"{prefix}_beta", f"{prefix}_mean",
                                                     f"{prefix}_var"], [bn_out], name=f"{prefix}_bnorm",
                              epsilon=1e-3)]
    if relu:
        nodes.append(helper.make_node("Relu", [bn_out], [y], name=f"{prefix}_relu"))
    return nodes, inits


def small_convnet(seed=0, size=16, classes=5, middle=None):
    """x [N,3,size,size] -> Conv+BN+Relu -> depthwise Conv+BN+Relu -> 1x1 Conv+BN -> residual Add
    -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> y [N, classes].
    `middle`: an op type (e.g. "Sigmoid") inserted after the residual Add, with no int8 rule."""
    rng = np.random.default_rng(seed)
    c = 8
    nodes, inits = [], []
    for args in (("x", "a1", 3, c, "stem"), ("a1", "a2", c, c, "dw"), ("a2", "a3", c, c, "pw")):
        kw = dict(group=c, k=3) if args[-1] == "dw" else dict(k=1, relu=False) if args[-1] == "pw" else {}
        n, i = conv_bn(rng, *args, **kw)
        nodes += n
        inits += i
    nodes.append(helper.make_node("Add", ["a3", "a1"], ["res"], name="residual"))
    last = "res"
    if middle:
        kw = {"axis": 1} if middle == "Softmax" else {}  # over channels: the pooled result still varies
        nodes.append(helper.make_node(middle, ["res"], ["mid"], name="middle", **kw))
        last = "mid"
    nodes += [helper.make_node("Relu", [last], ["r"], name="res_relu"),
              helper.make_node("GlobalAveragePool", ["r"], ["gap"], name="gap"),
              helper.make_node("Flatten", ["gap"], ["flat"], name="flatten", axis=1),
              helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["y"], name="fc", transB=1)]
    inits += [weight(rng, "fc_w", classes, c, scale=0.5), weight(rng, "fc_b", classes, scale=0.1)]
    return make_model(nodes, inits, [("x", ["N", 3, size, size])], [("y", ["N", classes])])


def sequence_encoder(seed=0, d=16):
    """x [N, T, d] (T free: sentences of many lengths) -> a dense layer, self-attention over T, a residual
    Add, a dense layer -> y [N, T, d]."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["q"], name="fc2"),
             helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1], name="tr"),
             helper.make_node("MatMul", ["q", "qt"], ["att"], name="qk"),
             helper.make_node("Softmax", ["att"], ["p"], axis=-1, name="sm"),
             helper.make_node("MatMul", ["p", "r"], ["ctxv"], name="av"),
             helper.make_node("Add", ["ctxv", "x"], ["res"], name="resid"),
             helper.make_node("MatMul", ["res", "w3"], ["y"], name="fc3")]
    inits = [weight(rng, "w1", d, d, scale=0.3), weight(rng, "b1", d, scale=0.1),
             weight(rng, "w2", d, d, scale=0.3), weight(rng, "w3", d, d, scale=0.3)]
    return make_model(nodes, inits, [("x", ["N", "T", d])], [("y", ["N", "T", d])])


def picture(rng, h=20, w=24, mode="RGB"):
    """A smooth gradient with noise and a bright blob: varied but natural-ish pixel statistics."""
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx / w * 255, yy / h * 255, (xx + yy) / (h + w) * 255], -1)
    base = base * rng.uniform(0.3, 1.0, 3) + rng.normal(0, 20, (h, w, 3))
    cy, cx = rng.integers(0, h), rng.integers(0, w)
    base[max(0, cy - 3):cy + 3, max(0, cx - 3):cx + 3] = rng.uniform(0, 255, 3)
    im = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
    return im if mode == "RGB" else im.convert(mode)


def write_images(folder, n, seed=0, ext="png", h=20, w=24, prefix="img"):
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for k in range(n):
        p = os.path.join(str(folder), f"{prefix}{k:02d}.{ext}")
        picture(rng, h, w).save(p)
        paths.append(p)
    return paths


def write_config(path, size=16, color="RGB", layout="NCHW", **pre):
    """A TOML preprocessing config resizing straight to `size` x `size`, pixels scaled to about [-1, 1]."""
    pre = {"resize": "exact", "crop": "none", "interpolation": "bilinear",
           "mean": [127.5] * (1 if color == "GRAY" else 3), "std": [127.5] * (1 if color == "GRAY" else 3)} | pre

    def fmt(v):
        return f'"{v}"' if isinstance(v, str) else str(v).replace("'", '"')

    text = (f'[input]\nlayout = "{layout}"\nsize = [{size}, {size}]\ncolor = "{color}"\n\n[preprocess]\n'
            + "".join(f"{k} = {fmt(v)}\n" for k, v in pre.items()))
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def save(model, path):
    onnx.save(model, str(path))
    return str(path)


def old_ir_conv_bn(seed=7, hw=16):
    """IR 3 / opset 9, every initializer also listed as a graph input (as old exporters wrote models)."""
    nodes, inits = conv_bn(np.random.default_rng(seed), "x", "y", 3, 4, "l", relu=False)
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, hw, hw])] + [
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    g = helper.make_graph(nodes, "old", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, hw, hw])],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)])
    m.ir_version = 3
    onnx.checker.check_model(m)
    return m


def qdq_conv_model(w_q, rng, hw=6, x_zp=7, pad=1):
    """A QDQ Conv (int8 weights `w_q` [Cout, Cin, k, k], per-channel scales, int32 bias) as qtool
    writes it, and an input whose uint8 values are mostly large: (model, x)."""
    cout, cin, k, _ = w_q.shape
    xu8 = rng.choice(np.array([255, 250, 240, 0, 128], np.uint8), size=(1, cin, hw, hw))
    sx, sw = 0.02, rng.uniform(0.5, 1.5, cout).astype(np.float32) * 1e-3
    x = ((xu8.astype(np.float32) - x_zp) * np.float32(sx)).astype(np.float32)
    acc_max = float(255 * np.abs(w_q.astype(np.int64)).reshape(cout, -1).sum(1).max())
    sy = acc_max * sx * float(sw.max()) / 400.0
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["wd"], axis=0),
             helper.make_node("DequantizeLinear", ["bq", "sb", "zb"], ["bd"], axis=0),
             helper.make_node("Conv", ["xd", "wd", "bd"], ["y"], kernel_shape=[k, k], pads=[pad] * 4),
             helper.make_node("QuantizeLinear", ["y", "sy", "zy"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["out"])]
    inits = [init("sx", sx), init("zx", x_zp, np.uint8), init("wq", w_q, np.int8), init("sw", sw),
             init("zw", np.zeros(cout), np.int8), init("bq", rng.integers(-2000, 2000, cout), np.int32),
             init("sb", np.float32(sx) * sw), init("zb", np.zeros(cout), np.int32), init("sy", sy),
             init("zy", 128, np.uint8)]
    model = make_model(nodes, inits, [("x", list(x.shape))], [("out", None)])
    return model, x


def if_conv_model(rng):
    """x [1, 1, 64], sr -> If(sr == 16000): a small 1-D conv net in each branch (weights inside it; Silero
    VAD's layout: the branch a sample takes follows its data)."""
    def branch(name, scale):
        w = init(f"w_{name}", rng.standard_normal((6, 1, 5)) * scale)
        w2 = init(f"w2_{name}", rng.standard_normal((1, 6, 3)) * 0.4)
        nodes = [helper.make_node("Conv", ["x", w.name], [f"c_{name}"], kernel_shape=[5], pads=[2, 2]),
                 helper.make_node("Relu", [f"c_{name}"], [f"r_{name}"]),
                 helper.make_node("Conv", [f"r_{name}", w2.name], [f"y_{name}"], kernel_shape=[3], pads=[1, 1])]
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, None)],
                                 initializer=[w, w2])

    nodes = [helper.make_node("Equal", ["sr", "k16"], ["is16"], name="eq"),
             helper.make_node("If", ["is16"], ["y"], name="rate", then_branch=branch("khz16", 0.5),
                              else_branch=branch("khz8", 0.3))]
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 64]),
                                       helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 64])],
                          initializer=[init("k16", 16000, np.int64)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 16)])
    m.ir_version = 8
    return m


def write_samples(folder, samples: list) -> str:
    """One .npy (a one-input model) or .npz per sample."""
    os.makedirs(folder, exist_ok=True)
    for k, s in enumerate(samples):
        if len(s) == 1:
            np.save(os.path.join(folder, f"s{k:02d}.npy"), next(iter(s.values())))
        else:
            np.savez(os.path.join(folder, f"s{k:02d}.npz"), **s)
    return str(folder)


def calibrate_samples(model, samples: list, folder, method: str = "auto") -> str:
    """model.onnx and its samples (write_samples) in `folder`, calibrated with `method` into
    folder/work, quietly -> the working directory."""
    import warnings
    from qtool.api import calibrate
    os.makedirs(folder, exist_ok=True)
    path = save(model, os.path.join(folder, "model.onnx"))
    data = write_samples(os.path.join(folder, "data"), samples)
    work = str(os.path.join(folder, "work"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(path, data, method=method, workdir=work, verbose=False, threads=1)
    return work


def calibrated_convnet(folder, n: int) -> str:
    """small_convnet(seed=4) calibrated (minmax) on n random 16x16 samples in `folder` -> the working directory:
    the small model the rounding check and the held-out verification are exercised on."""
    rng = np.random.default_rng(4)
    model = small_convnet(seed=4)
    x = model.graph.input[0].name
    samples = [{x: rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(n)]
    return calibrate_samples(model, samples, folder, method="minmax")


def calibrate_options(**options):
    """CalibrateOptions from the command's flat option names (batch, limit, every and budget_gmac go
    to its Sampling)."""
    import dataclasses
    from qtool.calibrate.options import CalibrateOptions, Sampling
    sampling = {f.name: options.pop(f.name) for f in dataclasses.fields(Sampling) if f.name in options}
    return CalibrateOptions(**options, sampling=Sampling(**sampling))


def kernel_set(name: str):
    """The native kernels on one set ("scalar", "avx2", "avx2-exact", "avx512vnni", ...) for a `with` block
    (-> the ISA tier), then back to what they were."""
    import contextlib
    from qtool import kernels as K

    @contextlib.contextmanager
    def chosen():
        prev = K.get_isa()
        tier = name.replace("-exact", "")
        K.set_isa(tier)
        K.set_exact_only(name.endswith("-exact"))
        try:
            yield tier
        finally:
            K.set_exact_only(False)
            K.set_isa(prev)
    return chosen()


def attention_block(softmax_axis=-1, dynamic_key_shape=True, key_read_elsewhere=False, value_from="softmax"):
    """One self-attention block as torch exports BERT: x [batch, seq, D] -> q, k, v projections with biases,
    heads split by Reshape (the key's shape computed from its own Shape, as a dynamic export does), scores
    scaled and masked, Softmax, context merged back, output projection with its bias."""
    D, H = 16, 2
    rng = np.random.default_rng(0)
    dh = D // H
    inits = [init(f"w{n}", rng.standard_normal((D, D)) * 0.3) for n in "qkvo"]
    inits += [init(f"b{n}", rng.standard_normal(D) * 2.0) for n in "qkvo"]
    inits += [init("split", [0, 0, H, dh], np.int64), init("merge", [0, 0, D], np.int64),
              init("heads", [H, dh], np.int64), init("i0", [0], np.int64), init("i1", [1], np.int64),
              init("scale", np.sqrt(dh))]
    nodes = []
    for n in "qkv":
        nodes += [helper.make_node("MatMul", ["x", f"w{n}"], [f"{n}m"], name=f"{n}_mm"),
                  helper.make_node("Add", [f"b{n}", f"{n}m"], [f"{n}a"], name=f"{n}_add")]
    if dynamic_key_shape:
        nodes += [helper.make_node("Shape", ["ka"], ["ks"]),
                  helper.make_node("Gather", ["ks", "i0"], ["k0"], axis=0),
                  helper.make_node("Gather", ["ks", "i1"], ["k1"], axis=0),
                  helper.make_node("Concat", ["k0", "k1", "heads"], ["kshape"], axis=0)]
    nodes += [helper.make_node("Reshape", ["qa", "split"], ["qr"]),
              helper.make_node("Reshape", ["ka", "kshape" if dynamic_key_shape else "split"], ["kr"]),
              helper.make_node("Reshape", ["va", "split"], ["vr"]),
              helper.make_node("Transpose", ["qr"], ["qt"], perm=[0, 2, 1, 3]),
              helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 2, 3, 1]),
              helper.make_node("Transpose", ["vr"], ["vt"], perm=[0, 2, 1, 3]),
              helper.make_node("MatMul", ["qt", "kt"], ["s"], name="scores"),
              helper.make_node("Div", ["s", "scale"], ["sd"]),
              helper.make_node("Add", ["sd", "mask"], ["sm"], name="masked"),
              helper.make_node("Softmax", ["sm"], ["p"], axis=softmax_axis)]
    if value_from == "sigmoid":  # weights whose rows do not sum to 1
        nodes.append(helper.make_node("Sigmoid", ["sm"], ["p2"]))
    nodes += [helper.make_node("MatMul", ["p2" if value_from == "sigmoid" else "p", "vt"], ["c"], name="context"),
              helper.make_node("Transpose", ["c"], ["ct"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ct", "merge"], ["cm"]),
              helper.make_node("MatMul", ["cm", "wo"], ["om"], name="o_mm"),
              helper.make_node("Add", ["om", "bo"], ["y"], name="o_add")]
    outputs = [("y", ["batch", "seq", D])]
    if value_from == "sigmoid":
        outputs.append(("p", ["batch", H, "seq", "seq"]))
    if key_read_elsewhere:
        outputs.append(("ka", ["batch", "seq", D]))
    return make_model(nodes, inits, [("x", ["batch", "seq", D]), ("mask", ["batch", 1, 1, "seq"])], outputs)
