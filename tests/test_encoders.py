"""Encoders judged as encoders (issue 47): which outputs are an encoder's vectors (qtool/encoders.py), their
figures over the evaluation set (metrics.vector_figures, evaluate/kinds/encoder.py), --task, and
--exclude-sensitive judging them by cosine and nearest neighbours (quantize/encoder_judge.py)."""
from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from helpers import init, run, save, small_convnet
from qtool.encoders import encoder_outputs, mask_input
from qtool.metrics import cosine_each, mean_pool, nearest_others, neighbour_agreement, pair_spearman, vector_figures

H, VOCAB, CLASSES, T = 32, 50, 3, 8


def _layer_norm(x: str, y: str, p: str, decomposed: bool, inits: list) -> list:
    """LayerNormalization of x over its last axis, as one op or written out as older exporters do."""
    inits += [init(f"{p}_g", np.linspace(0.8, 1.2, H)), init(f"{p}_b", np.linspace(-0.1, 0.1, H))]
    if not decomposed:
        return [helper.make_node("LayerNormalization", [x, f"{p}_g", f"{p}_b"], [y], axis=-1, name=p)]
    inits += [init(f"{p}_two", 2.0), init(f"{p}_eps", 1e-5)]
    return [helper.make_node("ReduceMean", [x], [f"{p}_mu"], axes=[-1]),
            helper.make_node("Sub", [x, f"{p}_mu"], [f"{p}_d"]),
            helper.make_node("Pow", [f"{p}_d", f"{p}_two"], [f"{p}_sq"]),
            helper.make_node("ReduceMean", [f"{p}_sq"], [f"{p}_var"], axes=[-1]),
            helper.make_node("Add", [f"{p}_var", f"{p}_eps"], [f"{p}_ve"]),
            helper.make_node("Sqrt", [f"{p}_ve"], [f"{p}_sd"]),
            helper.make_node("Div", [f"{p}_d", f"{p}_sd"], [f"{p}_n"]),
            helper.make_node("Mul", [f"{p}_n", f"{p}_g"], [f"{p}_s"]),
            helper.make_node("Add", [f"{p}_s", f"{p}_b"], [y])]


