"""The quantizers whose noise alone costs the output most (quantizer_noise.py): their readers join the
exclusion's candidates."""
from __future__ import annotations

from qtool.quantize.quantizer_noise import quantizer_noise
from qtool.quantize.step import Step


def when(run) -> bool:
    """--exclude-sensitive, and the sensitivity analysis ranked some layer"""
    return run.on.exclusion and bool(run.ranking)


def rank(run) -> None:
    run.noisy = quantizer_noise(run.ctx, run.check, run.ctx.threads)


STEP = Step("quantizer noise", rank, when, fallback="exclusion candidates from the sensitivity ranking alone")
