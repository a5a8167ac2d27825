"""The int8 QDQ graph, built once with every choice the steps made (qdq.py)."""
from __future__ import annotations

from qtool.quantize.step import Step


def build(run) -> None:
    ctx = run.ctx
    final = dict(run.exclusion.excluded) if run.exclusion is not None else dict(ctx.exclude)
    run.final_exclude, run.out = final, ctx.build(final)
    if run.main_int8 and not run.out.plan.int8_nodes and not any(n.op_type == "If" for n in ctx.fused.graph.node):
        # (the guard or --exclude-sensitive kept every candidate fp32: onnx-asr's wespeaker front end, whose
        # one int8 layer alone left its output at 1.9 dB, was written fp32 without a word)
        run.say(f"note: every op that could run in int8 is kept fp32 ({', '.join(sorted(final)[:3])}"
                f"{', ...' if len(final) > 3 else ''}): the model written computes as the fp32 one does")


STEP = Step("build", build)
