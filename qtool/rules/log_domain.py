"""Spectra on their way to a Log stay fp32.

An audio front end computes a spectrum (a DFT as MatMul or Conv with a constant basis, squares
and sums of its real and imaginary parts, a square root, a mel or constant-Q filterbank) and
takes its Log. Speech and music spread such a spectrum over 60-90 dB; uint8 steps set by its loud
bins round every quiet bin to zero, and the Log turns that into its floor (swift-f0's pitch
tracker, every tensor int8 by default: 37 % of frames voiced in fp32, 13.5 % in int8, the pitch
within 50 cents on 53 % of the frames both call voiced; with its three spectra fp32, 37.4 %,
98.8 %). No per-tensor range fixes that, and a layer alone in fp32 does not either: the quiet bins
are lost wherever the spectrum is rounded first (the sensitivity guard's one-layer exclusion of
swift-f0's power Add measured 4.5 -> 3.7 dB).

So every node between a Log and the spectrum's source stays fp32: walking up from the Log's input
through elementwise arithmetic, data movement and reductions, and through linear ops with a
constant weight (a filterbank, the DFT) up to the second such op on a path (the DFT in a log-mel
front end), whose input (the framed waveform) is the front end's and may stay int8. The walk stops
at anything else (a Softmax before a Log, a Sigmoid, an LSTM), so a Log after a classifier keeps
its int8 network; a Log directly on a CNN's output keeps at most two layers fp32.
"""
from __future__ import annotations

from qtool import graph as G

# ops whose output keeps the spectrum's spread (or less of it): walked through
ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Sqrt", "Pow", "Abs", "Max", "Min", "Clip", "Relu", "Neg",
               "Reciprocal"}
MOVEMENT = {"Transpose", "Reshape", "Slice", "Squeeze", "Unsqueeze", "Concat", "Pad", "Gather", "Split",
            "Flatten", "Identity", "Expand", "Tile", "Cast"}
REDUCTIONS = {"ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL2", "ReduceL1", "ReduceMax"}
LINEAR = {"MatMul": 1, "Gemm": 1, "Conv": 1, "ConvTranspose": 1}  # op -> index of its weight input
MAX_LINEAR = 2  # a filterbank and the transform under it


def _weight_is_constant(node, inits: dict) -> bool:
    i = LINEAR[node.op_type]
    return len(node.input) > i and node.input[i] in inits


def log_domain(model) -> dict:
    """{node name: reason} of the nodes that feed a Log's input as described above."""
    inits = G.initializers(model)
    producer = {o: n for n in model.graph.node for o in n.output if o}
    keep: dict = {}
    for log in model.graph.node:
        if log.op_type != "Log" or not log.input or not log.input[0]:
            continue
        why = "feeds a Log: uint8 steps would round a spectrum's quiet values to zero"
        todo = [(log.input[0], 0)]
        seen = set()
        while todo:
            t, linear = todo.pop()
            node = producer.get(t)
            if node is None or (node.name, linear) in seen:
                continue
            seen.add((node.name, linear))
            op = node.op_type
            if op in LINEAR:
                if not _weight_is_constant(node, inits):
                    continue
                keep.setdefault(node.name, why)
                linear += 1
                if linear < MAX_LINEAR:
                    todo.append((node.input[0], linear))
                continue
            if op not in ELEMENTWISE and op not in MOVEMENT and op not in REDUCTIONS:
                continue
            keep.setdefault(node.name, why)
            one = (op in MOVEMENT and op != "Concat") or op in REDUCTIONS or op == "Pow"
            data = node.input[:1] if one else node.input
            todo += [(i, linear) for i in data if i and i not in inits]
    return keep
