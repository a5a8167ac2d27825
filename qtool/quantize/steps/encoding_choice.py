"""The target's weight encoding per layer: small layers store uint8 + 128 where the target's pair-safe
int8 would cost precision (encoding.portable_u8_layers)."""
from __future__ import annotations

from qtool import graph as G
from qtool.quantize.context import QuantizeContext
from qtool.quantize.encoding import PAIR_SAFE, TARGETS, U8, portable_u8_layers
from qtool.quantize.samples import SampleSet
from qtool.quantize.step import Step


def choose_encodings(ctx: QuantizeContext, samples: SampleSet, say=print) -> dict:
    """node -> why, for the layers whose weights are stored uint8 + 128 where the target's rule is
    pair-safe (encoding.portable_u8_layers), measured at the largest sample's shapes."""
    if TARGETS[ctx.target].encoding != PAIR_SAFE:
        return {}
    if len(samples):
        shapes = {k: list(v.shape) for k, v in samples.widest().items()}
    else:  # (no calibration images recorded: the inputs' own shapes, where static)
        shapes = {i.name: [1] + G.input_dims(i)[1:] for i in G.real_inputs(ctx.fused)}
        if any(not isinstance(d, int) for dims in shapes.values() for d in dims):
            return {}
    chosen = portable_u8_layers(ctx.fused, shapes)
    if chosen:
        say(f"{len(chosen)} small layer(s) store their weights as uint8 + 128 (exact everywhere) where pair-safe "
            f"int8 would cost precision: {', '.join(sorted(chosen)[:5])}{' ...' if len(chosen) > 5 else ''}")
    return chosen


def choose(run) -> None:
    run.encoding_reasons = choose_encodings(run.ctx, run.samples, run.say)


def verify(run) -> None:
    run.ctx.encodings = {name: U8 for name in run.encoding_reasons}
    if run.ctx.encodings and len(run.held_out):
        v = run.verify("encoding choice", "the target's encoding for every layer", encodings={})
        if v is not None and not v.kept:
            run.ctx.encodings, run.encoding_reasons = {}, {}


STEP = Step("encoding choice", choose, fallback="the target's encoding for every layer", after=verify)
