"""Fused fp32 graph + calibration table -> INT8 ONNX graph in QDQ form.

Every quantized tensor T becomes T -> QuantizeLinear -> DequantizeLinear -> consumers,
weights become int8 initializers behind a per-axis DequantizeLinear, biases int32
initializers with scale s_in * s_w. ONNX Runtime fuses DQ -> op -> Q into its integer
kernels; qtool's own runtime does the same.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool import graph as G
from qtool import qparams as Q
from qtool.errors import QtoolError
from qtool.fuse import upcast_float16
from qtool.fuse.upgrade_opset import MIN_OPSET, upgrade as upgrade_opset
from qtool.modelio import set_provenance
from qtool.quantize.embedding import embedding_gathers, write_embedding
from qtool.quantize.encoding import DEFAULT_TARGET, PAIR_SAFE, S7, S8, TARGETS, U8, W_MAX_OF, pair_partners
from qtool.plan import Plan, make_plan
from qtool.lattice import Lattice, lattice_qparams
from qtool.rules import RULES
from qtool.quantize.weights import WeightLayer, WeightRounding, pair_safe_scale, quantize_weight



@dataclass
class LayerInfo:
    node: str
    op_type: str
    weight_sqnr_db: float | None = None
    encoding: str | None = None  # encoding.S8 / PAIR_SAFE / U8
    input_range: list | None = None
    output_range: list | None = None


@dataclass
class QuantizeOutput:
    model: onnx.ModelProto
    plan: Plan
    qparams: dict  # tensor -> ActQParams
    layers: dict = field(default_factory=dict)  # node name -> LayerInfo
    notes: list = field(default_factory=list)
    input_shifts: dict = field(default_factory=dict)  # model input -> the constant added before its quantizer
    embeddings: dict = field(default_factory=dict)  # Gather node -> EmbeddingInfo (embedding.py)


def _tensor_qparams(plan: Plan, table, method, tensor, producers=None):
    r = table.range(tensor, method)
    src = tensor
    while r is None and producers is not None and src in producers:
        # a pass-through op (Reshape, Transpose, ...) carries its input's values unchanged
        node = producers[src]
        rule = RULES.get(node.op_type)
        if rule is None or rule.kind != "passthrough":
            break
        src = node.input[0]
        r = table.range(src, method)
    if r is None:
        raise QtoolError(f"calibration table has no range for tensor '{tensor}'; it was made for another graph "
                         f"(run `qtool calibrate` again)")
    lo, hi = r
    if tensor in plan.clamp:
        c_lo, c_hi = plan.clamp[tensor]
        lo, hi = max(lo, c_lo), min(hi, c_hi)
    return Q.activation_qparams(lo, hi)


def activation_qparams(model: onnx.ModelProto, plan: Plan, table, method: str | None, ranges: dict | None) -> dict:
    """tensor -> ActQParams for every tensor the plan quantizes: the method's range (or `ranges`'
    override), narrowed by a fused Relu/Clip; a pass-through output shares its source's."""
    qp = {}
    prods = G.producers(model)
    for t in plan.tensors:
        src = t
        while src in plan.shared:
            src = plan.shared[src]
        if src in qp:
            qp[t] = qp[src]
        elif ranges is not None and src in ranges:
            qp[t] = qp[src] = Q.activation_qparams(*ranges[src])
        else:
            qp[t] = qp[src] = _tensor_qparams(plan, table, method, src, prods)
    return qp


