"""Step fusion after compiling: a convolution and the Add that alone reads its output.

ResNet-style blocks end in Conv -> Add(residual): run apart, the convolution writes its whole
output to memory and the Add reads it back with the residual. Fused (steps.ConvAddStep), the Add
runs on each chunk of output rows while it is in cache. Only where the result is the same bits:
the convolution's uint8 output is read by that Add alone, is no graph output, and the residual
exists before the convolution runs (it is computed earlier, or is an input or a constant).
"""
from __future__ import annotations

from collections import Counter

from qtool.runtime import steps as S


def fuse_residual_adds(steps: list, K, keep: set) -> list:
    """`steps` with each fusable Conv + Add pair replaced by one ConvAddStep; `K` the kernels
    (fusion needs their conv2d_add), `keep` the slots read outside the steps (graph outputs)."""
    if not hasattr(K, "conv2d_add"):
        return steps
    producer, readers = {}, Counter()
    for i, st in enumerate(steps):
        for s in st.outs:
            producer[s] = i
        for s in set(st.ins):
            readers[s] += 1
    out, dropped = list(steps), set()
    for j, add in enumerate(steps):
        if type(add) is not S.AddStep:
            continue
        for side in (0, 1):
            c, r = add.ins[side], add.ins[1 - side]
            i = producer.get(c)
            conv = steps[i] if i is not None else None
            if type(conv) is not S.ConvStep or conv.K is not K or i in dropped or type(out[i]) is not S.ConvStep:
                continue
            if c == r or readers[c] != 1 or c in keep or producer.get(r, -1) >= i:
                continue
            out[i] = S.ConvAddStep(conv, add, conv_first=side == 0)
            dropped.add(j)
            break
    return [st for k, st in enumerate(out) if k not in dropped]