def encoder_model(seed: int = 0, decomposed: bool = False, extra: bool = False) -> onnx.ModelProto:
    """input_ids, attention_mask [N, T] -> embedding Gather -> LayerNorm -> MatMul + bias -> Relu -> residual
    Add -> LayerNorm: `tokens` [N, T, H]; mean-pooled over the mask: `pooled` [N, H]; a classifier head on it
    (MatMul onto CLASSES + bias): `logits`. `extra`: also a BERT-style pooler (the first token, Gemm, Tanh),
    an L2-normalized pooled vector and a token classifier's logits [N, T, 5]."""
    rng = np.random.default_rng(seed)
    inits = [init("emb", rng.standard_normal((VOCAB, H))), init("w1", rng.standard_normal((H, H)) / np.sqrt(H)),
             init("b1", rng.standard_normal(H) * 0.1), init("wc", rng.standard_normal((H, CLASSES))),
             init("bc", np.zeros(CLASSES)), init("ax1", [1], np.int64), init("ax2", [2], np.int64),
             init("tiny", 1e-9)]
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["e"])]
    nodes += _layer_norm("e", "h0", "ln0", decomposed, inits)
    nodes += [helper.make_node("MatMul", ["h0", "w1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["d1"]),
              helper.make_node("Relu", ["d1"], ["r1"]), helper.make_node("Add", ["r1", "h0"], ["res"])]
    nodes += _layer_norm("res", "tokens", "ln1", decomposed, inits)
    nodes += [helper.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT),
              helper.make_node("Unsqueeze", ["mf", "ax2"], ["m3"]),
              helper.make_node("Mul", ["tokens", "m3"], ["masked"]),
              helper.make_node("ReduceSum", ["masked", "ax1"], ["summed"], keepdims=0),
              helper.make_node("ReduceSum", ["mf", "ax1"], ["count"], keepdims=1),
              helper.make_node("Clip", ["count", "tiny"], ["cc"]),
              helper.make_node("Div", ["summed", "cc"], ["pooled"]),
              helper.make_node("MatMul", ["pooled", "wc"], ["lc"]), helper.make_node("Add", ["lc", "bc"], ["logits"])]
    outputs = [("tokens", [None, T, H]), ("pooled", [None, H]), ("logits", [None, CLASSES])]
    if extra:
        inits += [init("zero", 0, np.int64), init("wp", rng.standard_normal((H, H)) / np.sqrt(H)),
                  init("bp", np.zeros(H)), init("wt", rng.standard_normal((H, 5))), init("bt", np.zeros(5))]
        nodes += [helper.make_node("Gather", ["tokens", "zero"], ["cls"], axis=1),
                  helper.make_node("Gemm", ["cls", "wp", "bp"], ["pd"]), helper.make_node("Tanh", ["pd"], ["pooler"]),
                  helper.make_node("ReduceL2", ["pooled"], ["norm"], axes=[-1], keepdims=1),
                  helper.make_node("Clip", ["norm", "tiny"], ["nc"]),
                  helper.make_node("Div", ["pooled", "nc"], ["unit"]),
                  helper.make_node("MatMul", ["tokens", "wt"], ["lt"]), helper.make_node("Add", ["lt", "bt"], ["tags"])]
        outputs += [("pooler", [None, H]), ("unit", [None, H]), ("tags", [None, T, 5])]
    g = helper.make_graph(nodes, "encoder",
                          [helper.make_tensor_value_info(n, TensorProto.INT64, [None, T])
                           for n in ("input_ids", "attention_mask")],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _feeds(rng, n: int) -> dict:
    """n token sequences of T with 3 to T real tokens each (the rest padding: mask 0, id 0)."""
    lengths = rng.integers(3, T + 1, n)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
    return {"input_ids": rng.integers(1, VOCAB, (n, T)) * mask, "attention_mask": mask}


@pytest.mark.parametrize("decomposed", [False, True])
def test_the_graph_says_which_outputs_are_an_encoders_vectors(decomposed):
    """Token states a normalization writes and their pooling (mean over the mask, the first token through a
    Tanh pooler, L2-normalized) are an encoder's vectors; a projection onto classes (a sentence classifier's
    head, a token classifier's) is not, nor is anything of a CNN classifier. The mask is the 2-D input no
    Gather looks up."""
    found = encoder_outputs(encoder_model(decomposed=decomposed, extra=True))
    assert {n: e.kind for n, e in found.items()} == {"tokens": "tokens", "pooled": "pooled", "pooler": "pooled",
                                                    "unit": "pooled"}
    assert "normalization" in found["tokens"].why and "Tanh" in found["pooler"].why
    assert mask_input(encoder_model(decomposed=decomposed)) == "attention_mask"
    assert encoder_outputs(small_convnet()) == {} and mask_input(small_convnet()) is None


def test_vector_figures_are_the_numpy_ones():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((40, H))
    out = ref + 0.3 * rng.standard_normal(ref.shape)
    cos = (ref * out).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(out, axis=1)
    np.testing.assert_allclose(cosine_each(ref, out), cos, rtol=1e-12)

    def nearest(v):  # brute force: each row's most similar other row
        u = v / np.linalg.norm(v, axis=1, keepdims=True)
        s = u @ u.T
        np.fill_diagonal(s, -2)
        return s.argmax(1)
    assert (nearest_others(ref, chunk=7) == nearest(ref)).all()
    agree = float((nearest(ref) == nearest(out)).mean())
    assert 0 < agree < 1 and neighbour_agreement(ref, out) == agree

    def sims(v):
        u = v / np.linalg.norm(v, axis=1, keepdims=True)
        return (u @ u.T)[np.triu_indices(len(v), 1)]
    ra, rb = np.argsort(np.argsort(sims(ref))), np.argsort(np.argsort(sims(out)))  # (no ties among these)
    assert pair_spearman(ref, out) == pytest.approx(np.corrcoef(ra, rb)[0, 1], abs=1e-12)
    f = vector_figures(ref, out)
    assert f["cosine"] == {"mean": pytest.approx(cos.mean()), "worst": pytest.approx(cos.min())}
    assert f["sqnr_db"] == pytest.approx(10 * np.log10((ref ** 2).sum() / ((ref - out) ** 2).sum()))
    states, mask = rng.standard_normal((4, T, H)), (rng.random((4, T)) > 0.4).astype(np.float64)
    mask[:, 0] = 1
    want = np.stack([states[i][mask[i] != 0].mean(0) for i in range(4)])
    np.testing.assert_allclose(mean_pool(states, mask), want, rtol=1e-12)


def _workdir(tmp_path, model: onnx.ModelProto) -> str:
    """The model calibrated on 24 sequences and quantized; 12 more in tmp_path/ev."""
    from qtool.calibrate.options import CalibrateOptions
    from qtool.calibrate.run import calibrate
    from qtool.quantize.run import quantize
    path = str(tmp_path / "enc.onnx")
    save(model, path)
    rng = np.random.default_rng(5)
    for split, n in (("cal", 24), ("ev", 12)):
        os.makedirs(tmp_path / split)
        for k in range(n):
            np.savez(tmp_path / split / f"{k:03d}.npz", **_feeds(rng, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(path, str(tmp_path / "cal"), CalibrateOptions(show_progress=False), workdir=str(tmp_path / "work"))
        quantize(str(tmp_path / "work"))
    return str(tmp_path / "work")


def test_eval_judges_an_encoder_by_its_vectors_and_task_says_otherwise(tmp_path):
    """Token states and the pooled vector get the encoder's figures (the states mean-pooled over the mask,
    as numpy pools them from both models' outputs) and no per-position classes; the classifier head beside
    them keeps its top-1 agreement; --task turns each into what the user says; the guess is printed."""
    from qtool.commands.eval import render_outputs
    from qtool.evaluate import EvalOptions, evaluate_workdir
    work = _workdir(tmp_path, encoder_model())
    r = evaluate_workdir(work, data=str(tmp_path / "ev"), show_progress=False, say=lambda *a: None)
    tok, pooled, logits = (r["outputs"][n] for n in ("tokens", "pooled", "logits"))
    assert (tok["task"], pooled["task"], logits["task"]) == ("encoder", "encoder", "classifier")
    assert tok["task_from"].startswith("guess: a normalization")
    for o in (tok, pooled):
        assert not {"top1_agreement", "sequence_agreement", "ctc_text_agreement"} & set(o)
    assert "top1_agreement" in logits and "encoder" not in logits
    assert "attention_mask" in tok["encoder"]["vectors"]

    fp32 = onnx.load(str(tmp_path / "enc.onnx"))
    int8 = onnx.load(os.path.join(work, "model.int8.onnx"))
    files = sorted(os.listdir(tmp_path / "ev"))
    feeds = [dict(np.load(tmp_path / "ev" / f)) for f in files]
    a = [run(fp32, f, ["tokens"])[0] for f in feeds]
    b = [run(int8, f, ["tokens"])[0] for f in feeds]
    masks = np.concatenate([f["attention_mask"] for f in feeds])
    va, vb = mean_pool(np.concatenate(a), masks), mean_pool(np.concatenate(b), masks)
    want = vector_figures(va, vb)
    got = tok["encoder"]
    assert got["cosine"]["mean"] == pytest.approx(want["cosine"]["mean"], abs=1e-6)
    assert got["cosine"]["worst"] == pytest.approx(want["cosine"]["worst"], abs=1e-6)
    assert got["neighbour_agreement"] == want["neighbour_agreement"] and got["samples"] == len(files)
    assert got["pair_spearman"] == pytest.approx(want["pair_spearman"], abs=1e-6)
    real = masks.astype(bool)
    tc = cosine_each(np.concatenate(a)[real], np.concatenate(b)[real])
    assert got["token_cosine"]["mean"] == pytest.approx(tc.mean(), abs=1e-6) and got["token_cosine"]["tokens"] == real.sum()
    assert pooled["encoder"]["vectors"] == "one per sample, as written" and pooled["encoder"]["samples"] == len(files)
    assert "judged as (guessed" in render_outputs(r) and "tokens encoder" in render_outputs(r)

    told = evaluate_workdir(work, data=str(tmp_path / "ev"), show_progress=False, say=lambda *a: None,
                            options=EvalOptions(task=("logits=encoder", "tokens=sequence")))
    tok, logits = told["outputs"]["tokens"], told["outputs"]["logits"]
    assert (tok["task"], tok["task_from"], logits["task"]) == ("sequence", "--task", "encoder")
    assert tok["agreement_over"] == "positions" and "encoder" not in tok
    assert "encoder" in logits and "top1_agreement" not in logits
    assert "logits encoder (--task)" in render_outputs(told)


def test_task_names_and_aliases():
    from qtool.quantize.options import QuantizeOptions
    from qtool.tasks import parse_tasks
    assert parse_tasks(["embedding", "out:1=ctc"]) == {"": "encoder", "out:1": "sequence"}
    assert QuantizeOptions(task="Embeddings").task == "encoder"
    with pytest.raises(ValueError, match="unknown task"):
        parse_tasks("segmenter")


class EncoderContext:
    """The exclusion search's view of an encoder: token states whose largest coordinate (a spike, at the
    same place in fp32 and int8) keeps every top-1 over the raw states, while the int8 noise turns their
    vectors; `big` kept fp32 cuts that noise to a tenth."""
    exclude: dict = {}
    workers = 1
    exact_storage = False
    experiments = None  # (its models scored here, not on a Ray cluster)

    def __init__(self, n: int = 40):
        rng = np.random.default_rng(2)
        self.fused = encoder_model()
        self.ref = rng.standard_normal((n, T, H)).astype(np.float32)
        self.ref[:, 0, 0] = 10.0
        self.noise = rng.standard_normal(self.ref.shape).astype(np.float32)
        self.noise[:, 0, 0] = 0
        self.feeds = _feeds(rng, n)

    def score(self, samples, excl, threads=None):
        return self.ref + self.noise * (0.1 if "big" in excl else 1.0), SimpleNamespace(model=None)


def _exclusion(target):
    from qtool.quantize.exclude import exclude_sensitive
    from qtool.quantize.samples import SampleSet
    ctx = EncoderContext()
    samples = SampleSet([str(k) for k in range(len(ctx.ref))], ctx.feeds, ctx.ref, output="tokens")
    ranking = [SimpleNamespace(name="big", rank=1, order=0)]
    return ctx, exclude_sensitive(ctx, ranking, samples, target, measure_latency=False)


def test_exclusion_judges_an_encoder_by_cosine_not_top1_of_its_states():
    """Top-1 over raw token states agrees on every sample (the spike), so judged as classes the target held
    with no layer kept fp32; judged as vectors (cosine to fp32 of each sample's states mean-pooled over the
    mask, and nearest neighbours) it does not, and the layer that cuts the noise is kept fp32. --task
    classifier judges as before."""
    from qtool.quantize.exclude import Target
    ctx, r = _exclusion(Target(0.995))
    base = r.curve[0]
    mask = ctx.feeds["attention_mask"]
    cos = cosine_each(mean_pool(ctx.ref, mask), mean_pool(ctx.ref + ctx.noise, mask))
    assert r.error == "1-cosine" and "cosine" in r.target and r.figures == ("neighbours", "cosine")
    assert base.predicted_agreement == pytest.approx(cos.mean()) and base.kl == pytest.approx(1 - cos.mean())
    assert base.predicted_agreement < 0.995
    assert "big" in r.excluded and r.curve[-1].predicted_agreement > base.predicted_agreement
    _, as_classes = _exclusion(Target(0.995, task="classifier"))
    assert as_classes.reached and len(as_classes.curve) == 1 and as_classes.curve[0].agreement == 1.0


def test_quantize_judges_an_encoder_by_its_pooled_vectors(tmp_path):
    """The rounding check (and any verified step) judges an encoder's token states as eval does: each sample's
    vector mean-pooled over its mask, by cosine to fp32's, never as per-position classes; --task says otherwise."""
    import json
    from qtool.quantize.samples import SampleSet
    from qtool.quantize.verify import ENCODER, judge_of
    work = _workdir(tmp_path, encoder_model())
    check = json.load(open(os.path.join(work, "quantize.json")))["rounding_check"]
    assert check["verdict"]["judge"] == ENCODER, check

    model = encoder_model()
    feeds = _feeds(np.random.default_rng(9), 6)
    ref = run(model, feeds)[0]  # tokens [6, T, H]
    samples = SampleSet([str(k) for k in range(6)], feeds, ref, output="tokens")
    judge = judge_of(model, samples)
    noisy = ref + np.random.default_rng(1).standard_normal(ref.shape).astype(np.float32) * 0.3
    m = feeds["attention_mask"][..., None].astype(np.float64)
    a, b = (ref * m).sum(1) / m.sum(1), (noisy * m).sum(1) / m.sum(1)
    want = 1 - (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert judge.kind == ENCODER and np.allclose(judge.error(ref, noisy), want, rtol=1e-9, atol=1e-12)
    assert judge.counted(ref, noisy) is None
    assert judge_of(model, samples, "classifier").kind != ENCODER


def test_padding_does_not_pull_the_rounding():
    """Output-aware rounding fits each weight layer to the covariance of its input over the real tokens only:
    what sits at a padded position (masked away downstream) leaves it unchanged, while the same ids read as
    real tokens (a mask of ones) change it."""
    from qtool.quantize.rounding import layer_hessians
    model = encoder_model()
    for node in model.graph.node:  # (named as calibrate's fused graph names its nodes)
        node.name = node.output[0]
    rng = np.random.default_rng(3)
    feeds = _feeds(rng, 40)
    real = feeds["attention_mask"] == 1
    other = {**feeds, "input_ids": np.where(real, feeds["input_ids"], rng.integers(1, VOCAB, real.shape))}
    a, b = layer_hessians(model, [feeds]), layer_hessians(model, [other])
    assert set(a) == set(b) and "m1" in a  # (the token states' layer)
    assert all(np.allclose(a[k], b[k], rtol=1e-6, atol=1e-9) for k in a)
    unmasked = layer_hessians(model, [{**other, "attention_mask": np.ones_like(feeds["attention_mask"])}])
    assert not np.allclose(unmasked[next(iter(a))], a[next(iter(a))], rtol=1e-3)


def test_dynamic_inputs_measure_an_encoder_by_its_vectors():
    """The dynamic-input choice takes the model's SQNR on what the encoder judge reads: noise at padded
    positions (masked away downstream) costs nothing there, while the raw states count it; another task's
    output is taken as it is."""
    from qtool.metrics import sqnr_db
    from qtool.quantize.samples import SampleSet
    from qtool.quantize.steps.dynamic_inputs import judged_view
    model = encoder_model()
    feeds = _feeds(np.random.default_rng(5), 6)
    ref = run(model, feeds)[0]
    samples = SampleSet([str(k) for k in range(6)], feeds, ref, output="tokens")
    padded = feeds["attention_mask"] == 0
    assert padded.any()
    noisy = ref + np.where(padded[..., None], 5.0, 0.0).astype(np.float32)
    view = judged_view(SimpleNamespace(fused=model, task=None), samples)
    assert sqnr_db(view(ref), view(noisy)) == float("inf") and np.isfinite(sqnr_db(ref, noisy))
    other = judged_view(SimpleNamespace(fused=model, task="classifier"), samples)
    assert np.isfinite(sqnr_db(other(ref), other(noisy)))
