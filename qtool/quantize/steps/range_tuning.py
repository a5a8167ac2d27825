"""--tune-ranges: activation ranges chosen at the model output on calibration samples (range_search.py)."""
from __future__ import annotations

import time

from qtool.quantize.context import QuantizeContext
from qtool.quantize.progress import bar, whole
from qtool.quantize.range_search import search_ranges
from qtool.quantize.samples import SampleSet
from qtool.quantize.state import Tuning
from qtool.quantize.step import Step


def tune_activation_ranges(ctx: QuantizeContext, samples: SampleSet, res: Tuning, say=print, show_progress: bool = True) -> None:
    """Activation ranges chosen at the model output on calibration `samples`: sets ctx.ranges."""
    from qtool.quantize.range_search import probe_count
    say(f"tuning activation ranges at the output on {len(samples)} calibration images")
    with bar(probe_count(ctx), "step", "tune ranges", show_progress) as pb:
        def exact(n):
            pb.total = n
            pb.refresh()
        res.search = search_ranges(ctx, samples, whole(pb), exact)
    ctx.record_samples("range tuning", samples)
    ctx.ranges = res.ranges = res.search.ranges or None
    s = res.search
    say(f"tuned ranges: {len(s.ranges)} tensors changed ({s.probes} probes), output SQNR on {len(samples)} "
        f"calibration images {s.sqnr_default_db:.1f} -> {s.sqnr_tuned_db:.1f} dB"
        + ("" if s.kept or not s.choices else "; not better, default ranges kept"))
    # (the search scored the model at the tuned ranges: layers whose input scale they changed are rounded
    # at those already, in ctx.weight_cache)


def when(run) -> bool:
    """--tune-ranges, tuning samples were decoded"""
    return run.on.tune_ranges and bool(len(run.tune_samples))


def samples(run) -> tuple:
    """the tuning samples; held-out ones with --verify"""
    return ("tune", "verify") if run.on.tune_ranges else ()


def tune(run) -> None:
    t0 = time.time()
    try:
        tune_activation_ranges(run.ctx, run.tune_samples, run.tuning, run.say, run.progress)
    finally:
        run.tuning.seconds += time.time() - t0


def calibrated(run) -> None:
    run.ctx.ranges = run.tuning.ranges = run.tuning.search = None


def verify(run) -> None:
    if run.ctx.ranges and len(run.held_out):
        v = run.verify("range tuning", "the method's ranges", ranges=None)
        if v is not None and not v.kept:
            calibrated(run)


STEP = Step("range tuning", tune, when, samples, fallback="the method's ranges", undo=calibrated, after=verify)
