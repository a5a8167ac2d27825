"""Steps a plan runs once: a plan serves one set of input shapes, so values computed only from
constants and from tensor shapes (Shape -> Gather -> Unsqueeze -> Concat -> Reshape's shape input,
the chains torch exports write around every attention) are the same on every run of it. They are
computed in the plan's trace run and left out of its later runs.

A shape is fixed by the input shapes unless an op decides it from values: NonZero-like ops always,
and shape-taking ops (Reshape, Expand, Slice, ...) when their shape/index inputs are not themselves
such fixed values. Shape/Size of a tensor whose shape is fixed is fixed."""
from __future__ import annotations

SHAPE_OPS = {"Shape", "Size"}
VALUE_SHAPED = {"NonZero", "Unique", "Compress", "NonMaxSuppression", "TopK", "StringSplit"}
# the output's shape comes from the values of inputs 1.. (the data input's shape aside)
SHAPE_ARGS = {"Reshape", "Expand", "Tile", "ConstantOfShape", "Slice", "Pad", "Resize", "Upsample", "Range",
              "Split", "Squeeze", "Unsqueeze", "OneHot", "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin",
              "ReduceProd", "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp", "CumSum", "Trilu",
              "Gather", "GatherElements", "GatherND", "ScatterND", "Where"}


def static_steps(steps, fixed_slots: set, const_slots: set) -> set:
    """Indices of the fp32 steps whose outputs depend only on constants and fixed shapes.
    fixed_slots: slots whose shape the input shapes fix (graph inputs, outputs of steps writing
    into plan buffers); const_slots: constants."""
    static = set(const_slots)
    fixed = set(fixed_slots) | set(const_slots)
    out = set()
    for k, st in enumerate(steps):
        ins = [i for i in st.ins if i is not None]
        if st.mode != "fp32" or st.uses_out:  # (a plan buffer is written on every run, never once)
            fixed.update(o for o in st.outs if o is not None)
            continue
        if st.op in SHAPE_OPS and ins and ins[0] in fixed:
            is_static = True
        else:
            is_static = all(i in static for i in ins) and st.op not in VALUE_SHAPED
        outs = [o for o in st.outs if o is not None]
        if is_static:
            out.add(k)
            static.update(outs)
            fixed.update(outs)
        elif all(i in fixed for i in ins) and st.op not in VALUE_SHAPED and \
                (st.op not in SHAPE_ARGS or all(i in static for i in ins[1:])):
            fixed.update(outs)
    return out
