"""quantize/exclude.py: an exclusion stays only if it helps beyond the images' own noise."""
from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import onnx
from onnx import TensorProto, helper
from qtool.metrics import kl_softmax_each, position_top1_agreement
from qtool.quantize import exclude
from qtool.quantize.exclude import Target, exclude_sensitive
from qtool.quantize.samples import SampleSet

N, CLASSES = 100, 10


class FakeContext:
    """Scores a model by its exclusions alone: `big` cuts the int8 noise to a third on every image;
    `small` scales it per image by `small_scale` (its own array)."""
    exclude: dict = {}
    workers = 1
    exact_storage = False
    experiments = None  # (its models scored here, not on a Ray cluster)
    fused = onnx.ModelProto()  # (no graph: its output is no distribution)

    def __init__(self, small_scale):
        rng = np.random.default_rng(0)
        self.ref = rng.normal(0, 3, (N, CLASSES)).astype(np.float32)
        self.noise = rng.normal(0, 0.5, (N, CLASSES)).astype(np.float32)
        self.small_scale = small_scale

    def score(self, feeds, excl, threads=None):
        noise = self.noise * (0.3 if "big" in excl else 1.0)
        if "small" in excl:
            noise = noise * self.small_scale[:, None]
        return self.ref + noise, SimpleNamespace(model=None)


def _run(small_scale):
    ctx = FakeContext(small_scale)
    samples = SampleSet([f"{k}" for k in range(N)], {"x": np.zeros((N, 1), np.float32)}, ctx.ref)
    ranking = [SimpleNamespace(name="big", rank=1, order=0), SimpleNamespace(name="small", rank=2, order=1)]
    # (the rule for one layer at a time: the block of both, tried whole, would stand in for the two steps)
    with patch.object(exclude, "BLOCKS", ()):
        return exclude_sensitive(ctx, ranking, samples, Target(1.01, max_excluded=2), measure_latency=False)


def test_an_exclusion_whose_gain_is_within_the_noise_is_undone():
    # half the images better, half worse, the mean KL 2 % lower (KL grows as the noise squared)
    ctx = FakeContext(None)
    k = kl_softmax_each(ctx.ref, ctx.ref + 0.3 * ctx.noise)
    even = np.arange(N) % 2 == 0
    odd_scale = np.sqrt((0.98 * k.sum() - 0.64 * k[even].sum()) / k[~even].sum())
    r = _run(np.where(even, 0.8, odd_scale))
    steps = {p.added: p for p in r.curve if p.added}
    assert steps["big"].kept and steps["big"].gain_se > 5
    assert steps["small"].kl < steps["big"].kl  # a better mean, which the old rule kept
    assert not steps["small"].kept and abs(steps["small"].gain_se) < 1
    assert set(r.excluded) == {"big"}


def test_a_small_gain_on_every_image_is_kept():
    r = _run(np.full(N, 0.97))
    steps = {p.added: p for p in r.curve if p.added}
    assert steps["small"].kept and steps["small"].gain_se > 5
    assert set(r.excluded) == {"big", "small"}


def test_the_report_says_the_gain_in_standard_errors():
    r = _run(np.full(N, 0.97))
    assert all(p.gain_se is not None for p in r.curve[1:])
    assert "gain_se" in r.to_dict()["curve"][1]


class PairContext(FakeContext):
    """Only r1 and r2 kept fp32 together cut the noise (the two readers of one noisy tensor: its
    quantizer goes only when both do); either alone changes nothing."""

    def score(self, feeds, excl, threads=None):
        both = "r1" in excl and "r2" in excl
        return self.ref + self.noise * (0.3 if both else 1.0), SimpleNamespace(model=None)


def _pair_run(noisy):
    ctx = PairContext(None)
    samples = SampleSet([f"{k}" for k in range(N)], {"x": np.zeros((N, 1), np.float32)}, ctx.ref)
    ranking = [SimpleNamespace(name=n, rank=k, order=k) for k, n in enumerate(("a", "r1", "r2"), 1)]
    return exclude_sensitive(ctx, ranking, samples, Target(1.01, max_excluded=3), measure_latency=False, noisy=noisy)