def lattice_inputs(model: onnx.ModelProto, plan: Plan, table, qp: dict, method: str | None, ranges: dict | None,
                   notes: list, shift: bool = True) -> dict:
    """Model inputs whose calibration values sit on an 8-bit lattice (lattice.py) get the qparams that
    make every point exact (qp, in place). -> {input: shift} of those that need a shift before their
    quantizer: only where every int8 reader is a layer with a weight and a bias (it takes the shift
    back out) and no pass-through shares the input's qparams (its copy would not be shifted)."""
    shifts = {}
    lattices = getattr(table, "lattices", None) or {}
    graph_inputs = {i.name for i in G.real_inputs(model)}
    cons = G.consumers(model)
    for t, d in lattices.items():
        lat = Lattice.from_dict(d)
        if lat is None or t not in graph_inputs or t not in qp or (ranges is not None and t in ranges):
            continue
        r = table.range(t, method)
        got = lattice_qparams(lat, *(r if r is not None else (lat.lo, lat.hi)))
        if got is None:
            continue
        scale, zp, by = got
        if by and not shift:
            continue
        if by:
            readers = [c for c in cons.get(t, []) if c.name in plan.int8_nodes]
            # (not a ConvTranspose: each of its output pixels reads another subset of its taps, so no one
            # bias per channel takes the shift back out)
            ok = readers and not any(src == t for src in plan.shared.values()) and all(
                c.op_type != "ConvTranspose" and plan.weight_inputs.get(c.name) == t
                and RULES[c.op_type].bias is not None and RULES[c.op_type].weight(c, model) is not None
                and list(c.input).count(t) == 1 for c in readers)
            if not ok:
                continue
            shifts[t] = by
        qp[t] = Q.ActQParams(scale, zp)
        notes.append(f"input '{t}' takes {lat.steps + 1} evenly spaced values (step {lat.spacing:.6g}): quantized "
                     f"exactly with scale {scale:.6g}, zero point {zp}" + (f", after adding {by:.6g}" if by else ""))
    return shifts


@dataclass(frozen=True)
class BuildOptions:
    """How quantize_graph builds the QDQ graph.
    `ranges` (tensor -> (lo, hi)) overrides the table's, for experiments and sensitivity search.
    `weights=False` / `activations=False` leave that side fp32: the diagnostic that tells
    which of the two a model's quantization error comes from.
    `weight_cache` (node -> QuantizedWeight) is filled and reused across calls: a layer's
    weights do not depend on which other layers are excluded.
    `hessians` (node -> input covariance, rounding.layer_hessians): round those layers' weights
    to lower their output error (rounding.py) instead of to the nearest step.
    `target` (encoding.TARGETS): how the weights are encoded for the CPUs that will run the model.
    `u8_storage`: store every paired layer's weights as uint8 + 128 whatever the target, the same
    values in a form ONNX Runtime computes exactly on any CPU (for scoring experiments).
    `on_error(layer, exception)`: a layer's output-aware rounding failed (layer_weights).
    `encodings`: node -> encoding where it is not the target's.
    `input_grid`: a model input on an 8-bit lattice half a step off every grid is shifted onto one
    (lattice_inputs); off, such an input keeps its calibrated range (lattices on a grid are used either way).
    `dynamic`: MatMul layers whose input is quantized at run time (DynamicQuantizeLinear; dynamic.py chooses).
    `embeddings`: embedding tables int8 per row (embedding.py)."""
    method: str | None = None
    exclude: dict | None = None
    bias_correction: bool = True
    ranges: dict | None = None
    weights: bool = True
    activations: bool = True
    weight_cache: dict | None = None
    prune_excluded: bool = True
    hessians: dict | None = None
    target: str = DEFAULT_TARGET
    u8_storage: bool = False
    on_error: object = None
    encodings: dict | None = None
    input_grid: bool = True
    dynamic: frozenset = frozenset()
    embeddings: bool = True


