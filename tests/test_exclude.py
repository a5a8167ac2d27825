"""quantize/exclude.py: an exclusion stays only if it helps beyond the images' own noise."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
from qtool.metrics import kl_softmax_each
from qtool.quantize.exclude import exclude_sensitive
from qtool.quantize.samples import SampleSet

N, CLASSES = 100, 10


class FakeContext:
    """Scores a model by its exclusions alone: `big` cuts the int8 noise to a third on every image;
    `small` scales it per image by `small_scale` (its own array)."""
    exclude: dict = {}
    workers = 1
    exact_storage = False
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
    ranking = [SimpleNamespace(name="big", rank=1), SimpleNamespace(name="small", rank=2)]
    return exclude_sensitive(ctx, ranking, samples, target_agreement=1.01, max_excluded=2, measure_latency=False)


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