def test_the_readers_of_a_noisy_quantizer_are_tried_together():
    from qtool.quantize.quantizer_noise import QuantizerNoise
    noisy = [QuantizerNoise("t", 12.0, ["r1", "r2"])] + [QuantizerNoise(f"u{k}", 40.0, ["a"]) for k in range(3)]
    r = _pair_run(noisy)
    assert set(r.excluded) == {"r1", "r2"}
    assert "reads t" in r.excluded["r1"]
    assert "r1+r2" in r.leave_one_out
    # one layer at a time, neither helps: nothing stays
    assert _pair_run(None).excluded == {}


def test_a_quantizer_no_noisier_than_the_rest_proposes_nothing():
    from qtool.quantize.exclude import noisy_groups
    from qtool.quantize.quantizer_noise import QuantizerNoise
    rank = {"a": 1, "r1": 2, "r2": 3, "r3": 4, "r4": 5}
    same = [QuantizerNoise("t", 35.0, ["r1", "r2"])] + [QuantizerNoise(f"u{k}", 40.0, ["a"]) for k in range(3)]
    assert noisy_groups(same, rank, {}, [], 5) == []
    loud = [QuantizerNoise("t", 10.0, ["r1", "r2", "r3", "r4"]), QuantizerNoise("v", 11.0, ["r1", "x"]),
            QuantizerNoise("w", 12.0, ["r3"])] + [QuantizerNoise(f"u{k}", 40.0, ["a"]) for k in range(3)]
    # too many readers, a reader that is no layer of the ranking, one already a candidate: only w's
    assert [g for g, _ in noisy_groups(loud, rank, {}, [], 5)] == [("r3",)]
    assert noisy_groups(loud, rank, {}, [("r3",)], 5) == []


class DecisionContext(FakeContext):
    """An output of one value per position ([N, T, 1]: a word boundary per character, a sigmoid), int8 noise
    far from every decision: no position flips."""

    def __init__(self):
        rng = np.random.default_rng(1)
        self.ref = np.where(rng.random((N, 40, 1)) < 0.3, 0.9, 0.1).astype(np.float32)
        self.noise = rng.normal(0, 0.01, self.ref.shape).astype(np.float32)

    def score(self, feeds, excl, threads=None):
        return self.ref + self.noise * (0.3 if "big" in excl else 1.0), SimpleNamespace(model=None)


def test_one_value_per_position_is_a_decision_at_each_position():
    """hx8's deepcut tagger ([chars, 1]): agreement was an argmax over a sample's positions, predicted 0.62
    whatever was kept, and 5 layers were kept fp32 for a model whose every decision already agreed."""
    ctx = DecisionContext()
    samples = SampleSet([f"{k}" for k in range(N)], {"x": np.zeros((N, 1), np.float32)}, ctx.ref)
    r = exclude_sensitive(ctx, [SimpleNamespace(name="big", rank=1, order=0)], samples, Target(max_excluded=2),
                          measure_latency=False)
    first = r.curve[0]
    assert first.agreement == 1.0 and first.predicted_agreement > 0.999 and first.images == N
    assert r.reached and len(r.curve) == 1 and not r.excluded
    assert r.error == "-SQNR" and first.kl == -first.sqnr_db


def test_an_undone_step_says_why():
    r = _run(np.full(N, 1.2))  # keeping "small" fp32 makes every image worse
    steps = {p.added: p for p in r.curve if p.added}
    assert steps["small"].undone == "no better than the best so far" and not steps["small"].kept
    assert steps["big"].undone == "" and steps["big"].kept


class BlockContext(FakeContext):
    """Layers a and b (the first two in graph order) cut the noise only together; either alone adds to it
    (PP-OCRv2's recognizer: each of its first eight convolutions kept fp32 alone read fewer crops, the eight
    together as many as fp32); c, the most sensitive alone, changes nothing."""

    def score(self, feeds, excl, threads=None):
        both, one = "a" in excl and "b" in excl, ("a" in excl) != ("b" in excl)
        return self.ref + self.noise * (0.3 if both else 1.3 if one else 1.0), SimpleNamespace(model=None)


def _block_run():
    ctx = BlockContext(None)
    samples = SampleSet([f"{k}" for k in range(N)], {"x": np.zeros((N, 1), np.float32)}, ctx.ref)
    ranking = [SimpleNamespace(name="c", rank=1, order=2), SimpleNamespace(name="a", rank=2, order=0),
               SimpleNamespace(name="b", rank=3, order=1)]
    return exclude_sensitive(ctx, ranking, samples, Target(1.01, max_excluded=2), measure_latency=False)


