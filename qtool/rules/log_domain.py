"""Spectra on their way to a Log, or to the square root of a power spectrum, stay fp32.

An audio front end computes a spectrum (a DFT as MatMul or Conv with a constant basis, squares
and sums of its real and imaginary parts, a square root, a mel or constant-Q filterbank) and
takes its Log. Speech and music spread such a spectrum over 60-90 dB; uint8 steps set by its loud
bins round every quiet bin to zero, and the Log turns that into its floor (swift-f0's pitch
tracker, every tensor int8 by default: 37 % of frames voiced in fp32, 13.5 % in int8, the pitch
within 50 cents on 53 % of the frames both call voiced; with its three spectra fp32, 37.4 %,
98.8 %). No per-tensor range fixes that, and a layer alone in fp32 does not either: the quiet bins
are lost wherever the spectrum is rounded first (the sensitivity guard's one-layer exclusion of
swift-f0's power Add measured 4.5 -> 3.7 dB).

A Log is taken for a front end's when everything above it is signal processing on the graph's
inputs: walking up from its input through elementwise arithmetic (no Relu: a network's), data
movement, reductions, linear ops with a constant weight and STFT/DFT reaches only graph inputs and
constants (Whisper's log-mel front end, STFT then a mel MatMul: 10.3 dB with that MatMul int8).
A Log after a Softmax, a Sigmoid, a Relu'd CNN or an LSTM is no front end's, and keeps its network
int8. For a front end's Log, the nodes on that walk down to the second linear op on each path (the
DFT under a mel or constant-Q filterbank) stay fp32; the DFT's input (the framed waveform) may stay
int8, and so may what a longer chain of filters computes before it (basic-pitch's octave
downsampling).

A magnitude spectrum taken as Sqrt(re^2 + im^2) from a DFT (Silero VAD's STFT: a Conv with a constant
basis, its real and imaginary halves sliced, squared and added) is a root too, though no Log follows:
the power under the Sqrt spans twice the magnitude's range in dB, and its quiet bins rounded to zero
stay zero (silero-vad 6.2.3, every tensor int8: 4-6 % of its 32 ms speech decisions flipped; the power
Add alone in fp32: 1 %). The magnitude itself, half that spread, may stay int8 for the network reading
it. Only a sum of squares of a linear transform's outputs counts, so a LayerNorm's Sqrt (of a mean of
centred squares) is none.
"""
from __future__ import annotations

from onnx import numpy_helper

from qtool import graph as G

# ops whose output keeps the spectrum's spread (or less of it): walked through
ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Sqrt", "Pow", "Abs", "Max", "Min", "Clip", "Neg", "Reciprocal"}
MOVEMENT = {"Transpose", "Reshape", "Slice", "Squeeze", "Unsqueeze", "Concat", "Pad", "Gather", "Split",
            "Flatten", "Identity", "Expand", "Tile", "Cast"}
REDUCTIONS = {"ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL2", "ReduceL1", "ReduceMax"}
LINEAR = ("MatMul", "Gemm", "Conv", "ConvTranspose")  # with one constant operand: a filterbank, a DFT
TRANSFORMS = ("STFT", "DFT")  # the DFT as one op (Whisper's and torch.stft's exports): linear on its signal
# a signal's preparation: which inputs carry it (NeMo masks the samples past each length with Where, Kaldi's
# front end edits its frames with ScatterElements, others frame with GatherElements)
PREPARATION = {"Where": (1, 2), "ScatterElements": (0, 2), "ScatterND": (0, 2), "GatherElements": (0,),
               "GatherND": (0,)}
MAX_LINEAR = 2  # a filterbank and the transform under it


def _weight_is_constant(node, inits: dict) -> bool:
    """A Conv's weight, or one of a MatMul's or Gemm's two operands (a DFT basis may come first)."""
    ops = node.input[:2]
    if node.op_type in ("Conv", "ConvTranspose"):
        return len(ops) == 2 and ops[1] in inits
    return len(ops) == 2 and (ops[0] in inits) != (ops[1] in inits)