def layer_weights(model, node, inits, s_in, mean_x, hessian, o: BuildOptions):
    """(QuantizedWeight, encoding, whether ORT pairs this layer's weights) of an int8 layer with a
    weight, as the target (o.target) encodes it; cached per layer and setting in o.weight_cache.
    o.on_error(layer, exception): output-aware rounding of this layer failed; it is told, and the
    layer is rounded to nearest (without it, the exception propagates). o.encodings: node -> encoding
    where it is not the target's (encoding.cheap_u8_layers)."""
    rule, cache = RULES[node.op_type], o.weight_cache
    widx, axis = rule.weight(node, model)
    partners = pair_partners(tuple(inits[node.input[widx]].dims), node.op_type, axis, G.attr(node, "group", 1))
    enc = S8 if partners is None else (o.encodings or {}).get(node.name, TARGETS[o.target].encoding)
    key = (node.name, o.bias_correction, hessian is not None, s_in if rule.bias is not None else None,
           enc if enc in (PAIR_SAFE, S7) else S8)
    qw = cache.get(key) if cache is not None else None
    if qw is None:  # (the weights are read only now: a build with every layer cached reads none)
        w = numpy_helper.to_array(inits[node.input[widx]]).astype(np.float32)
        has_bias = rule.bias is not None and len(node.input) > rule.bias and node.input[rule.bias]
        b = numpy_helper.to_array(inits[node.input[rule.bias]]).astype(np.float32).ravel() if has_bias else None
        taps = 1.0 / float(np.prod(G.attr(node, "strides", [1]))) if node.op_type == "ConvTranspose" else 1.0
        layer = WeightLayer(w, axis, b, mean_x, node.op_type, G.attr(node, "group", 1), taps)

        def weights(h):
            scale = None
            if enc == PAIR_SAFE and cache is not None:
                # the scale search is the costly part, and depends on the weight alone (and the layer's
                # covariance): once per weight, for every range method and every node sharing it
                # (an LSTM unrolled over 40 steps: one weight, 40 Gemm nodes)
                skey = ("pair-safe scale", node.input[widx], axis, node.name if h is not None else None)
                if skey not in cache:
                    cache[skey] = pair_safe_scale(w, axis, partners, h)
                scale = cache[skey]
            return quantize_weight(layer, WeightRounding(
                correct_bias=o.bias_correction and rule.bias is not None, s_in=s_in if rule.bias is not None else None,
                hessian=h, partners=partners if enc == PAIR_SAFE else None, w_max=W_MAX_OF.get(enc, Q.W_MAX),
                scale=scale))
        try:
            qw = weights(hessian)
        except Exception as e:
            if hessian is None or o.on_error is None:
                raise
            o.on_error(node.name, e)
            qw = weights(None)
        if cache is not None:
            cache[key] = qw
    return qw, enc, partners is not None


class _Writer:
    """The graph being written: names not yet taken, and one initializer per distinct array (the int8
    weight of an LSTM cell unrolled over 40 steps: 40 nodes, one weight)."""

    def __init__(self, m: onnx.ModelProto):
        self.m = m
        self.inits = G.initializers(m)
        self.taken = {o for n in m.graph.node for o in n.output} | set(self.inits) | {i.name for i in m.graph.input}
        self.new_inits = []
        self.same = {}  # (dtype, shape, bytes) -> initializer

    def add_init(self, base, arr) -> str:
        arr = np.asarray(arr)
        key = (arr.dtype.str, arr.shape, hashlib.sha256(np.ascontiguousarray(arr).tobytes()).digest())
        if key not in self.same:
            self.same[key] = G.unique_name(self.m, base, self.taken)
            self.new_inits.append(numpy_helper.from_array(arr, self.same[key]))
        return self.same[key]

    def name(self, base: str) -> str:
        return G.unique_name(self.m, base, self.taken)

    def dequantize(self, ins: list, base: str, axis: int) -> str:
        """A DequantizeLinear of `ins` (quantized, scale, zero point) appended; -> its output."""
        out = self.name(base)
        self.m.graph.node.append(helper.make_node("DequantizeLinear", ins, [out], name=out, axis=axis))
        return out