def test_a_block_of_layers_is_tried_whole():
    r = _block_run()
    assert set(r.excluded) == {"a", "b"}
    assert "first 2 int8 layers" in r.excluded["a"]
    assert r.leave_one_out["a"]["kl"] > r.curve[0].kl  # alone, a made it worse
    with patch.object(exclude, "BLOCKS", ()):  # one layer at a time, none helps: nothing stays
        assert _block_run().excluded == {}


def test_a_block_counts_each_of_its_layers_against_the_cap():
    ctx = BlockContext(None)
    samples = SampleSet([f"{k}" for k in range(N)], {"x": np.zeros((N, 1), np.float32)}, ctx.ref)
    ranking = [SimpleNamespace(name=n, rank=k, order=k) for k, n in enumerate("ab", 1)]
    r = exclude_sensitive(ctx, ranking, samples, Target(1.01, max_excluded=1), measure_latency=False)
    assert r.excluded == {} and all(len(p.excluded) <= 1 for p in r.curve)


def _softmax_graph() -> onnx.ModelProto:
    node = helper.make_node("Softmax", ["z"], ["p"], axis=-1)
    g = helper.make_graph([node], "rec", [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 10, 6])],
                          [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 10, 6])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def _probs(paths: np.ndarray, classes: int = 6) -> np.ndarray:
    z = 4.0 * np.eye(classes)[paths]
    e = np.exp(z - z.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


class RecognizerContext(FakeContext):
    """A CTC recognizer's [N, T, classes] (blank 0, a character at every third position). All int8, 30 samples
    read one character wrong; with L fp32 every text is fp32's, though 60 samples read a blank after a
    character as that character again (the same text once repeats merge): per position, worse."""
    fused = _softmax_graph()

    def __init__(self):
        rng = np.random.default_rng(2)
        paths = np.zeros((N, 10), np.int64)
        paths[:, 1::3] = rng.integers(1, 6, (N, 3))
        self.ref = _probs(paths)
        wrong, again = paths.copy(), paths.copy()
        wrong[:30, 1] = wrong[:30, 1] % 5 + 1
        again[:60, 2] = again[:60, 1]
        self.int8, self.fixed = _probs(wrong), _probs(again)

    def score(self, feeds, excl, threads=None):
        return (self.fixed if "L" in excl else self.int8), SimpleNamespace(model=None)


def test_a_recognizer_is_judged_by_the_texts_it_reads():
    ctx = RecognizerContext()
    samples = SampleSet([f"{k}" for k in range(N)], {"z": np.zeros((N, 1), np.float32)}, ctx.ref)
    # per position, keeping L fp32 looks worse: the judge that kept nothing on PP-OCRv2's recognizer
    assert position_top1_agreement(ctx.ref, ctx.fixed) < position_top1_agreement(ctx.ref, ctx.int8)
    r = exclude_sensitive(ctx, [SimpleNamespace(name="L", rank=1, order=0)], samples, Target(max_excluded=2),
                          measure_latency=False)
    assert r.figures == ("texts", "positions") and r.error == "gap err" and r.target.startswith("texts read")
    assert [p.agreement for p in r.curve] == [0.7, 1.0]  # the share of samples whose text is fp32's
    assert set(r.excluded) == {"L"} and r.curve[1].kept and r.curve[1].gain_se > 5  # 30 wins, no loss


def test_the_report_names_a_recognizers_figures():
    from qtool.report.sensitivity_html import render
    ctx = RecognizerContext()
    samples = SampleSet([f"{k}" for k in range(N)], {"z": np.zeros((N, 1), np.float32)}, ctx.ref)
    r = exclude_sensitive(ctx, [SimpleNamespace(name="L", rank=1, order=0)], samples, Target(max_excluded=2),
                          measure_latency=False)
    page = render({"layers": [], "exclusion": r.to_dict(), "meta": {}})
    assert "<th>texts</th><th>positions</th>" in page and ">agreement<" not in page


def test_a_block_over_a_layer_kept_already_leaves_its_reason():
    from qtool.quantize.exclude import with_group
    kept = {"a": "kept fp32 by --exclude-sensitive (sensitivity rank 1)"}
    assert with_group(kept, ("a", "b"), "a block") == {"a": kept["a"], "b": "a block"}