def _data_inputs(node, inits: dict) -> list:
    op = node.op_type
    if op in LINEAR:
        data = node.input[:2]
    elif op in PREPARATION:
        data = [node.input[i] for i in PREPARATION[op] if i < len(node.input)]
    elif (op in MOVEMENT and op != "Concat") or op in REDUCTIONS or op in TRANSFORMS or op == "Pow":
        data = node.input[:1]
    else:
        data = node.input
    return [i for i in data if i and i not in inits]


def _walkable(node, inits: dict) -> bool:
    op = node.op_type
    if op in LINEAR:
        return _weight_is_constant(node, inits)
    return op in ELEMENTWISE or op in MOVEMENT or op in REDUCTIONS or op in TRANSFORMS or op in PREPARATION


def _front_end(t: str, producer: dict, inits: dict) -> bool:
    """Whether everything above tensor t is signal processing on the graph inputs."""
    todo, seen = [t], set()
    while todo:
        node = producer.get(todo.pop())
        if node is None or node.name in seen:
            continue  # (a graph input, or an outer scope's tensor in a subgraph)
        seen.add(node.name)
        if not _walkable(node, inits):
            return False
        todo += _data_inputs(node, inits)
    return True


def _transformed(t: str, producer: dict, inits: dict) -> bool:
    """Whether t is, through data movement only, what a DFT (a linear op with a constant weight, STFT/DFT) writes."""
    node = producer.get(t)
    while node is not None and node.op_type in MOVEMENT and node.input:
        node = producer.get(node.input[0])
    return node is not None and (node.op_type in TRANSFORMS or (node.op_type in LINEAR and _weight_is_constant(node, inits)))


def _squared(node, inits: dict) -> str | None:
    """a, for Pow(a, 2), Mul(a, a) or ReduceSumSquare(a); else None."""
    if node.op_type == "Mul" and len(node.input) == 2 and node.input[0] == node.input[1]:
        return node.input[0]
    if node.op_type == "ReduceSumSquare":
        return node.input[0]
    if node.op_type == "Pow" and len(node.input) == 2 and node.input[1] in inits:
        e = numpy_helper.to_array(inits[node.input[1]])
        return node.input[0] if e.size == 1 and float(e.ravel()[0]) == 2.0 else None
    return None


def _power_spectrum(t: str, producer: dict, inits: dict) -> bool:
    """Whether t is a sum of squares of a DFT's outputs (through Add/Sum/ReduceSum and data movement)."""
    todo, squares = [t], 0
    while todo:
        node = producer.get(todo.pop())
        if node is None:
            return False
        a = _squared(node, inits)
        if a is not None:
            if not _transformed(a, producer, inits):
                return False
            squares += 1
        elif node.op_type in ("Add", "Sum", "ReduceSum") or node.op_type in MOVEMENT:
            todo += _data_inputs(node, inits)
        else:
            return False
    return squares > 0


def log_domain(model) -> dict:
    """{node name: reason} of the nodes that feed a front end's Log or magnitude Sqrt as described above."""
    inits = G.initializers(model)
    producer = G.producers(model)
    keep: dict = {}
    for log in model.graph.node:
        if log.op_type not in ("Log", "Sqrt") or not log.input or not log.input[0] \
                or not _front_end(log.input[0], producer, inits):
            continue
        if log.op_type == "Sqrt" and not _power_spectrum(log.input[0], producer, inits):
            continue
        why = ("feeds a Log: uint8 steps would round a spectrum's quiet values to zero" if log.op_type == "Log" else
               "feeds a magnitude spectrum's Sqrt: uint8 steps would round its power's quiet bins to zero")
        todo = [(log.input[0], 0)]
        seen = set()
        while todo:
            t, linear = todo.pop()
            node = producer.get(t)
            if node is None or (node.name, linear) in seen:
                continue
            seen.add((node.name, linear))
            keep.setdefault(node.name, why)
            if node.op_type in LINEAR or node.op_type in TRANSFORMS:
                linear += 1
                if linear >= MAX_LINEAR:
                    continue
            todo += [(i, linear) for i in _data_inputs(node, inits)]
    return keep
