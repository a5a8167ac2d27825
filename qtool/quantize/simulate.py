"""The int8 experiments inside `quantize`, run as small graphs that re-run only what changes.

Sensitivity asks "the model with only this layer int8", range tuning "this tensor quantized to that
range": dozens to hundreds of variants of one graph. Building, checking and loading each as a full
QDQ model, and running it from the input, costs far more than what the variant changes. Here a
variant is the fp32 graph with only its own quantizers (QuantizeLinear -> DequantizeLinear on its
tensors, DynamicQuantizeLinear -> DequantizeLinear before a layer whose input is quantized at run time)
and its layers' int8 weights (dequantized) put in, run in float by ONNX Runtime (no int8
kernel, and no weight quantized by ORT itself), which is the target's exact int8 result up to fp32 rounding of the
sums (a value within float rounding of a rounding boundary may land one step away). Its session
shares every weight with the others (no copy) and loads in a few milliseconds.

Re-running only what changes: the graph is cut at a few points of its topological order, where few
fp32 tensors cross; the fp32 prefix runs once per batch of samples and keeps those tensors; a
variant starts at the last cut before the first node that reads anything it changes. A layer deep
in the network costs a fraction of a pass.

Whole int8 models (the exclusion search) are not simulated: they run as the QDQ model itself, whose
many requantizations (ORT's QLinearAdd rounding, for one) a float simulation only matches in
distribution, not sample by sample.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
from onnx import TensorProto, helper

from qtool import graph as G
from qtool import qparams as Q
from qtool.ortsession import onnx_type, session
from qtool.plan import ModelFacts, make_plan
from qtool.fuse.upgrade_opset import upgrade as upgrade_opset
from qtool.quantize.qdq import activation_qparams, layer_weights
from qtool.rules import RULES

SESSION_SECONDS = (0.02, 1.5e-4)  # making a session: fixed, and per node of its graph (ORT 1.32, measured)
SESSIONS_BYTES = 1 << 30  # weights held by the sessions alive at once (each holds its own, packed); the fp32
# prefix re-runs once per group of sessions
SWITCH_COST = 0.03  # a switch that is off, per run, in passes: the layout changes ORT puts around it
CACHE_BYTES = 256 << 20  # fp32 tensors crossing the cuts, per batch of samples
OUTPUTS_BYTES = 256 << 20  # outputs of variants run together and held until reduced (Simulator.run)
SMALL = 1024  # initializers up to this size stay in each variant's graph; larger ones are shared OrtValues


@dataclass(frozen=True)
class Run:
    """Variants run together: each from its cut (`cut_of`, one per variant), the fp32 prefix computing
    what crosses `prefix_cuts` (None: the variants' own cuts)."""
    variants: list
    cut_of: list
    prefix_cuts: tuple | None = None


@dataclass
class Variant:
    """One experiment: these layers' weights int8, these tensors quantized (to these parameters)."""
    weights: set = field(default_factory=set)  # node names
    tensors: dict = field(default_factory=dict)  # tensor -> ActQParams
    nodes: set = field(default_factory=set)  # the int8 nodes (fp32 readers of a graph input read it raw)
    dynamic: dict = field(default_factory=dict)  # layer -> the fp32 input it quantizes at run time (plan.dynamic)


class Simulator:
    def __init__(self, ctx, output: str | None = None):
        """`output`: the tensor the variants are judged by (the samples' reference, SampleSet.output;
        None: graph.reference_output)."""
        self.ctx = ctx
        self.base = upgrade_opset(ctx.fused, [])  # what the plans are made on and the variants cut from (read only)
        self.facts = ModelFacts.of(self.base)
        self.types = self.facts.types
        self.shapes = G.inferred_shapes(self.base)
        self.plan = self.plan_for({})
        self.qparams = activation_qparams(self.base, self.plan, ctx.table, ctx.method, ctx.ranges)
        self.output = output or G.reference_output(self.base)
        self.nodes = list(self.base.graph.node)
        self.pos = {n.name: k for k, n in enumerate(self.nodes)}
        # the nodes the reference output depends on: a variant runs only those (another head of a
        # two-output model need not run), and one that changes none of them changes nothing
        need, self.feeds_output = {self.output}, set()
        for n in reversed(self.nodes):
            if any(o in need for o in n.output if o):
                self.feeds_output.add(n.name)
                need |= G.node_reads(n)
        self.first_read = {}  # tensor -> the first of those nodes that reads it
        for k, n in enumerate(self.nodes):
            if n.name in self.feeds_output:
                for i in G.node_reads(n):
                    self.first_read.setdefault(i, k)
        self.shared = {}  # initializer name -> OrtValue, created once, shared by every variant session
        self.small = [t for t in self.base.graph.initializer if int(np.prod(t.dims)) <= SMALL]
        self.big_names = {t.name for t in self.base.graph.initializer if int(np.prod(t.dims)) > SMALL}
        self._weights, self._sqnr = {}, {}
        self._share = None  # each node's share of an fp32 pass, counted at the first run's shapes
        self._sized = {}  # the samples' input shapes -> every tensor's shape at those sizes

    # ------------------------------------------------------------------ what a variant switches on
    def plan_for(self, exclude: dict, prune_excluded: bool = True):
        ctx = self.ctx
        ranges = {**ctx.table.ranges.get(ctx.method, {}), **(ctx.ranges or {})}
        # (with the layers whose input is quantized at run time, as the build plans them: simulated with a
        # static range instead, all-mpnet-base-v2's FFN output MatMuls measured 6-9 dB alone in a model at 21 dB
        # whole, and the guard kept them fp32)
        return make_plan(self.base, {**ctx.exclude, **exclude}, ranges, prune_excluded, facts=self.facts,
                         dynamic=ctx.dynamic)

    def variant(self, exclude: dict, prune_excluded: bool = True) -> Variant:
        """The variant ctx.build(exclude, prune_excluded=...) writes: its plan's quantizers, with the
        parameters the build computes for that plan, and its int8 layers' weights."""
        ctx = self.ctx
        plan = self.plan_for(exclude, prune_excluded)
        tensors = activation_qparams(self.base, plan, ctx.table, ctx.method, ctx.ranges)
        return Variant({n for n in plan.int8_nodes if n in plan.weight_inputs}, tensors, set(plan.int8_nodes),
                       dict(plan.dynamic))

    def output_tensor(self, name: str) -> str:
        """The tensor layer `name` writes: its own output, or that of the Relu/Clip fused into it."""
        out = self.nodes[self.pos[name]].output[0]
        for act, (prod, _, _) in self.plan.fused.items():
            if prod == name:
                out = self.nodes[self.pos[act]].output[0]
        return out

    def weight_sqnr(self, name: str) -> float | None:
        """SQNR of layer `name`'s int8 weights against its fp32 weights (None: no weight)."""
        if name not in self.plan.weight_inputs:
            return None
        self.layer_weights(name)
        return self._sqnr[name]

    def layer_weights(self, name: str) -> list:
        """[(input index, dequantized int8 value)] of int8 layer `name`'s weight and bias."""
        if name not in self._weights:
            ctx, m = self.ctx, self.base
            node = self.nodes[self.pos[name]]
            rule = RULES[node.op_type]
            widx, axis = rule.weight(node, m)
            x = self.plan.weight_inputs[name]
            s_in = self.qparams[x].scale if x in self.qparams else None  # (None: quantized at run time, as the build)
            qw, _, _ = layer_weights(m, node, G.initializers(m), s_in, ctx.table.channel_means.get(x),
                                     (ctx.hessians or {}).get(name), ctx.options(on_error=None))
            self._sqnr[name] = qw.weight_sqnr_db
            out = [(widx, Q.dequantize_weight(qw.q, qw.scale, axis))]
            if qw.bias is not None:
                bq, bs = Q.quantize_bias(qw.bias, self.qparams[x].scale, qw.scale)
                out.append((rule.bias, (bq.astype(np.float64) * bs).astype(np.float32)))
            self._weights[name] = out
        return self._weights[name]

    # ------------------------------------------------------------------ cuts
    def _frontier(self, p: int) -> list:
        """Tensors produced before node p (or graph inputs) and read from node p on."""
        inits = {t.name for t in self.base.graph.initializer}
        before = {o for n in self.nodes[:p] for o in n.output} | {i.name for i in G.real_inputs(self.base)}
        need = []
        for n in self.nodes[p:]:
            if n.name not in self.feeds_output:
                continue
            for i in sorted(G.node_reads(n)) if _has_subgraph(n) else n.input:
                if i and i in before and i not in inits and i not in need:
                    need.append(i)
        return need

    def _costs(self, feed: dict) -> np.ndarray:
        """Each node's share of an fp32 pass, counted (budget.node_work at the feed's shapes; its output
        size times its reduction length where a shape is unknown), and the pass's seconds per sample at
        budget.NOMINAL_MACS_PER_SECOND. Counted, not profiled: where the cuts fall follows the model
        and the samples, never the machine's load (a profile's timings moved them run to run)."""
        from qtool.quantize.budget import NOMINAL_MACS_PER_SECOND, node_work
        n = max(len(next(iter(feed.values()))), 1) if feed else 1
        known = {t.name: list(t.dims) for t in self.base.graph.initializer}
        known.update(G.inferred_shapes(self.base, {k: np.shape(v) for k, v in feed.items()}))
        work = [node_work(node, known) for node in self.nodes]
        modelled = np.array([float(w) if w is not None else _node_cost(node, self.shapes)
                             for w, node in zip(work, self.nodes)], np.float64)
        self._sample_seconds = float(modelled.sum()) / n / NOMINAL_MACS_PER_SECOND
        return modelled / max(modelled.sum(), 1.0)

    def shares(self, samples) -> np.ndarray:
        """Each node's share of an fp32 pass (_costs), counted once, at the first of `samples`."""
        if self._share is None:
            # (stacked: one, batch 1; at most the samples' batch, sized by what a run holds: 4 of waifu2x's CUNet
            # at 292 x 292 took 2 GB more than its experiments)
            n = samples.batch if samples.fixed_batch else min(4, len(samples), samples.batch)
            self._share = self._costs(samples.feed(*samples.spans(n)[0]))
        return self._share

    def plan_cuts(self, firsts: list, share: np.ndarray, pass_seconds: float = 1.0) -> dict:
        """Cut points for variants starting at `firsts`, each cut one session serving the variants
        from it to the next: minimises, in fp32 passes, the suffix each variant runs (share: each
        node's fraction of a pass), making each session (SESSION_SECONDS, against `pass_seconds`, the
        time of one fp32 pass over the samples), and SWITCH_COST per variant per other
        variant's switch in its session (a switch that is off still costs its layout changes), by
        dynamic programming over the distinct first positions. -> first position -> its cut."""
        tail = tails(share)
        q = sorted(set(firsts))
        seen = {}
        for f in firsts:
            seen[f] = seen.get(f, 0) + 1
        upto = np.concatenate([[0], np.cumsum([seen[f] for f in q])])  # variants starting before q[i]
        m = len(q)

        def serve(j, i):  # one session at q[j] for the variants starting in q[j] .. q[i - 1]
            n = upto[i] - upto[j]
            making = (SESSION_SECONDS[0] + SESSION_SECONDS[1] * (len(share) - q[j])) / max(pass_seconds, 1e-9)
            return n * tail[q[j]] + SWITCH_COST * n * (n - 1) + making

        best, back = [0.0] * (m + 1), [0] * (m + 1)  # best[i]: the first i positions served
        for i in range(1, m + 1):
            best[i], back[i] = min((best[j] + serve(j, i), j) for j in range(i))
        cuts, i = [], m
        while i > 0:
            cuts.append(q[back[i]])
            i = back[i]
        cuts.sort()
        return {f: max(c for c in cuts if c <= f) for f in q}

    def first(self, v: Variant) -> int:
        """The first node position that reads anything the variant changes."""
        at = [self.first_read.get(t, len(self.nodes)) for t in v.tensors] \
            + [self.pos[n] for n in v.weights if n in self.feeds_output]  # (a run-time quantized layer is one of them)
        return min(at, default=len(self.nodes))

    # ------------------------------------------------------------------ one variant's graph and session
    def _value(self, name: str, array=None):
        if name not in self.shared:
            import onnxruntime as ort
            arr = G.const_value(self.base, name) if array is None else array
            self.shared[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr))
        return self.shared[name]

    def _weight_switches(self, nodes: list, weights: list, fixed) -> tuple:
        """Each layer of `weights` among `nodes` (copies, changed in place) reads its int8 weights (dequantized),
        behind a Where on its switch unless the session is for one variant (`fixed`).
        -> ({name: weight value}, {node name: the switch nodes placed right before it})."""
        big, before = {}, {}
        for n in nodes:
            if n.name not in weights:
                continue
            for idx, val in self.layer_weights(n.name):
                stem = f"sim:w{idx}:{n.name}"
                fp = n.input[idx] if len(n.input) > idx and n.input[idx] else None
                big[stem] = self._value(stem, val)
                if fixed is None:
                    if fp is None:  # no bias in the fp32 graph: zeros stand for it when the switch is off
                        fp = f"sim:w{idx}zero:{n.name}"
                        big[fp] = self._value(fp, np.zeros_like(val))
                    before.setdefault(n.name, []).append(
                        helper.make_node("Where", [f"sim:w:{n.name}", stem, fp], [f"sim:w{idx}on:{n.name}"]))  # exact either way
                while len(n.input) <= idx:
                    n.input.append("")
                n.input[idx] = stem if fixed is not None else f"sim:w{idx}on:{n.name}"
        return big, before

    @staticmethod
    def _quantizers(nodes: list, tensors: list, fixed) -> tuple:
        """Each tensor of `tensors` through Q -> DQ after the node that writes it: fixed for one variant
        (`fixed`), else inside an If on its switch. -> ({writer: the nodes after it}, constants)."""
        produced = {o: n.name for n in nodes for o in n.output}
        after, consts = {}, []
        for t in tensors:
            sc, z = f"sim:s:{t}", f"sim:z:{t}"
            if fixed is not None:
                qp = fixed.tensors[t]
                consts += [helper.make_tensor(sc, TensorProto.FLOAT, [], [qp.scale]),
                           helper.make_tensor(z, TensorProto.UINT8, [], [qp.zero_point])]
                after.setdefault(produced.get(t), []).extend(
                    [helper.make_node("QuantizeLinear", [t, sc, z], [f"sim:q:{t}"]),
                     helper.make_node("DequantizeLinear", [f"sim:q:{t}", sc, z], [f"sim:y:{t}"])])
                continue
            # If, not arithmetic on a gate: a switch that is off then costs one copy, not five passes
            on = helper.make_graph([helper.make_node("QuantizeLinear", [t, sc, z], [f"sim:q:{t}"]),
                                    helper.make_node("DequantizeLinear", [f"sim:q:{t}", sc, z], [f"sim:dq:{t}"])],
                                   "on", [], [helper.make_tensor_value_info(f"sim:dq:{t}", TensorProto.FLOAT, None)])
            off = helper.make_graph([helper.make_node("Identity", [t], [f"sim:id:{t}"])], "off", [],
                                    [helper.make_tensor_value_info(f"sim:id:{t}", TensorProto.FLOAT, None)])
            after.setdefault(produced.get(t), []).append(
                helper.make_node("If", [f"sim:t:{t}"], [f"sim:y:{t}"], then_branch=on, else_branch=off))
        return after, consts

    @staticmethod
    def _dynamic_quantizers(nodes: list, layers: dict, fixed) -> dict:
        """Each layer of `layers` (name -> its fp32 input) among `nodes` (copies, changed in place) reads that
        input through DynamicQuantizeLinear -> DequantizeLinear, as the build writes it (qdq._write_dynamic):
        fixed for one variant (`fixed`), else inside an If on the layer's switch.
        -> {layer: the nodes placed right before it}."""
        before = {}
        for n in nodes:
            x = layers.get(n.name)
            if x is None:
                continue
            q, s, z, y = (f"sim:{kind}:{n.name}" for kind in ("rq", "rs", "rz", "ry"))
            quant = [helper.make_node("DynamicQuantizeLinear", [x], [q, s, z]),
                     helper.make_node("DequantizeLinear", [q, s, z], [y])]
            if fixed is None:
                on = helper.make_graph(quant, "on", [], [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)])
                off = helper.make_graph([helper.make_node("Identity", [x], [f"sim:rk:{n.name}"])], "off", [],
                                        [helper.make_tensor_value_info(f"sim:rk:{n.name}", TensorProto.FLOAT, None)])
                y = f"sim:ro:{n.name}"
                quant = [helper.make_node("If", [f"sim:r:{n.name}"], [y], then_branch=on, else_branch=off)]
            before[n.name] = quant
            n.input[0] = y
        return before

    def session(self, p: int, variants: list):
        """A session for the graph from cut p on, with a switch on everything `variants` change:
        T -> If(on_T, DQ(Q(T, s_T, z_T)), T) and W -> Where(on_N, W_int8, W), the switches, scales
        and zero points fed per run. A session for one variant has no switch: its quantizers and
        weights are fixed in the graph (an If costs its copies and keeps ORT from fusing across it).
        -> (session, frontier tensors it reads, its switches)."""
        fixed = variants[0] if len(variants) == 1 else None
        frontier = self._frontier(p)
        # (what no node of the output's reads changes nothing: it gets no switch)
        tensors = sorted({t for v in variants for t in v.tensors if t in self.first_read})
        weights = sorted({n for v in variants for n in v.weights if n in self.feeds_output})
        dynamic = {n: x for v in variants for n, x in v.dynamic.items() if n in self.feeds_output}
        graph_inputs = {i.name for i in G.real_inputs(self.base)}
        int8 = set().union(*(v.nodes for v in variants)) if variants else set()
        nodes = [_copy(n) for n in self.nodes[p:] if n.name in self.feeds_output]
        big, before = self._weight_switches(nodes, weights, fixed)
        rename = {t: f"sim:y:{t}" for t in tensors}
        for n in nodes:
            for k, i in enumerate(n.input):
                # as the build does, fp32 readers of a graph input read it before quantization (and a
                # branch reading a tensor by name reads it unquantized)
                if i in rename and (i not in graph_inputs or n.name in int8):
                    n.input[k] = rename[i]
        run_time = self._dynamic_quantizers(nodes, dynamic, fixed)  # (after the renaming: they read the fp32 input)
        after, consts = self._quantizers(nodes, tensors, fixed)
        ordered = list(after.get(None, []))
        for n in nodes:
            ordered.extend(before.get(n.name, []) + run_time.get(n.name, []) + [n] + after.get(n.name, []))
        dynamic = sorted(dynamic)
        if fixed is not None:
            weights, tensors, dynamic = [], [], []
        # (every name made here is sim:KIND:NAME, KIND without a colon: none can equal another, though
        # tf2onnx names nodes after their outputs and a tensor may be called "z")
        switches = [helper.make_tensor_value_info(f"sim:w:{n}", TensorProto.BOOL, []) for n in weights]
        switches += [helper.make_tensor_value_info(f"sim:r:{n}", TensorProto.BOOL, []) for n in dynamic]
        for t in tensors:
            switches += [helper.make_tensor_value_info(f"sim:t:{t}", TensorProto.BOOL, []),
                         helper.make_tensor_value_info(f"sim:s:{t}", TensorProto.FLOAT, []),
                         helper.make_tensor_value_info(f"sim:z:{t}", TensorProto.UINT8, [])]
        m, big = self._model(ordered, "variants",
                             [helper.make_tensor_value_info(t, self.types.get(t, TensorProto.FLOAT),
                                                            _dims(self.shapes.get(t),
                                                                  self.types.get(t, TensorProto.FLOAT) == TensorProto.FLOAT))
                              for t in frontier] + switches,
                             [o for o in self.base.graph.output if o.name == self.output]
                             or [helper.make_empty_tensor_value_info(self.output)],
                             set().union(*(G.node_reads(n) for n in ordered)), big, consts)
        # every optimization (NCHWc convolutions: 2.4x faster than the basic level on Lite0); no int8
        # kernel can take part, as no weight is quantized here, and ORT must not quantize the float
        # weights itself (float_weights: it would, per tensor, around a quantized layer). Dozens of
        # sessions live at once, run one after another: they share one arena. The weights come from
        # OrtValues made once, not through a serialized graph.
        # one thread each: variants run side by side instead (_run_group); a suffix at batch 1 is too
        # small to split well (YOLOX's sensitivity: 138 s wall on 2 threads per session, 113 s on one)
        sess = session(m, 1, arena="shared", external=big, where="a quantize experiment", float_weights=True)
        return sess, frontier, (weights, tensors, dynamic)

    def _switch_feed(self, v: Variant, switches) -> dict:
        weights, tensors, dynamic = switches
        f = {f"sim:w:{n}": np.array(n in v.weights) for n in weights}
        f.update({f"sim:r:{n}": np.array(n in v.dynamic) for n in dynamic})
        for t in tensors:
            qp = v.tensors.get(t) or self.qparams.get(t) or Q.ActQParams(1.0, 0)
            f.update({f"sim:t:{t}": np.array(t in v.tensors),
                      f"sim:s:{t}": np.array(qp.scale, np.float32), f"sim:z:{t}": np.array(qp.zero_point, np.uint8)})
        return f

    # ------------------------------------------------------------------ running variants
    def run(self, samples, variants: list, progress=None, reduce=None) -> list:
        """The reference output of each variant over `samples` (SampleSet), [N, ...], or what
        `reduce(output)` makes of it: with `reduce`, at most OUTPUTS_BYTES of outputs are held at once
        (a recognizer's 18385-class output is 3 MB per image and variant), each reduced when its run ends."""
        reduce = reduce or (lambda y: y)
        self.shares(samples)
        firsts = [self.first(v) for v in variants]
        results = [None] * len(variants)
        live = []
        for k, f in enumerate(firsts):
            if f < len(self.nodes):
                live.append(k)
                continue
            results[k] = reduce(samples.reference.copy())  # it changes nothing (a Concat alone in int8 has no int8 input)
            if progress:
                progress(1.0)
        if live:
            cut_at = self.plan_cuts([firsts[k] for k in live], self._share, self._sample_seconds * len(samples))
            cut_of = {k: cut_at[firsts[k]] for k in live}
            per_run = max(1, OUTPUTS_BYTES // max(samples.reference.nbytes, 1))
            parts = []  # (variants run together: their sessions' weights fit SESSIONS_BYTES, outputs OUTPUTS_BYTES)
            for group in self._groups(sorted(set(cut_of.values()))):
                mine = [k for k in live if cut_of[k] in group]
                parts += [mine[a:a + per_run] for a in range(0, len(mine), per_run)]
            runs = [Run([variants[k] for k in part], [cut_of[k] for k in part]) for part in parts]
            where = self.ctx.experiments  # (None: here; sharded.py: over a Ray cluster)
            got = where.run(self, samples, runs, reduce, progress) if where is not None else \
                [self.run_part(samples, r, reduce, progress) for r in runs]
            for part, ys in zip(parts, got):
                for k, y in zip(part, ys):
                    results[k] = y
        return results

    def run_part(self, samples, r: "Run", reduce, progress=None) -> list:
        """What `reduce` makes of each of the run's variants' outputs over `samples`. The variants
        starting at one cut share a session: a part of a run holding some of its cuts (with every variant
        starting there) computes what the whole run computes for them, from the same prefix."""
        outs = [[] for _ in r.variants]
        self._run_group(samples, r, outs, progress)
        return [reduce(samples.join_like_reference(o)[0]) for o in outs]

    def _groups(self, cuts: list) -> list:
        """The cuts in groups whose sessions' weights (twice: ORT's copy and its packed form) fit
        SESSIONS_BYTES together."""
        size = {t.name: 4 * int(np.prod(t.dims)) for t in self.base.graph.initializer}
        tail = np.cumsum([sum(size.get(i, 0) for i in n.input) for n in self.nodes][::-1])[::-1]
        groups, used = [[]], 0
        for p in cuts:
            need = 2 * int(tail[p]) if p < len(tail) else 0
            if groups[-1] and used + need > SESSIONS_BYTES:
                groups.append([])
                used = 0
            groups[-1].append(p)
            used += need
        return groups

    def _run_group(self, samples, r: "Run", outs, progress):
        variants, cut_of, cuts = r.variants, r.cut_of, sorted(set(r.cut_of))
        cross = []
        for p in r.prefix_cuts or cuts:  # (the whole run's, for a part of it: the same prefix, the same values)
            for t in self._frontier(p):
                if t not in cross and t not in samples.inputs:
                    cross.append(t)
        sessions = {p: self.session(p, [v for v, c in zip(variants, cut_of) if c == p]) for p in cuts}
        feeds = [self._switch_feed(v, sessions[c][2]) for v, c in zip(variants, cut_of)]
        prefix = None
        if cross:
            m, big = self.prefix_model(cross)
            prefix = session(m, self.ctx.threads, arena="shared", external=big, where="a quantize experiment")
        def one(k, cache):
            sess, frontier, _ = sessions[cut_of[k]]
            return sess.run([self.output], {**{t: cache[t] for t in frontier}, **feeds[k]})[0]

        with ThreadPoolExecutor(self.ctx.workers) as pool:  # ORT lets the GIL go while it runs
            for batch, n in self._chunks(samples, cross, single=any(v.dynamic for v in variants)):
                cache = dict(zip(cross, prefix.run(cross, batch))) if prefix is not None else {}
                cache.update(batch)
                for k, y in enumerate(pool.map(lambda k: one(k, cache), range(len(cut_of)))):
                    outs[k].append(y)
                    if progress:
                        progress(n / len(samples))

    def prefix_model(self, cross: list) -> tuple:
        """(the graph computing the fp32 tensors `cross` from the graph inputs with only the nodes
        they need, the shared initializers it names as external). ONNX Runtime runs every node of a
        graph whatever is fetched, and a group of early cuts needs a fraction of the pass."""
        need, keep = set(cross), []
        for n in reversed(self.nodes):
            if any(o in need for o in n.output if o):
                keep.append(n)
                need |= G.node_reads(n)
        keep.reverse()
        return self._model(keep, "prefix", list(G.real_inputs(self.base)),
                           [helper.make_empty_tensor_value_info(t) for t in cross], need)

    def _model(self, nodes: list, name: str, inputs: list, outputs: list, used: set, big: dict | None = None,
               consts: list = ()) -> tuple:
        """(a model of `nodes` with the base graph's initializers among `used`: the small ones in the
        graph, the others, and `big`'s, as external ones filled from shared OrtValues; that mapping)."""
        big = dict(big or {})
        for n in sorted(used):
            if n not in big and n in self.big_names:
                big[n] = self._value(n)
        g = helper.make_graph(nodes, name, inputs, outputs, [t for t in self.small if t.name in used] + list(consts)
                              + [_external(n, val) for n, val in big.items()])
        m = helper.make_model(g, opset_imports=self.base.opset_import)
        m.ir_version = max(self.base.ir_version, 8)  # (initializers need not be graph inputs)
        return m, big

    def shapes_of(self, samples) -> dict:
        """Every tensor's shape for one of `samples` (inferred at its inputs' sizes, once per size): a dynamic
        model's tensors are unknown without them, and with 64 taken for each free dim the chunks of waifu2x's
        CUNet at 292 x 292 held 20-80x the bytes CACHE_BYTES allows (292 x 292 and 584 x 584 planes, not 64 x 64)."""
        if not len(samples):
            return self.shapes
        feed = samples.widest()  # (samples of several sizes: the largest, which bounds the others)
        key = tuple(sorted((k, tuple(np.shape(v))) for k, v in feed.items()))
        if key not in self._sized:
            self._sized[key] = G.inferred_shapes(self.base, {k: np.shape(v) for k, v in feed.items()}) or self.shapes
        return self._sized[key]

    def _chunks(self, samples, cross: list, single: bool = False):
        """Batches of samples small enough that the fp32 tensors crossing the cuts fit CACHE_BYTES; one sample
        each where `single` (a range computed at run time is the whole batch's: each sample is judged by what
        the model gives it alone, as SampleSet.feeds_for runs the int8 model)."""
        shapes = self.shapes_of(samples)
        per_sample = 4 * sum(_numel(shapes.get(t)) for t in cross) or 1
        # (and no larger than the samples' own batch, sized by what a run holds: samples.py's ACT_BYTES)
        size = max(1, min(len(samples), CACHE_BYTES // per_sample, samples.batch))
        if samples.fixed_batch:
            size = samples.batch  # (a model with a fixed batch takes exactly that many; the set holds whole batches)
        if samples.stacked or (single and not samples.fixed_batch):
            size = 1  # (each sample is a whole feed of its own)
        for a, b in samples.spans(size):
            yield samples.feed(a, b), b - a


def _has_subgraph(node) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def _copy(node):
    n = onnx.NodeProto()
    n.CopyFrom(node)
    return n


def _external(name: str, val) -> onnx.TensorProto:
    """An initializer that names its data as external: the session fills it from an OrtValue."""
    t = onnx.TensorProto()
    t.name, t.data_type = name, onnx_type(val.data_type()) or TensorProto.FLOAT
    t.dims.extend(val.shape())
    t.data_location = onnx.TensorProto.EXTERNAL
    e = t.external_data.add()
    e.key, e.value = "location", "qtool-shared-initializer"  # never read: add_external_initializers replaces it
    return t


# ---------------------------------------------------------------------- helpers
def tails(share: np.ndarray) -> np.ndarray:
    """tails[p]: the share of an fp32 pass from node p on (one more entry, 0, past the last node)."""
    return np.concatenate([np.cumsum(share[::-1])[::-1], [0.0]])


def _dims(shape, batched: bool = True):
    """A value-info shape: the known dims, the batch (and any unknown one) left unnamed: a name shared by
    two tensors tells ONNX Runtime their sizes are equal (a text detector's feature maps of several
    sizes, each with a dynamic height, are not). `batched` False (an int64 shape vector crossing a cut):
    axis 0 is no batch and keeps its size; left unknown, ONNX Runtime took a Resize's `sizes` built from
    it for an empty tensor and refused the experiment (SLANet-plus)."""
    if shape is None:
        return None
    return [d if d and (k > 0 or not batched) else None for k, d in enumerate(shape)]


def _numel(shape, batch: int = 1) -> int:
    if not shape:
        return 1 << 16  # unknown: assume a mid-sized tensor
    dims = [batch if k == 0 and d is None else (d or 64) for k, d in enumerate(shape)]
    return int(np.prod(dims))


def _node_cost(n, shapes) -> float:
    """Rough work of a node: its output size, times the reduction length for Conv/Gemm/MatMul."""
    out = _numel(shapes.get(n.output[0])) if n.output else 0
    if n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and len(n.input) > 1:
        w = shapes.get(n.input[1])
        if w:
            k = int(np.prod([d or 1 for d in w])) // max(w[0] or 1, 1)
            return float(out * max(k, 1))
    return float(out)
