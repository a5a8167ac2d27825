"""Which node runs in int8, which tensor gets quantized, and why: fused graph -> Plan.

The plan is computed from the fused fp32 graph alone (plus user exclusions), so the
calibration step can ask it which tensors to observe and the quantizer can write the
same decisions into the QDQ graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from qtool import graph as G
from qtool.rules import FUSABLE_ACTIVATIONS, RULES
from qtool.rules.activations import activation_chains
from qtool.rules.log_domain import log_domain

FLOAT = onnx.TensorProto.FLOAT


@dataclass
class NodeDecision:
    name: str
    op_type: str
    status: str  # "int8", "passthrough", "fp32", "fused"
    reason: str = ""


@dataclass
class Plan:
    decisions: list = field(default_factory=list)  # NodeDecision per node, graph order
    int8_nodes: set = field(default_factory=set)  # names of compute + passthrough nodes in int8
    fused: dict = field(default_factory=dict)  # activation node name -> (producer name, lo, hi)
    tensors: list = field(default_factory=list)  # tensors that get Q/DQ, graph order
    shared: dict = field(default_factory=dict)  # passthrough output -> the input whose qparams it reuses
    clamp: dict = field(default_factory=dict)  # tensor -> (lo, hi) of a fused Relu/Clip
    weight_inputs: dict = field(default_factory=dict)  # node name -> activation tensor its weight multiplies
    float_ended: set = field(default_factory=set)  # ops without weights left fp32 for their fp32 output
    dynamic: dict = field(default_factory=dict)  # layer -> the fp32 input it quantizes at run time (no static pair)

    def decision(self, name):
        return next(d for d in self.decisions if d.name == name)

    def summary(self) -> dict:
        out = {}
        for d in self.decisions:
            out[d.status] = out.get(d.status, 0) + 1
        return out


def elem_types(model: onnx.ModelProto) -> dict:
    try:
        inferred = onnx.shape_inference.infer_shapes(G.skeleton(model), strict_mode=False)
    except Exception:
        inferred = model
    vis = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
    types = {v.name: v.type.tensor_type.elem_type for v in vis if v.type.tensor_type.elem_type}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    if any(n.domain not in ("", "ai.onnx", "ai.onnx.ml") for n in model.graph.node):
        types.update(_ort_types(model, types))
    return types


def _ort_types(model: onnx.ModelProto, known: dict) -> dict:
    """The types ONNX's inference leaves unknown, as ONNX Runtime infers them: ONNX knows nothing of the
    com.microsoft ops an ORT-optimized transformer holds (Attention, EmbedLayerNormalization), so every
    tensor they write looked float, and an experiment cut at Attention's int32 mask index declared it
    float and could not load. One session of the skeleton (no weights, nothing run) with those tensors
    as outputs; {} if ONNX Runtime cannot build it either."""
    from qtool.ortsession import onnx_type, session

    missing = [o for n in model.graph.node for o in n.output if o and o not in known]
    if not missing:
        return {}
    sk = G.skeleton(model)
    have = {o.name for o in sk.graph.output}
    for o in missing:
        if o not in have:
            sk.graph.output.add().name = o
    try:
        s = session(sk, threads=1, basic=True)
    except Exception:  # noqa: BLE001 - a custom op of no registered domain: the types stay unknown
        return {}
    wanted = set(missing)
    return {o.name: onnx_type(o.type) for o in s.get_outputs() if o.name in wanted and onnx_type(o.type)}


def _clip_bounds(node, model):
    if node.op_type == "Relu":
        return 0.0, np.inf
    if G.opset(model) < 11:
        return float(G.attr(node, "min", -np.inf)), float(G.attr(node, "max", np.inf))
    lo = G.const_value(model, node.input[1]) if len(node.input) > 1 and node.input[1] else -np.inf
    hi = G.const_value(model, node.input[2]) if len(node.input) > 2 and node.input[2] else np.inf
    if lo is None or hi is None:
        return None
    return float(np.asarray(lo).ravel()[0]), float(np.asarray(hi).ravel()[0])


@dataclass
class ModelFacts:
    """What planning reads of a model that no exclusion changes: worked out once for a caller that
    plans the same graph many times (sensitivity plans once per layer)."""
    types: dict
    consumers: dict
    chains: dict  # node -> the recognised activation it sits inside
    order: list  # topological order of the nodes
    checks: dict = field(default_factory=dict)  # node -> its rule's own verdict (None: may be int8)
    weighted: dict = field(default_factory=dict)  # node -> whether its rule names a weight
    log_domain: dict = field(default_factory=dict)  # node -> why it stays fp32: it feeds a Log (rules/log_domain.py)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> "ModelFacts":
        f = cls(elem_types(model), G.consumers(model), activation_chains(model), G.topological_order(model))
        f.log_domain = log_domain(model)
        with G.initializers_frozen(model):
            for node in model.graph.node:
                rule = RULES.get(node.op_type)
                if rule is not None:
                    f.checks[node.name] = rule.check(node, model)
                    f.weighted[node.name] = rule.weight(node, model) is not None
        return f


def make_plan(model: onnx.ModelProto, exclude: dict | None = None, ranges: dict | None = None,
              prune_excluded: bool = True, facts: ModelFacts | None = None, dynamic=()) -> Plan:
    """`exclude`: node name -> reason, for nodes the user (or --exclude-sensitive) keeps in fp32.
    `dynamic`: layers with a weight whose input is quantized at run time (quantize/dynamic.py): their
    input gets no static pair for them.
    With `prune_excluded`, an int8 output read only by excluded nodes is not quantized (sensitivity
    turns it off: a layer measured alone keeps its own output quantizer).
    `ranges` (tensor -> [lo, hi], once calibrated) lets rules refuse on ranges (Concat of very
    different ranges); without it the plan is the superset calibration observes."""
    with G.initializers_frozen(model):  # the rules look up every node's constants; the plan changes none
        plan = _plan(model, exclude or {}, ranges, prune_excluded, facts or ModelFacts.of(model), set(dynamic))
        if dynamic:
            _drop_dynamic_only(model, plan, facts or ModelFacts.of(model))
        return plan


def _plan(model: onnx.ModelProto, exclude: dict, ranges: dict | None, prune_excluded: bool,
          facts: ModelFacts, dynamic: set) -> Plan:
    plan = Plan()
    # a spectrum on its way to a Log stays fp32 in every plan, as an exclusion no one can lift
    exclude = {**facts.log_domain, **exclude}
    types, cons = facts.types, facts.consumers
    outputs = G.graph_output_names(model)
    inits = G.initializers(model)
    # tensors available in int8: those int8 ops produce, and float graph inputs (quantized at the input,
    # so a Slice/Split/Reshape reading the model input directly, as YOLOX's Focus stem does, passes int8 on)
    chains = facts.chains  # hard-swish's Add/Clip/Mul/Div: one fp32 unit between int8 tensors
    int8_out = {i.name for i in G.real_inputs(model) if types.get(i.name, FLOAT) == FLOAT}
    for node in model.graph.node:
        rule = RULES.get(node.op_type)
        if node.name in plan.fused:
            continue
        if rule is None:
            why = "no int8 rule for this op"
            if node.op_type in FUSABLE_ACTIVATIONS:
                why = "activation whose producer is not int8"
            plan.decisions.append(NodeDecision(node.name, node.op_type, "fp32", why))
            continue
        reason = exclude.get(node.name) or (f"inside {chains[node.name]}: runs fp32 between its int8 input and "
                                            f"int8 output" if node.name in chains else None) or facts.checks[node.name]
        acts = [node.input[i] for i in rule.act_inputs(node) if i < len(node.input) and node.input[i]]
        if reason is None and any(types.get(a, FLOAT) != FLOAT for a in acts):
            reason = "input is not float32"
        if reason is None and rule.kind == "passthrough" and acts[0] not in int8_out:
            reason = "input is not int8"
        if reason is None and any(a in inits for a in acts):
            reason = "an activation input is a constant"
        if reason is None and rule.int8_input and not any(a in int8_out for a in acts):
            reason = "no input is int8 (fp32 data movement is exact; int8 readers quantize the result)"
        if reason is None and ranges is not None:
            reason = rule.range_check(node, ranges)
        if reason is not None:
            plan.decisions.append(NodeDecision(node.name, node.op_type, "fp32", reason))
            continue
        status = "int8" if rule.kind == "compute" else "passthrough"
        plan.decisions.append(NodeDecision(node.name, node.op_type, status, ""))
        plan.int8_nodes.add(node.name)
        out = node.output[0]
        if rule.kind == "passthrough":
            # every output (Split has several) carries the data input's scale and zero point
            for o in node.output[1:]:
                if o and o not in outputs:
                    plan.shared[o] = acts[0]
                    int8_out.add(o)
                    if o not in plan.tensors:
                        plan.tensors.append(o)
            plan.shared[out] = acts[0]
        elif facts.weighted[node.name]:
            plan.weight_inputs[node.name] = acts[0]
            if node.name in dynamic:
                plan.dynamic[node.name] = acts[0]
        # a Relu/Clip that alone reads this output is implemented by the output's clamp
        users = cons.get(out, [])
        if rule.kind == "compute" and len(users) == 1 and users[0].op_type in FUSABLE_ACTIVATIONS \
                and out not in outputs and users[0].output[0] not in outputs and users[0].name not in exclude \
                and not any(G._subgraphs(c) for c in cons.get(users[0].output[0], [])):
            # (nor one whose output an If branch reads by name: that reads the tensor itself, not its Q/DQ)
            # (a Relu writing a graph output stays: outputs are left fp32, so no clamp would replace it)
            b = _clip_bounds(users[0], model)
            if b is not None and b[0] <= 0.0 <= b[1]:
                plan.fused[users[0].name] = (node.name, b[0], b[1])
                plan.decisions.append(NodeDecision(users[0].name, users[0].op_type, "fused",
                                                   f"range clamp of {node.name}'s output"))
                out = users[0].output[0]
                plan.clamp[out] = b
        for a in acts:
            if a not in plan.tensors and node.name not in plan.dynamic:
                plan.tensors.append(a)
        if out not in outputs:
            int8_out.add(out)
            if out not in plan.tensors:
                plan.tensors.append(out)
    _drop_unread_outputs(model, plan, facts.order)
    if prune_excluded:
        _drop_excluded_only(model, plan, cons, exclude)
        # (not for a layer measured alone, every other one excluded: in the model it is measured for,
        # its output feeds int8 ops; ending it fp32 here would report it free: magika's LayerNorm
        # Square, which alone leaves the output at 4.1 dB, measured exact and was not guarded)
        _drop_float_ended(model, plan, facts)
    else:  # (a layer measured alone: the rest is excluded but keeps its quantizers; a Log's chain does not)
        _drop_excluded_only(model, plan, cons, facts.log_domain)
    # (with or without pruning: a chain no int8 layer reads rounds the same for a layer measured alone; left
    # in a measured variant and not in the model it is measured against, every variant re-ran from the graph
    # input, and the chain's rounding was counted against each layer)
    _drop_idle_passthrough(model, plan, facts)
    _explain_chains(model, plan, chains)
    return plan


def _drop_unread_outputs(model: onnx.ModelProto, plan: Plan, order: list) -> None:
    """The last int8 op before the graph outputs keeps its output fp32 when only fp32 ops read it and
    no int8 op follows anywhere downstream (the classic case: the final MatMul before a bias Add and
    Softmax). A Q/DQ pair there adds rounding error right at the output for no int8 work after it;
    the op itself still reads int8 inputs and int8 weights."""
    feeds_int8 = G.tensors_reaching(model, plan.int8_nodes, order)
    produced = {n.output[0]: n for n in model.graph.node if n.name in plan.int8_nodes and n.output}
    for t in list(plan.tensors):
        node = produced.get(t)
        if node is None or t in plan.shared or t in plan.shared.values() or t in feeds_int8:
            continue
        _unquantize(model, plan, t, "activation runs fp32: its output is left fp32")
        d = plan.decision(node.name)
        d.reason = "output left fp32: only fp32 ops read it on the way to the graph output"


def _drop_dynamic_only(model: onnx.ModelProto, plan: Plan, facts: ModelFacts) -> None:
    """A static pair whose int8 readers are all layers that quantize their input at run time only
    rounds (before the dynamic quantizer rounds again): the tensor stays fp32 for them. Its producer,
    an op without weights that then writes fp32 only, runs fp32 (_drop_float_ended)."""
    readers = facts.consumers
    while True:  # (an op made fp32 here frees its inputs' pairs in turn)
        # outputs whose pair goes where no int8 op reads them: not those of a weighted op that needs its output
        # pair to run int8 (_int8_with_float_output): eeg-spindle-seg's 25 convolutions into fp32 GELUs all
        # lost theirs once its MatMuls went dynamic
        made_int8 = {o for n in model.graph.node if n.name in plan.int8_nodes and RULES[n.op_type].kind == "compute"
                     and not (facts.weighted.get(n.name) and not _int8_with_float_output(n)) for o in n.output}
        before = len(plan.tensors)
        for t in list(plan.tensors):
            if t in plan.shared or t in plan.shared.values() or t in plan.clamp:
                continue
            int8 = [u for u in readers.get(t, []) if u.name in plan.int8_nodes]
            if int8 and all(u.name in plan.dynamic for u in int8):
                _unquantize(model, plan, t, "activation runs fp32: only layers quantizing it at run time read it")
            elif not int8 and t in made_int8:
                _unquantize(model, plan, t, "activation runs fp32: no int8 op reads it")
        _drop_float_ended(model, plan, facts)
        if len(plan.tensors) == before:
            return


def _int8_with_float_output(node: onnx.NodeProto) -> bool:
    """Whether ONNX Runtime runs this weighted op int8 with no quantizer on its output: a MatMul on int8 inputs
    writes float (MatMulIntegerToFloat); a Conv or Gemm runs int8 only with its output pair (QLinearConv;
    without it a float Conv on weights dequantized each run, still reported int8)."""
    return node.op_type == "MatMul"


def _drop_float_ended(model: onnx.ModelProto, plan: Plan, facts: ModelFacts) -> None:
    """An int8 op without weights whose output stays fp32 (a Sigmoid writing the graph output, a
    Concat of a detector's heads) does no int8 work: ONNX Runtime dequantizes its inputs and runs it in
    fp32, so the Q/DQ pairs on its inputs only round. DBNet's probability map was a Sigmoid of logits
    quantized in steps of 0.8, which moved every contour at the 0.3 threshold outwards. Such an op
    runs fp32 on its fp32 inputs; the inputs no int8 op reads then lose their pairs, an int8 producer's
    output as _drop_unread_outputs decides, and the op that fed it may end float in turn."""
    readers = facts.consumers
    while True:
        dropped = []
        for node in model.graph.node:
            if node.name not in plan.int8_nodes or RULES[node.op_type].kind != "compute" \
                    or facts.weighted.get(node.name) or _output_quantized(node, plan, readers):
                continue
            plan.int8_nodes.discard(node.name)
            plan.float_ended.add(node.name)
            d = plan.decision(node.name)
            d.status, d.reason = "fp32", "no weights and its output stays fp32: int8 inputs would only round"
            dropped.append(node)
        if not dropped:
            return
        produced_int8 = {o for n in model.graph.node if n.name in plan.int8_nodes for o in n.output}
        for node in dropped:
            for t in set(node.input):
                if t not in plan.tensors or t in produced_int8 or t in plan.shared or t in plan.shared.values():
                    continue
                if not any(u.name in plan.int8_nodes for u in readers.get(t, [])):
                    _unquantize(model, plan, t, "activation runs fp32: no int8 op reads it")
        _drop_unread_outputs(model, plan, facts.order)


def _drop_idle_passthrough(model: onnx.ModelProto, plan: Plan, facts: ModelFacts) -> None:
    """Data movement that carries int8 to fp32 ops only does no int8 work: the quantizer at its root only
    rounds. Such a chain runs fp32, and its root loses its pair where no int8 layer reads it either:
    - rooted at an fp32 tensor (a graph input, an fp32 op's output): wespeaker's fbank front end, its mel
      MatMul kept fp32 by the guard, still quantized the waveform for the Slice and Reshape that frame it
      (output 14.9 dB, nothing int8);
    - rooted at an int8 MatMul's output, which is then left fp32 (_int8_with_float_output): an attention's
      key and value projections, their bias folded away (fuse/fold_attention_bias), are reshaped and
      transposed into MatMuls of two activations that stay fp32; their pairs (three a projection) only
      rounded and cost ONNX Runtime a node each.
    A chain rooted at another int8 op's output is left as it is (a Conv's output quantizer is what lets ONNX
    Runtime run it int8; _drop_unread_outputs takes it where nothing int8 follows)."""
    readers = facts.consumers
    produced = {o: n for n in model.graph.node if n.name in plan.int8_nodes
                and RULES[n.op_type].kind == "compute" for o in n.output}
    produced_int8 = set(produced) | set(plan.clamp)  # (a fused Relu's)
    # tensors from which int8 data movement alone reaches an int8 layer (a walk through int8 nodes only)
    int8_order = [n for n in facts.order if n.name in plan.int8_nodes]
    compute = {n.name for n in int8_order if RULES[n.op_type].kind == "compute"}
    feeds_compute = G.tensors_reaching(model, compute, int8_order)
    roots = [t for t in plan.tensors if t not in plan.shared and (
        t not in produced_int8 or (t not in plan.clamp and _int8_with_float_output(produced[t])))]
    for t in roots:
        users = [u for u in readers.get(t, []) if u.name in plan.int8_nodes]
        idle = [u for u in users if RULES[u.op_type].kind != "compute" and not any(o in feeds_compute for o in u.output if o)]
        if not idle:
            continue
        todo = list(idle)
        while todo:  # the chains below t that reach no int8 layer: pass-through nodes only
            u = todo.pop()
            if u.name not in plan.int8_nodes:
                continue
            plan.int8_nodes.discard(u.name)
            d = plan.decision(u.name)
            d.status, d.reason = "fp32", "passes int8 on to fp32 ops only: runs fp32"
            for o in u.output:
                plan.shared.pop(o, None)
                if o in plan.tensors:
                    _unquantize(model, plan, o, "activation runs fp32: no int8 op reads it")
                todo += [v for v in readers.get(o, []) if v.name in plan.int8_nodes]
        if len(idle) == len(users):
            _unquantize(model, plan, t, "activation runs fp32: no int8 op reads it")
            if t in produced:
                plan.decision(produced[t].name).reason = ("output left fp32: it only passes through data movement "
                                                          "to fp32 ops")


def _output_quantized(node, plan: Plan, readers: dict) -> bool:
    """Whether the op's output (or that of the Relu/Clip fused into its clamp) carries a Q/DQ pair."""
    out = node.output[0]
    if out in plan.tensors:
        return True
    fused = [u for u in readers.get(out, []) if plan.fused.get(u.name, (None,))[0] == node.name]
    return any(u.output[0] in plan.tensors for u in fused)


def _drop_excluded_only(model: onnx.ModelProto, plan: Plan, cons: dict, exclude: dict) -> None:
    """An int8 op's output that only excluded nodes read keeps no Q/DQ pair: the pair was there for
    the excluded reader, which now runs fp32 and reads the fp32 value instead. Excluding a layer thus
    removes its input quantizer too when no int8 op shares it (the graph input, read only by an
    excluded first conv, is not quantized at all). A fused Relu/Clip whose clamp lived in that
    quantizer runs as an fp32 op again."""
    if not exclude:
        return
    outputs = G.graph_output_names(model)
    for t in list(plan.tensors):
        users = cons.get(t, [])
        if t in outputs or t in plan.shared or t in plan.shared.values() or not users \
                or not all(u.name in exclude for u in users):
            continue
        _unquantize(model, plan, t, "activation runs fp32: only excluded nodes read its output")


def _unquantize(model: onnx.ModelProto, plan: Plan, t: str, why: str) -> None:
    """Take tensor `t` out of the quantized set; a Relu/Clip fused into its clamp runs as an fp32 op again."""
    plan.tensors.remove(t)
    if plan.clamp.pop(t, None) is not None:
        act = next((n for n in model.graph.node if n.output and n.output[0] == t), None)
        if act is not None and act.name in plan.fused:
            plan.fused.pop(act.name)
            d = plan.decision(act.name)
            d.status, d.reason = "fp32", why


def _explain_chains(model: onnx.ModelProto, plan: Plan, chain: dict) -> None:
    """fp32 nodes inside a recognised activation (hard-swish's Add/Clip/Div) say so instead of a generic reason."""
    for d in plan.decisions:
        if d.status == "fp32" and d.name in chain and not d.reason.startswith("excluded"):
            d.reason = f"inside {chain[d.name]}: runs fp32 between its int8 input and int8 output"


def calibration_targets(model: onnx.ModelProto, facts: ModelFacts | None = None) -> tuple[list, dict]:
    """(tensors whose range calibration must record, {tensor: its channel axis} of the tensors whose
    per-channel mean it must record: axis 1 for a convolution's input, the last axis for a Gemm or
    MatMul's (a transformer's [N, T, K] tokens: K channels, T differing from sample to sample)).
    `facts`: ModelFacts.of(model), when the caller has it (it is most of a plan's cost)."""
    facts = facts or ModelFacts.of(model)
    plan = make_plan(model, facts=facts)
    # pass-through outputs too: when the layer before is kept fp32, their consumer needs their own range;
    # and what a layer measured alone quantizes (sensitivity plans without pruning: an idle pass-through
    # chain's root is quantized there)
    ranges = list(dict.fromkeys(plan.tensors + make_plan(model, prune_excluded=False, facts=facts).tensors))
    ops = {n.name: n.op_type for n in model.graph.node}
    means = {}
    for node, x in sorted(plan.weight_inputs.items(), key=lambda kv: kv[1]):
        means.setdefault(x, 1 if ops[node] in ("Conv", "ConvTranspose") else -1)
    return ranges, means


def balanced_tensors(model: onnx.ModelProto, facts: ModelFacts | None = None) -> list:
    """Tensors whose channels quantize/equalize.py may balance, so calibration keeps their per-channel
    min and max: what int8 depthwise convolutions read, and what an int8 Conv/Gemm writes for fp32 ops
    only (hard-swish's input, run in fp32 between int8 tensors). `facts`: as calibration_targets."""
    plan = make_plan(model, facts=facts)
    inits = G.initializers(model)
    cons = G.consumers(model)
    outputs = G.graph_output_names(model)
    out = set()
    for n in model.graph.node:
        if n.name not in plan.int8_nodes or len(n.input) < 2 or n.input[1] not in inits:
            continue
        w = inits[n.input[1]].dims
        if n.op_type == "Conv" and len(w) == 4 and w[1] == 1 and G.attr(n, "group", 1) == w[0] > 1 \
                and n.name in plan.weight_inputs:
            out.add(plan.weight_inputs[n.name])
        if n.op_type in ("Conv", "Gemm") and n.output and n.output[0] not in outputs and n.output[0] in plan.tensors \
                and cons.get(n.output[0]) and all(c.name not in plan.int8_nodes for c in cons[n.output[0]]):
            out.add(n.output[0])
    return sorted(out)
