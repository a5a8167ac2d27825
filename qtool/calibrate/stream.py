"""One stream of calibration batches observed: what run.py's pass does with the whole data, and a shard
worker (sharded.py) with its share. The feeds are noted on the way (the samples' names, the inputs'
distinct values) and thinned to the compute budget; collect.py observes them."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from qtool.calibrate.budget import Spend, within_budget
from qtool.calibrate.observed import Observed
from qtool.calibrate.distinct import DistinctValues


@dataclass
class Seen:
    """What the calibration pass observed."""
    obs: Observed | None
    names: list  # sample index -> file (or sample) name, for naming the samples that hold NaN/inf
    distinct: dict  # model input -> its distinct values while few (lattice.py: an 8-bit image's grid)
    spend: Spend
    skipped: list = field(default_factory=list)  # unreadable files, in the data's order
    phases: dict = field(default_factory=dict)  # a sharded pass: seconds the driver spent per phase of it

    def merge(self, other: "Seen") -> None:
        """Add a later shard's names, distinct values and skipped files (its Observed is folded apart:
        sharded.py)."""
        self.names.extend(other.names)
        for k, d in other.distinct.items():
            self.distinct.setdefault(k, DistinctValues()).merge(d)
        self.skipped.extend(other.skipped)


def noted_feeds(source, seen: Seen, macs, planned, inputs: set):
    """The source's feeds within the budget; each batch's sample names, and the inputs' distinct values, noted."""
    s = seen.spend
    for n, f in within_budget(source.batches(), len(source), macs, s.budget_gmac, planned, spend=s):
        seen.names.extend(os.path.abspath(x) if source.kind != "iterable" else x for x in n)
        for k, v in f.items():
            if k in inputs:  # (an integer input gives up at once: DistinctValues keeps float values only)
                seen.distinct.setdefault(k, DistinctValues()).add(v)
        yield f
