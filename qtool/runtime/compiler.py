"""QDQ ONNX graph -> a list of steps on int8 kernels, with fp32 numpy fallbacks.

Before (what ORT's quantize_static and qtool write):
    Q(x) -> DQ -> Conv(DQ(w_int8), DQ(b_int32)) -> [Relu|Clip] -> Q(y) -> DQ -> ...
After:
    QuantizeStep(x) -> ConvStep(u8 NHWC -> u8 NHWC, requantized to y's scale, Relu/Clip as the clamp) -> ...

Rules, in the order tried for each node:
  * all inputs constant -> folded at load with the fp32 op (DQ of a weight also remembers the
    int8 tensor and its scales, which the int8 rules pack once);
  * DequantizeLinear of a uint8 activation -> no step, a "dq view" of the int8 tensor;
  * QuantizeLinear of a dq view -> an alias (same scale/zero point) or a requantize step;
    of a float tensor -> a quantize step (NCHW float -> NHWC uint8);
  * an op in INT_RULES (qtool/runtime/lower/, one module per op family) whose data inputs are
    dq views and whose output goes only to one QuantizeLinear (optionally through Relu/Clip)
    -> one int8 step producing that Q's output;
  * an elementwise op left over -> lower.lut.rule_region: the chain of elementwise ops it starts,
    a function of one uint8 tensor, as one 256-entry table;
  * anything else -> the fp32 numpy op, with its dq-view inputs dequantized first; a later Q
    quantizes the result. The reason is recorded for `report()`.
A rule whose precondition fails returns the reason and leaves the node to the next rule.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from qtool.arithmetic import EXACT, ORT_X86_NOVNNI, check_arithmetic
from qtool.errors import QtoolError
from qtool.limits import MAX_FOLD_ELEMS, fold_elems
from qtool.runtime import saturating
from qtool.runtime import steps as S
from qtool.runtime.fp32_ops import FP32_OPS
from qtool.runtime.lower import ELEMENTWISE, INT_RULES, rule_region
from qtool.runtime.lower.fp32_fused import rule_fp32
from qtool.runtime.program import Entry, Program, QConst, QView, Val, node_attrs


def _static_value_ranks(model):
    """(tensor name -> rank, tensor name -> ONNX element type, tensor name -> its last dimension) where
    shape inference knows them."""
    ranks, types, last = {}, {}, {}
    inferred = model
    for data_prop in (True, False):  # (with the shape values propagated: a Reshape to a computed shape's dims)
        try:
            inferred = onnx.shape_inference.infer_shapes(model, data_prop=data_prop)
            break
        except Exception:
            continue
    g = inferred.graph
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            ranks[vi.name] = len(t.shape.dim)
            if t.shape.dim and t.shape.dim[-1].HasField("dim_value") and t.shape.dim[-1].dim_value > 0:
                last[vi.name] = t.shape.dim[-1].dim_value
        if t.elem_type:
            types[vi.name] = t.elem_type
    return ranks, types, last


class Compiler:
    def __init__(self, model: onnx.ModelProto, K, where: str = "model", arithmetic: str = EXACT):
        self.m, self.K, self.where = model, K, where
        self.arithmetic = check_arithmetic(arithmetic)
        g = model.graph
        self.g = g
        self.consts = {i.name: numpy_helper.to_array(i) for i in g.initializer}
        self.qconst: dict[str, QConst] = {}
        self.views: dict[str, QView] = {}
        self.vals: dict[str, Val] = {}
        self.float_of: dict[tuple, str] = {}
        self.steps: list = []
        self.entries: list = []
        self.n_slots = 0
        self.const_slots: dict[str, int] = {}
        self.done: set = set()
        self.graph_outputs = {o.name for o in g.output}
        self.consumers: dict[str, list] = {}
        self.producers = {o: n for n in g.node for o in n.output if o}
        self.shifted: dict[str, tuple] = {}  # Add output -> (its float input, the constant), see _grid_shift
        for n in g.node:
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)
        self.ranks, self.elem_types, self.last_dims = _static_value_ranks(model)
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
        self.pads: dict = {}  # uint8 output of an int8 Pad -> (input name, (t, l, b, r), fill, step)
        self.dynamic: dict = {}  # uint8 output of a DynamicQuantizeLinear -> (its scale, its zero point)
        self.dynamic_views: dict = {}  # DequantizeLinear of one, read only by int8 MatMuls -> the uint8 name
        self.integer_chains: dict = {}  # id(MatMulInteger) on one -> what lower/dynamic.py found after it
        self.luts: dict = {}  # uint8 output of a per-tensor LutStep -> (input name, table, step)

    # ------------------------------------------------------------ helpers
    def new_slot(self):
        self.n_slots += 1
        return self.n_slots - 1

    def add_val(self, name, kind, **kw):
        v = Val(self.new_slot(), kind, **kw)
        self.vals[name] = v
        return v

    def const_slot(self, name):
        if name not in self.const_slots:
            self.const_slots[name] = self.new_slot()
        return self.const_slots[name]

    def is_const(self, name):
        return name == "" or name in self.consts

    def scalar_q(self, node):
        """(scale, zp) of a per-tensor uint8 Q/DQ node, or None."""
        if len(node.input) < 2 or not all(self.is_const(i) for i in node.input[1:]):
            return None
        s = self.consts[node.input[1]]
        z = self.consts[node.input[2]] if len(node.input) > 2 and node.input[2] else np.zeros((), np.uint8)
        if s.size != 1 or z.size != 1 or z.dtype != np.uint8:
            return None
        return np.float32(s.reshape(())), int(z.reshape(()))

    def float_input(self, name):
        """Slot holding `name` as a float (ONNX layout) tensor, dequantizing a dq view once."""
        if name == "":
            return None
        if name in self.consts:
            return self.const_slot(name)
        if name in self.views:
            v = self.views[name]
            key = (v.src, float(v.scale), v.zp)
            if key not in self.float_of:
                src = self.vals[v.src]
                fv = self.add_val(name, "f", rank=src.rank)
                self.steps.append(S.DequantizeStep(f"dequantize {v.src}", src.slot, fv.slot, v.scale, v.zp, src.nhwc, self.K))
                self.float_of[key] = name
            return self.vals[self.float_of[key]].slot
        v = self.vals.get(name)
        if v is None:
            raise QtoolError(f"{self.where}: tensor '{name}' is used before it is produced (graph not topologically sorted?)")
        if v.kind == "q":  # raw uint8 used by a non-int op: hand it over in ONNX layout
            if v.nhwc:
                fv = self.add_val(name + "#nchw", "f", rank=v.rank)
                self.steps.append(S.ShapeOpStep(f"to NCHW {name}", "Identity", v.slot, fv.slot, [], {}, True, None))
                return fv.slot
        return v.slot

    def nhwc_input(self, qname):
        """Slot of uint8 tensor `qname` in NHWC (converting a rank-4 plain tensor once)."""
        v = self.vals[qname]
        if v.nhwc:
            return v.slot
        key = qname + "#nhwc"
        if key not in self.vals:
            nv = self.add_val(key, "q", nhwc=True, q=v.q, rank=4)
            self.steps.append(S.ToNHWCStep(f"to NHWC {qname}", v.slot, nv.slot))
        return self.vals[key].slot

    def _grid_shift(self, node) -> bool:
        """An Add of a float value and a scalar constant read by one per-tensor uint8 QuantizeLinear
        (quantize/qdq.py lattice_inputs: a model input moved onto its quantizer's grid): recorded in
        self.shifted, for that QuantizeLinear's step to add first, in float32 as ONNX Runtime does."""
        ins = list(node.input)
        if len(ins) != 2:
            return False
        x, c = (ins[0], ins[1]) if self.is_const(ins[1]) else (ins[1], ins[0])
        if not self.is_const(c) or x not in self.vals or self.vals[x].kind != "f":
            return False
        k = np.asarray(self.consts[c])
        cons = self.consumers.get(node.output[0], [])
        if k.size != 1 or k.dtype != np.float32 or node.output[0] in self.graph_outputs or len(cons) != 1 \
                or cons[0].op_type != "QuantizeLinear" or self.scalar_q(cons[0]) is None:
            return False
        self.shifted[node.output[0]] = (x, float(k.reshape(())))
        return True

    def out_quant(self, name):
        """If float `name` goes only to a QuantizeLinear (optionally through Relu/Clip):
        (q_node, (scale, zp), lo, hi, [fused nodes]); else a reason string."""
        cons = self.consumers.get(name, [])
        if name in self.graph_outputs:
            return "its output is a graph output"
        if len(cons) != 1:
            return f"its output has {len(cons)} consumers, not one QuantizeLinear"
        n, fused, act = cons[0], [], None
        if n.op_type in ("Relu", "Clip"):
            o = n.output[0]
            c2 = self.consumers.get(o, [])
            if o in self.graph_outputs or len(c2) != 1:
                return f"{n.op_type} after it is not followed by exactly one QuantizeLinear"
            if n.op_type == "Clip" and not all(self.is_const(i) for i in n.input[1:]):
                return "Clip bounds are not constant"
            act, n = n, c2[0]
            fused.append(act)
        if n.op_type != "QuantizeLinear":
            return f"its output goes to {n.op_type}, not QuantizeLinear"
        q = self.scalar_q(n)
        if q is None:
            return "the QuantizeLinear after it is not per-tensor uint8"
        lo, hi = 0, 255
        s, z = q
        def qv(v):
            return int(np.clip(np.rint(np.float32(v) / s) + z, 0, 255))
        if act is not None:
            if act.op_type == "Relu":
                lo = z
            else:
                at = node_attrs(act)
                mn = self.consts[act.input[1]] if len(act.input) > 1 and act.input[1] else at.get("min")
                mx = self.consts[act.input[2]] if len(act.input) > 2 and act.input[2] else at.get("max")
                if mn is not None:
                    lo = qv(np.asarray(mn).reshape(()))
                if mx is not None:
                    hi = qv(np.asarray(mx).reshape(()))
        return n, q, lo, hi, fused + [n]

    def weight(self, name, want_axis):
        """Symmetric per-channel/per-tensor weight behind DQ `name` -> (int8 q, scales) or reason:
        int8 with zero point 0, or uint8 with zero point 128 (the same values, shifted)."""
        w = self.qconst.get(name)
        if w is None:
            return "its weight is not a DequantizeLinear of an int8 initializer"
        if w.q.dtype == np.uint8:
            if np.any(w.zp != 128):
                return "its uint8 weight zero point is not 128"
            q = (w.q.astype(np.int16) - 128).astype(np.int8)
        elif w.q.dtype == np.int8:
            if np.any(w.zp != 0):
                return "its weight zero point is not 0"
            q = w.q
        else:
            return f"its weight is {w.q.dtype}, not int8"
        if w.scale.size > 1 and w.axis % w.q.ndim != want_axis:
            return f"its weight is quantized along axis {w.axis}, not {want_axis}"
        return q, np.broadcast_to(w.scale.reshape(-1).astype(np.float32), (w.q.shape[want_axis],)).copy()

    def saturates(self, name, rows, group=1) -> bool:
        """Whether this layer's sums differ under the chosen arithmetic from the exact ones:
        ORT-x86-novnni with int8 weights (uint8 weights take ORT's exact u8 x u8 kernels) and a
        pair that can leave int16. `rows()` -> [Cout, K] in the kernel's K order, asked only then."""
        return self.saturates_stored(self.qconst[name].q.dtype, rows, group)

    def saturates_stored(self, dtype, rows, group=1) -> bool:
        """saturates() of a weight stored as `dtype`."""
        return self.arithmetic == ORT_X86_NOVNNI and dtype == np.int8 and saturating.has_saturating_pairs(rows(), group)

    def bias(self, name, sx, sw, w=None, x_zp=0):
        """int32 bias with scale sx*sw (the int32 initializer as is when its scale agrees).
        With the int8 weights `w` ([Cout, ...]) given, a bias so large that the kernel's
        accumulator (bias - x_zp*sum(w) + sum(x*w)) could leave int32 is clipped to where it
        cannot: that output channel saturates either way."""
        if not name:
            return None
        want = (np.float32(sx) * sw).astype(np.float32)
        qc = self.qconst.get(name)
        b = None
        if qc is not None and qc.q.dtype == np.int32 and np.all(qc.zp == 0):
            if np.allclose(np.broadcast_to(qc.scale.reshape(-1), want.shape), want, rtol=1e-6, atol=0):
                b = qc.q.reshape(-1).astype(np.int64)
        if b is None:
            f = self.consts[name].astype(np.float64).reshape(-1)
            b = np.clip(np.rint(f / want.astype(np.float64)), -2 ** 31, 2 ** 31 - 1).astype(np.int64)
        if w is not None:
            w2 = w.reshape(w.shape[0], -1).astype(np.int64)
            zpsum = int(x_zp) * w2.sum(axis=1)
            span = 255 * np.abs(w2).sum(axis=1)
            b = np.clip(b, -2 ** 31 + span + np.maximum(zpsum, 0), 2 ** 31 - 1 - span + np.minimum(zpsum, 0))
        return b.astype(np.int32)

    def emit_q(self, qnode, *, nhwc, q, rank, fused, op_node):
        """Register the uint8 output of an int8 op (named after the Q it absorbs)."""
        v = self.add_val(qnode.output[0], "q", nhwc=nhwc, q=q, rank=rank)
        self.done.update(id(n) for n in fused)
        for n in fused:
            self.entries.append(Entry(n.name or n.op_type, n.op_type, "fused", f"into {op_node.name or op_node.op_type}"))
        return v

    # ------------------------------------------------------------ main loop
    def compile(self) -> Program:
        g = self.g
        inputs = []
        init_names = set(self.consts)
        for i in g.input:
            if i.name in init_names:
                continue
            t = i.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in t.shape.dim] if t.HasField("shape") else None
            v = self.add_val(i.name, "f", rank=len(dims) if dims is not None else None)
            inputs.append((i.name, v.slot, dims, t.elem_type))
        for node in g.node:
            if id(node) in self.done:
                continue
            try:
                self.node(node)
            except QtoolError:
                raise
            except NotImplementedError as e:
                raise QtoolError(f"{self.where}: node '{node.name}' ({node.op_type}): {e}") from None
            except Exception as e:
                raise QtoolError(f"{self.where}: node '{node.name}' ({node.op_type}) cannot be prepared: "
                                 f"{type(e).__name__}: {e}") from None
        outputs = []
        for o in g.output:
            if o.name in self.consts:
                outputs.append((o.name, self.const_slot(o.name), "f", False))
            elif o.name in self.views:
                outputs.append((o.name, self.float_input(o.name), "f", False))
            elif o.name in self.vals:
                v = self.vals[o.name]
                outputs.append((o.name, v.slot, v.kind, v.nhwc))
            else:
                raise QtoolError(f"{self.where}: graph output '{o.name}' is never produced")
        consts = {slot: self.consts[name] for name, slot in self.const_slots.items()}
        values = {n: (v.slot, v.kind, v.nhwc) for n, v in self.vals.items()}
        return Program(self.steps, self.n_slots, consts, inputs, outputs, self.entries, values)

    def node(self, node):
        op = node.op_type
        name = node.name or op
        if op == "Constant":
            at = node_attrs(node)
            if "value" in at:
                v = np.asarray(at["value"])
            else:
                k, val = next(iter(at.items()))
                v = np.asarray(val, np.float32 if "float" in k else np.int64)
            self.consts[node.output[0]] = v
            self.entries.append(Entry(name, op, "folded"))
            return
        if all(self.is_const(i) for i in node.input) and op in FP32_OPS and self._foldable(node):
            ins = [self.consts[i] if i else None for i in node.input]
            at = node_attrs(node)
            at["_n_outputs"], at["_opset"] = len(node.output), self.opset
            outs = FP32_OPS[op](ins, at)
            for o, y in zip(node.output, outs):
                if o:
                    self.consts[o] = np.asarray(y)
            if op == "DequantizeLinear":
                s = ins[1]
                z = ins[2] if len(ins) > 2 and ins[2] is not None else np.zeros_like(s, dtype=ins[0].dtype)
                self.qconst[node.output[0]] = QConst(ins[0], s, z, at.get("axis", 1))
            self.entries.append(Entry(name, op, "folded"))
            return
        if op == "DequantizeLinear":
            src = self.vals.get(node.input[0])
            q = self.scalar_q(node)
            if src is not None and src.kind == "q" and q is not None:
                self.views[node.output[0]] = QView(node.input[0], q[0], q[1])
                return
        if op == "QuantizeLinear":
            q = self.scalar_q(node)
            x = node.input[0]
            if q is not None and x in self.views:
                v = self.views[x]
                src = self.vals[v.src]
                if (np.float32(v.scale), v.zp) == (np.float32(q[0]), q[1]):
                    self.vals[node.output[0]] = src
                    return
                nv = self.add_val(node.output[0], "q", nhwc=src.nhwc, q=q, rank=src.rank)
                self.steps.append(S.RequantStep(name, self.K, src.slot, nv.slot, (v.scale, v.zp), q))
                self.entries.append(Entry(name, "Requantize", "int8", "DQ -> Q with a different scale"))
                return
            x, shift = self.shifted.get(x, (x, 0.0))
            if q is not None and x in self.vals and self.vals[x].kind == "f":
                fx = self.vals[x]
                nhwc = fx.rank == 4 or fx.rank is None
                nv = self.add_val(node.output[0], "q", nhwc=nhwc, q=q, rank=fx.rank)
                self.steps.append(S.QuantizeStep(name, fx.slot, nv.slot, q[0], q[1], nhwc, self.K, shift=shift))
                self.entries.append(Entry(name, op, "convert", "float -> uint8" + (" NHWC" if nhwc else "")
                                          + (f", after adding {shift:g}" if shift else "")))
                return
        if op == "Add" and self._grid_shift(node):
            self.entries.append(Entry(name, op, "folded", "a constant shift, added inside the QuantizeLinear after it"))
            return
        rule = INT_RULES.get(op)
        reason = "no int8 kernel for this op"
        if rule is not None:
            r = rule(self, node)
            if r is None:
                return
            reason = r
        if op in ELEMENTWISE:
            r = rule_region(self, node)
            if r is None:
                return
            if rule is None:
                reason = f"no int8 kernel for this op ({r})"
        self.fallback(node, reason)

    def _foldable(self, node) -> bool:
        """Whether a node on constants can be computed now: its output size is bounded from the inputs
        first (a ConstantOfShape of [1e5, 1e5] would allocate 40 GB at load). Over the limit is an error;
        without a bound the node runs as a step, on the inputs it gets."""
        ins = [self.consts[i] if i else None for i in node.input]
        n = fold_elems(node.op_type, ins, node_attrs(node))
        # no larger than an input: the file already holds that much (a big fp32 layer's weight dequantized)
        given = max((int(np.size(i)) for i in ins if i is not None), default=0)
        if n is not None and n > max(MAX_FOLD_ELEMS, given):
            raise QtoolError(f"{self.where}: node '{node.name}' ({node.op_type}) would make a constant of {n} elements "
                             f"(limit {MAX_FOLD_ELEMS}); refusing to compute it")
        return n is not None

    def fallback(self, node, reason):
        op = node.op_type
        if op not in FP32_OPS:
            raise QtoolError(f"{self.where}: node '{node.name}' uses op {op}, which qtool's runtime cannot run "
                             f"(neither in int8 nor in fp32)")
        if rule_fp32(self, node) is None:  # a native float32 kernel (LayerNorm, Softmax, GELU, ...)
            return
        ins = [self.float_input(i) if i else None for i in node.input]
        outs = []
        r_in = self.ranks.get(node.input[0]) if node.input else None
        for o in node.output:
            if o:
                outs.append(self.add_val(o, "f", rank=self.ranks.get(o, r_in)).slot)
            else:
                outs.append(None)
        at = node_attrs(node)
        at["_n_outputs"], at["_opset"] = len(node.output), self.opset
        self.steps.append(S.FP32Step(node.name or op, op, ins, outs, at, reason))
        self.entries.append(Entry(node.name or op, op, "fp32", reason))
