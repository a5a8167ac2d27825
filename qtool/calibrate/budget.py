"""How many calibration samples a heavy model gets: a compute budget, spent evenly over the data.

Ranges and histograms settle within a few dozen samples, but one sample of a heavy model is
expensive: CRAFT (a VGG-16 U-Net text detector) at 960x1280 is 437 GMAC, 5.8 s of fp32 on a
2-core Zen 3, so 32 samples take three minutes for ranges that half as many give as well. The
budget is counted in multiply-accumulates, the same on every machine, so the same data gives the
same table anywhere. Samples are dropped in whole batches spread over the whole folder (a folder
sorted by class keeps every part of it), never the tail. A graph whose MACs cannot be counted is
not capped.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

DEFAULT_GMAC = 8000  # 8 TMAC: ~110 s of fp32 passes on a 2-core Zen 3; ResNet-50 x 1000 images is 4.1
MIN_SAMPLES = 16


@dataclass
class Spend:
    """What the budget did, for the manifest and the note."""
    budget_gmac: float
    available: int  # samples the data offered
    gmac_per_sample: float | None = None  # None: not counted (then nothing was capped)
    planned: int | None = None  # samples the budget allows (None: all)
    used: int = 0

    @property
    def capped(self) -> bool:
        return self.planned is not None

    def note(self) -> str:
        per = self.gmac_per_sample
        return (f"calibrate: {self.available} samples x {per:.0f} GMAC = {self.available * per / 1000:.1f} TMAC, "
                f"over the {self.budget_gmac / 1000:g} TMAC budget: using about {self.planned}, spread evenly over "
                f"the data (--budget-gmac 0 uses all)")

    def to_dict(self) -> dict:
        return asdict(self)


def planned_samples(available: int, gmac_per_sample: float | None, budget_gmac: float,
                    min_samples: int = MIN_SAMPLES) -> int | None:
    """Samples to use, or None for all of them (no budget, uncounted cost, or within budget)."""
    if not budget_gmac or not gmac_per_sample or gmac_per_sample <= 0 or available <= min_samples:
        return None
    n = max(min_samples, int(budget_gmac // gmac_per_sample))
    return None if n >= available else n


def within_budget(batches, available: int, macs_of, budget_gmac: float = DEFAULT_GMAC, say=None,
                  min_samples: int = MIN_SAMPLES, spend: Spend | None = None):
    """`batches` (names, feeds) as the sources yield them, thinned to the budget. `macs_of(feeds)`:
    the MACs of one batch (None when not countable), asked of the first batch only (every sample of
    a folder has the same cost but for dynamic sizes, where the first stands for all). A batch is
    kept while that brings the samples used closer to the even share of those seen so far.
    `spend` is filled in as it goes; `say` is told the plan once, when it caps."""
    spend = spend if spend is not None else Spend(budget_gmac, available)
    plan = None
    seen = 0
    for names, feeds in batches:
        k = len(names)
        if seen == 0:
            macs = macs_of(feeds) if budget_gmac and available > min_samples else None
            spend.gmac_per_sample = None if not macs or not k else macs / k / 1e9
            plan = planned_samples(available, spend.gmac_per_sample, budget_gmac, min_samples)
            spend.planned = plan
            if plan is not None and say is not None:
                say(spend.note())
        seen += k
        if plan is None or seen == k or spend.used + k / 2 <= plan * seen / available:
            spend.used += k
            yield names, feeds