def _write_layer(g: _Writer, node, x_name: str, qp: dict, table, shifts: dict, o: BuildOptions) -> LayerInfo:
    """An int8 layer's weight (and bias) quantized and read through DequantizeLinear nodes."""
    m, rule = g.m, RULES[node.op_type]
    widx, axis = rule.weight(node, m)
    has_bias = rule.bias is not None and len(node.input) > rule.bias and node.input[rule.bias]
    s_in = qp[x_name].scale if x_name in qp else None  # (None: quantized at run time; such a layer has no bias)
    qw, enc, paired = layer_weights(m, node, g.inits, s_in, table.channel_means.get(x_name),
                                    (o.hessians or {}).get(node.name), o)
    base = node.input[widx]
    if enc == U8 or (o.u8_storage and paired):
        wq = g.add_init(base + "_quantized", (qw.q.astype(np.int16) + 128).astype(np.uint8))
        wz = g.add_init(base + "_zero_point", np.full(qw.scale.shape, 128, np.uint8))
    else:
        wq = g.add_init(base + "_quantized", qw.q)
        wz = g.add_init(base + "_zero_point", np.zeros(qw.scale.shape, np.int8))
    ws = g.add_init(base + "_scale", qw.scale)
    node.input[widx] = g.dequantize([wq, ws, wz], base + "_dequantized", axis)
    bias = qw.bias
    if x_name in shifts:  # the input arrives shifted (lattice_inputs): the bias takes the shift back out
        w_dq = Q.dequantize_weight(qw.q, qw.scale, qw.axis).astype(np.float64)
        moved = shifts[x_name] * w_dq.sum(axis=tuple(a for a in range(qw.q.ndim) if a != qw.axis))
        bias = (np.zeros(moved.shape) if bias is None else np.asarray(bias, np.float64)) - moved
    if bias is not None:
        bq, bscale = Q.quantize_bias(bias, qp[x_name].scale, qw.scale)
        bbase = node.input[rule.bias] if has_bias else node.name + "_bias"
        ins = [g.add_init(bbase + "_quantized", bq), g.add_init(bbase + "_scale", bscale),
               g.add_init(bbase + "_zero_point", np.zeros(bscale.shape, np.int32))]
        bd = g.dequantize(ins, bbase + "_dequantized", 0)
        while len(node.input) <= rule.bias:
            node.input.append("")
        node.input[rule.bias] = bd
    return LayerInfo(node.name, node.op_type, qw.weight_sqnr_db, encoding=enc)


def _write_activations(g: _Writer, plan: Plan, qp: dict, shifts: dict) -> dict:
    """Every tensor the plan quantizes through QuantizeLinear -> DequantizeLinear, its int8 readers
    reading the latter. -> {dequantized tensor: (quantized tensor, qparams, tensor)}."""
    m = g.m
    graph_inputs = {i.name for i in G.real_inputs(m)}
    cons = G.consumers(m)
    dq_of = {}
    for t in plan.tensors:
        p = qp[t]
        sn = g.add_init(t + "_scale", np.array(p.scale, np.float32))
        zn = g.add_init(t + "_zero_point", np.array(p.zero_point, np.uint8))
        tq = g.name(t + "_quantized")
        td = g.name(t + "_dequantized")
        src = t
        if t in shifts:
            src = g.name(t + "_on_grid")
            m.graph.node.append(helper.make_node("Add", [t, g.add_init(t + "_grid_shift", np.array(shifts[t], np.float32))],
                                                 [src], name=src))
        m.graph.node.append(helper.make_node("QuantizeLinear", [src, sn, zn], [tq], name=tq))
        m.graph.node.append(helper.make_node("DequantizeLinear", [tq, sn, zn], [td], name=td))
        dq_of[td] = (tq, p, t)
        for c in cons.get(t, []):
            if t in graph_inputs and c.name not in plan.int8_nodes:
                continue  # an fp32 consumer of a model input reads the original
            # (a branch reading it by name reads the fp32 tensor: ONNX Runtime's QDQ fusions abort on a
            # DequantizeLinear an If reads implicitly; the plan fuses no Relu whose output a branch reads)
            for k, i in enumerate(c.input):
                if i == t:
                    c.input[k] = td
    return dq_of


def _planned(fused: onnx.ModelProto, table, o: BuildOptions, notes: list) -> tuple:
    """(a copy of `fused` at the opset QDQ needs, with the plan's activations fused into their
    producers, the plan)."""
    m = onnx.ModelProto()
    m.CopyFrom(fused)
    m = upgrade_opset(m, notes)
    upcast_float16.noted(m, notes)
    plan = make_plan(m, o.exclude, {**table.ranges.get(o.method or table.range_method, {}), **(o.ranges or {})},
                     o.prune_excluded, dynamic=o.dynamic)
    nodes = {n.name: n for n in m.graph.node}
    # fused activations: the producer writes the activation's output, the activation goes
    for act_name, (prod_name, _lo, _hi) in (plan.fused.items() if o.activations else ()):
        act = nodes[act_name]
        nodes[prod_name].output[0] = act.output[0]
        m.graph.node.remove(act)
    return m, plan


