"""--exclude-sensitive: the most sensitive layers kept fp32 until a target holds on the check samples
(exclude.py)."""
from __future__ import annotations

from qtool.quantize.exclude import (BLOCKS, CANDIDATES_PER_STEP, NOISY_GROUPS, POOL, Search, Target,
                                    search_exclusions, target_words)
from qtool.quantize.progress import bar
from qtool.quantize.step import Step


def run_exclusion(run):
    """The search on run.check (held back from the sensitivity analysis where run.check_held_back), against
    the labels of the calibration images where known; run.partial gets the result as it is built; the
    readers of quantizer_noise's noisiest quantizers (run.noisy) are candidates too."""
    opts, check, say = run.options.exclusion, run.check, run.say
    labels = None if run.labels is None else [run.labels.get(n, -1) for n in check.names]
    target = Target(opts.target_agreement, opts.max_drop, opts.max_excluded, labels, run.options.task)
    search = Search(run.ctx, check, target)  # (how the check samples are judged, found once: said, then used)
    encoder = search.encoder
    say(f"exclude-sensitive: keeping layers fp32 (at most {opts.max_excluded}) until "
        f"{target_words(target, encoder is not None, search.y_true is not None, search.texts is not None)} on "
        f"{len(check)} " + ("held-back calibration images" if run.check_held_back else "calibration images")
        + (f"; judged as an encoder's vectors ({encoder.why})" if encoder is not None else ""))
    with bar(1 + POOL + NOISY_GROUPS + 2 * len(BLOCKS) + opts.max_excluded * CANDIDATES_PER_STEP, "model",
             "exclude-sensitive (at most)", run.progress) as pb:
        search.progress = pb.update
        exclusion = search_exclusions(search, run.ranking, partial=run.partial, noisy=run.noisy)
        pb.total = pb.n  # the target held early: done
        pb.refresh()
    exclusion.check_images = len(check)
    exclusion.check_held_back = run.check_held_back
    return exclusion


def when(run) -> bool:
    """--exclude-sensitive, and the sensitivity analysis ranked some layer"""
    return run.on.exclusion and bool(run.ranking)


def samples(run) -> tuple:
    """the sensitivity samples and those held back from them"""
    return ("sensitivity", "held_back") if run.on.exclusion else ()


def search(run) -> None:
    run.exclusion = run_exclusion(run)


def so_far(run) -> None:
    run.exclusion = run.partial[-1] if run.partial else None


STEP = Step("exclusion", search, when, samples, fallback="the layers kept fp32 before the failure", undo=so_far)