def quantize_graph(fused: onnx.ModelProto, table, options: BuildOptions | None = None) -> QuantizeOutput:
    """The QDQ graph of `fused` at `table`'s ranges, built as `options` (BuildOptions) say."""
    o = options or BuildOptions()
    notes: list = []
    m, plan = _planned(fused, table, o, notes)
    qp = activation_qparams(m, plan, table, o.method, o.ranges)
    shifts = lattice_inputs(m, plan, table, qp, o.method, o.ranges, notes, o.input_grid)
    g = _Writer(m)
    layers = {}
    for node in list(m.graph.node):  # weights and biases
        if node.name in plan.int8_nodes and o.weights and RULES[node.op_type].weight(node, m) is not None:
            layers[node.name] = _write_layer(g, node, plan.weight_inputs[node.name], qp, table, shifts, o)
    embeddings = {n.name: write_embedding(g, n) for n in embedding_gathers(m, o.exclude)} if o.embeddings else {}
    dq_of = _write_activations(g, plan, qp, shifts) if o.activations else {}
    if o.activations:
        _write_dynamic(g, plan)
    _shield_fp32_layers(m, g.inits, dq_of, g.add_init, g.taken)
    m.graph.initializer.extend(g.new_inits)
    G.remove_unused_initializers(m)
    set_provenance(m, target=o.target)  # (read back by modelio.provenance: qtool.target)
    G.toposort(m)
    for d in plan.decisions:
        if d.status == "fp32" and d.op_type in RULES:
            notes.append(f"{d.name} ({d.op_type}) stays fp32: {d.reason}")
    try:
        onnx.checker.check_model(m)
    except Exception as e:
        raise QtoolError(f"internal error: the quantized graph fails onnx.checker ({e})") from None
    return QuantizeOutput(m, plan, qp, layers, notes, shifts, embeddings)


def _write_dynamic(g: _Writer, plan: Plan) -> None:
    """Each layer of plan.dynamic reads its fp32 input through one DynamicQuantizeLinear (uint8, per
    tensor, scale and zero point computed at run time from the tensor's min and max, widened to 0), one
    per tensor however many layers read it, and multiplies it in integers with its int8 weight:

        DynamicQuantizeLinear(x) -> (q, s, z)
        MatMulInteger(q, w_q, z, w_z) -> Cast(float) -> Mul(., s * w_scale) -> [the layer's bias Add]

    the form `quantize_dynamic` writes, not DequantizeLinear -> MatMul: ONNX Runtime makes both the one
    int8 MatMul (DynamicQuantizeMatMul, or MatMulIntegerToFloat where several layers read q), the same
    u8 x s8 products (so the weights follow the target's encoding, as a static layer's), but only from
    this form does it take the bias Add in (the zoo MiniLM: 12 Adds fewer, its GELU no BiasGelu; at 32 and
    128 tokens on 1 and 2 threads 0.91-0.96 of ORT dynamic's time, where the QDQ form took 0.96-1.03), and a 2-D input's
    QDQ form with a bias it runs as a float Gemm on weights dequantized each run. A layer whose weight stays fp32
    (weights=False) reads DynamicQuantizeLinear -> DequantizeLinear instead."""
    made, dequantized, bypassed = {}, {}, []
    prods = G.producers(g.m)
    written = {t.name: t for t in g.new_inits if t.data_type in (TensorProto.INT8, TensorProto.UINT8)}
    for node in list(g.m.graph.node):
        x = plan.dynamic.get(node.name)
        if x is None:
            continue
        if x not in made:
            q, s, z = (g.name(x + suffix) for suffix in ("_dynamic_quantized", "_dynamic_scale", "_dynamic_zero_point"))
            g.m.graph.node.append(helper.make_node("DynamicQuantizeLinear", [x], [q, s, z], name=q))
            made[x] = (q, s, z)
        q, s, z = made[x]
        wdq = prods.get(node.input[1])
        w = written.get(wdq.input[0]) if wdq is not None and wdq.op_type == "DequantizeLinear" else None
        if w is None or len(w.dims) != 2 or len(wdq.input) < 3 or G.attr(wdq, "axis", 1) != 1:
            if x not in dequantized:
                dequantized[x] = g.name(x + "_dynamic_dequantized")
                g.m.graph.node.append(helper.make_node("DequantizeLinear", [q, s, z], [dequantized[x]],
                                                       name=dequantized[x]))
            node.input[0] = dequantized[x]
            continue
        wq, ws, wz = wdq.input[:3]
        bypassed.append(wdq)
        acc, accf, mult = (g.name(node.name + suffix) for suffix in ("_int32", "_float", "_multiplier"))
        g.m.graph.node.remove(node)
        g.m.graph.node.extend([
            helper.make_node("MatMulInteger", [q, wq, z, wz], [acc], name=node.name),
            helper.make_node("Cast", [acc], [accf], name=accf, to=TensorProto.FLOAT),
            helper.make_node("Mul", [s, ws], [mult], name=mult),
            helper.make_node("Mul", [accf, mult], [node.output[0]], name=g.name(node.name + "_scaled"))])
    read, outputs = G.consumers(g.m), G.graph_output_names(g.m)
    for n in bypassed:  # the weights' DequantizeLinear no layer reads now
        if not read.get(n.output[0]) and n.output[0] not in outputs:
            g.m.graph.node.remove(n)


def _shield_fp32_layers(m, inits, dq_of, add_init, taken) -> None:
    """A Conv/ConvTranspose/Gemm kept fp32 that reads a per-tensor DequantizeLinear and writes
    into a QuantizeLinear is, to ONNX Runtime (1.20+, its WeightBiasQuantization pass), a layer
    whose weights someone forgot to quantize: it quantizes them itself, per tensor, and runs the
    layer in int8. Kept fp32 must mean fp32, so such a layer reads its input through its own
    DequantizeLinear with the same scale repeated per channel: the same values, a form that pass
    leaves alone (a one-channel input, whose scale ORT would still take for a scalar, is read
    before quantization instead). That happens when a layer is excluded but its input also feeds
    an int8 op, and to every layer under weights=False."""
    cons = G.consumers(m)

    def writes_into_quantize(node):  # ORT's condition: one reader, through Relu/Clip at most, then Q
        while len(node.output) == 1 and len(cons.get(node.output[0], [])) == 1:
            node = cons[node.output[0]][0]
            if node.op_type == "QuantizeLinear":
                return True
            if node.op_type not in ("Relu", "Clip"):
                return False
        return False

    for node in list(m.graph.node):  # (an int8 layer's weight is a DQ output by now, unless weights=False)
        if node.op_type not in ("Conv", "ConvTranspose", "Gemm"):
            continue
        if len(node.input) < 2 or node.input[0] not in dq_of or node.input[1] not in inits:
            continue
        if not writes_into_quantize(node):
            continue
        w = inits[node.input[1]]
        if w.data_type != TensorProto.FLOAT or len(w.dims) < 2:
            continue
        axis = 1
        if node.op_type == "Conv":
            channels = w.dims[1] * G.attr(node, "group", 1)
        elif node.op_type == "ConvTranspose":
            channels = w.dims[0]
        else:
            channels = w.dims[1] if G.attr(node, "transB", 0) else w.dims[0]
            axis = 0 if G.attr(node, "transA", 0) else 1
        tq, p, src = dq_of[node.input[0]]
        if channels < 2:
            # ORT takes a scale of shape [1] for a scalar too: read the value before quantization
            node.input[0] = src
            continue
        sn = add_init(tq + "_scale_per_channel", np.full(channels, p.scale, np.float32))
        zn = add_init(tq + "_zero_point_per_channel", np.full(channels, p.zero_point, np.uint8))
        td = G.unique_name(m, node.name + "_input_dequantized", taken)
        m.graph.node.append(helper.make_node("DequantizeLinear", [tq, sn, zn], [td], name=td, axis=axis))
        node.input[0] = td
