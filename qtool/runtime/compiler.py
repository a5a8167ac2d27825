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
  * an op in INT_RULES whose data inputs are dq views and whose output goes only to one
    QuantizeLinear (optionally through Relu/Clip) -> one int8 step producing that Q's output;
  * anything else -> the fp32 numpy op, with its dq-view inputs dequantized first; a later Q
    quantizes the result. The reason is recorded for `report()`.
A rule whose precondition fails returns the reason and leaves the node to the next rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from qtool.arithmetic import EXACT, ORT_X86_NOVNNI, check_arithmetic, conv_rows, is_depthwise
from qtool.errors import QtoolError
from qtool.limits import MAX_FOLD_ELEMS, fold_elems
from qtool.runtime import saturating
from qtool.runtime import steps as S
from qtool.runtime.backend import conv_multiplier
from qtool.runtime.fp32_ops import FP32_OPS


@dataclass
class QView:
    """A float tensor that is DequantizeLinear(uint8 tensor `src`)."""
    src: str
    scale: np.float32
    zp: int


@dataclass
class QConst:
    """A constant that is DequantizeLinear(integer initializer)."""
    q: np.ndarray
    scale: np.ndarray
    zp: np.ndarray
    axis: int


@dataclass
class Val:
    slot: int
    kind: str                 # 'q' uint8 tensor, 'f' float/other runtime tensor
    nhwc: bool = False        # for 'q': stored NHWC when rank 4
    q: tuple | None = None    # (scale, zp) of the Q that produced it
    rank: int | None = None


@dataclass
class Entry:
    node: str
    op: str
    mode: str                 # int8 | fp32 | folded | fused | convert
    detail: str = ""


@dataclass
class Program:
    steps: list
    n_slots: int
    consts: dict              # slot -> array
    inputs: list              # [(name, slot, dims, elem_type)]
    outputs: list             # [(name, slot, kind, nhwc)]
    entries: list = field(default_factory=list)
    values: dict = field(default_factory=dict)  # tensor name -> (slot, kind, nhwc), for debugging


def _attrs(node):
    out = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        out[a.name] = numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v
    return out


def _static_value_ranks(model):
    ranks = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        inferred = model
    g = inferred.graph
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            ranks[vi.name] = len(t.shape.dim)
    return ranks


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
        self.shifted: dict[str, tuple] = {}  # Add output -> (its float input, the constant), see _grid_shift
        for n in g.node:
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)
        self.ranks = _static_value_ranks(model)
        self.pads: dict = {}  # uint8 output of an int8 Pad -> (input name, (t, l, b, r), fill, step)
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
                self.steps.append(S.ShapeOpStep(f"to NCHW {name}", "Identity", self.K, v.slot, fv.slot, [], {}, True, None))
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
                at = _attrs(act)
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
        return (self.arithmetic == ORT_X86_NOVNNI and self.qconst[name].q.dtype == np.int8
                and saturating.has_saturating_pairs(rows(), group))

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
            at = _attrs(node)
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
            at = _attrs(node)
            at["_n_outputs"] = len(node.output)
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
            r = _rule_region(self, node)
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
        n = fold_elems(node.op_type, ins, _attrs(node))
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
        ins = [self.float_input(i) if i else None for i in node.input]
        outs = []
        r_in = self.ranks.get(node.input[0]) if node.input else None
        for o in node.output:
            if o:
                outs.append(self.add_val(o, "f", rank=self.ranks.get(o, r_in)).slot)
            else:
                outs.append(None)
        at = _attrs(node)
        at["_n_outputs"] = len(node.output)
        self.steps.append(S.FP32Step(node.name or op, op, ins, outs, at, reason))
        self.entries.append(Entry(node.name or op, op, "fp32", reason))


# ------------------------------------------------------------ int8 rules: node -> None (done) or reason

def _rule_conv(c: Compiler, node):
    x = c.views.get(node.input[0])
    if x is None:
        return "its input is not a dequantized uint8 tensor"
    if c.vals[x.src].rank not in (4, None):
        return f"rank {c.vals[x.src].rank} convolution"
    w = c.weight(node.input[1], 0)
    if isinstance(w, str):
        return w
    wq, sw = w
    if wq.ndim != 4:
        return f"{wq.ndim - 2}-D convolution (only 2-D has an int8 kernel)"
    at = _attrs(node)
    ap = at.get("auto_pad", b"NOTSET")
    ap = ap.decode() if isinstance(ap, bytes) else ap
    if ap not in ("NOTSET", "VALID", "", "SAME_UPPER", "SAME_LOWER"):
        return f"auto_pad={ap}"
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    qnode, qy, lo, hi, fused = oq
    group = at.get("group", 1)
    bias = c.bias(node.input[2] if len(node.input) > 2 else "", x.scale, sw, wq, x.zp)
    mult = conv_multiplier(c.K, x.scale, sw, qy[0])
    pads = tuple(at.get("pads", [0, 0, 0, 0])) if ap != "VALID" else (0, 0, 0, 0)
    pd = c.pads.get(x.src)
    if pd is not None and pd[2] == x.zp and len(c.consumers.get(node.input[0], [])) == 1 \
            and sum(len(c.consumers.get(d.output[0], [])) for d in c.consumers.get(x.src, [])) == 1:
        # Pad(0) -> Conv: the convolution pads instead (its padding reads x_zp, a real 0)
        src, (pt, pl, pb, pr), _, pad_step = pd
        pads = (pads[0] + pt, pads[1] + pl, pads[2] + pb, pads[3] + pr)
        c.steps.remove(pad_step)
        for e in c.entries:
            if e.detail == "pad" and e.node == pad_step.name:
                e.mode, e.detail = "fused", f"into {node.name or 'Conv'}"
        x = QView(src, x.scale, x.zp)
    K = saturating if not is_depthwise(wq.shape, group) and c.saturates(node.input[1], lambda: conv_rows(wq), group) \
        else c.K

    def pack(p4):
        return K.pack_conv2d(wq, bias, x_zp=x.zp, multiplier=mult, y_zp=qy[1], strides=tuple(at.get("strides", [1, 1])),
                             pads=p4, dilations=tuple(at.get("dilations", [1, 1])), group=group, lo=lo, hi=hi)
    if ap.startswith("SAME"):  # pads depend on the input size: pack per input size, at plan time
        from qtool.runtime.fp32_ops import conv_pads
        packed = S.SamePadPacker(pack, lambda hw: tuple(conv_pads(at, hw, wq.shape[2:])))
    else:
        packed = pack(pads)
    xs = c.nhwc_input(x.src)
    v = c.emit_q(qnode, nhwc=True, q=qy, rank=4, fused=fused, op_node=node)
    st = S.ConvStep(node.name or "Conv", K, packed, xs, v.slot, wq.shape[1], wq.shape[2], wq.shape[3])
    c.steps.append(st)
    c.entries.append(Entry(node.name or "Conv", "Conv", "int8", st.kernel))
    return None


def _gemm_like(c: Compiler, node, wq_nk, sw, bias_name, x):
    src = c.vals[x.src]
    if src.nhwc and src.rank == 4:
        return "its input is a rank-4 NHWC tensor"
    oq = c.out_quant(node.output[0])
    bias = c.bias(bias_name, x.scale, sw, wq_nk, x.zp)
    K = saturating if c.saturates(node.input[1], lambda: wq_nk) else c.K
    if isinstance(oq, str):  # float output (e.g. the logits): y = acc * s_x * s_w
        mult = (np.float32(x.scale) * sw).astype(np.float32)
        packed = K.pack_gemm(wq_nk, bias, x_zp=x.zp, multiplier=mult, out_dtype="float32")
        v = c.add_val(node.output[0], "f", rank=src.rank)
        detail = "float output"
    else:
        qnode, qy, lo, hi, fused = oq
        mult = conv_multiplier(c.K, x.scale, sw, qy[0])
        packed = K.pack_gemm(wq_nk, bias, x_zp=x.zp, multiplier=mult, y_zp=qy[1], lo=lo, hi=hi)
        v = c.emit_q(qnode, nhwc=False, q=qy, rank=src.rank, fused=fused, op_node=node)
        detail = ""
    st = S.GemmStep(node.name or node.op_type, node.op_type, K, packed, src.slot, v.slot)
    st.k = wq_nk.shape[1]
    c.steps.append(st)
    c.entries.append(Entry(node.name or node.op_type, node.op_type, "int8", (st.kernel + " " + detail).strip()))
    return None


def _rule_gemm(c: Compiler, node):
    x = c.views.get(node.input[0])
    if x is None:
        return "its input is not a dequantized uint8 tensor"
    at = _attrs(node)
    if at.get("transA", 0) or at.get("alpha", 1.0) != 1.0 or (len(node.input) > 2 and at.get("beta", 1.0) != 1.0):
        return "transA/alpha/beta other than the defaults"
    trans_b = at.get("transB", 0)
    w = c.weight(node.input[1], 0 if trans_b else 1)
    if isinstance(w, str):
        return w
    wq, sw = w
    wq_nk = wq if trans_b else np.ascontiguousarray(wq.T)
    if len(node.input) > 2 and node.input[2] and c.consts.get(node.input[2], np.zeros(1)).ndim > 1:
        return "a bias that is not a vector"
    return _gemm_like(c, node, wq_nk, sw, node.input[2] if len(node.input) > 2 else "", x)


def _rule_matmul(c: Compiler, node):
    x = c.views.get(node.input[0])
    if x is None:
        return "its input is not a dequantized uint8 tensor"
    if node.input[1] not in c.qconst or c.qconst[node.input[1]].q.ndim != 2:
        return "its second input is not a 2-D quantized constant"
    w = c.weight(node.input[1], 1)
    if isinstance(w, str):
        return w
    wq, sw = w
    return _gemm_like(c, node, np.ascontiguousarray(wq.T), sw, "", x)


def _rule_add(c: Compiler, node):
    a, b = (c.views.get(i) for i in node.input)
    if a is None or b is None:
        return "an input is not a dequantized uint8 tensor"
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    qnode, qy, lo, hi, fused = oq
    va = c.vals[a.src]
    sa, sb, nhwc = _binary_slots(c, a, b)
    v = c.emit_q(qnode, nhwc=nhwc, q=qy, rank=va.rank, fused=fused, op_node=node)
    st = S.AddStep(node.name or "Add", c.K, sa, sb, v.slot, (a.scale, a.zp), (b.scale, b.zp), qy, lo, hi)
    c.steps.append(st)
    c.entries.append(Entry(node.name or "Add", "Add", "int8", st.kernel))
    return None


def _binary_slots(c: Compiler, a, b):
    """Buffers for a two-input op: both as they are when their layouts agree, else both NHWC."""
    va, vb = c.vals[a.src], c.vals[b.src]
    if va.nhwc != vb.nhwc:
        return c.nhwc_input(a.src), c.nhwc_input(b.src), True
    return va.slot, vb.slot, va.nhwc


def _rule_mul(c: Compiler, node):
    a, b = (c.views.get(i) for i in node.input)
    if a is None or b is None:
        return "an input is not a dequantized uint8 tensor"
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    qnode, qy, lo, hi, fused = oq
    for x, g in ((a, b), (b, a)):  # x * f(x) with f a table (SiLU = x * Sigmoid(x)): one table
        t = c.luts.get(g.src)
        only_here = len(c.consumers.get(g.src, [])) == 1 and sum(
            len(c.consumers.get(d.output[0], [])) for d in c.consumers.get(g.src, [])) == 1
        if t is not None and t[0] == x.src and only_here:
            src_name, table, lut_step = t
            xs = np.arange(256, dtype=np.int32)
            p = (xs - x.zp) * (table.astype(np.int32) - g.zp)
            ratio = np.float32(np.float32(np.float32(x.scale) * np.float32(g.scale)) / np.float32(qy[0]))
            f = (p.astype(np.float32) * ratio).astype(np.float32) + np.float32(qy[1])
            lut = np.clip(np.rint(f), lo, hi).astype(np.uint8)
            c.steps.remove(lut_step)
            for e in c.entries:
                if e.node == lut_step.name and e.mode == "int8":
                    e.mode, e.detail = "fused", f"into {node.name or 'Mul'} (one table for x * f(x))"
            src = c.vals[x.src]
            v = c.emit_q(qnode, nhwc=src.nhwc, q=qy, rank=src.rank, fused=fused, op_node=node)
            st = S.LutStep(node.name or "Mul", "Mul", src.slot, v.slot, lut, c.K)
            c.steps.append(st)
            c.luts[qnode.output[0]] = (x.src, lut, st)
            c.entries.append(Entry(node.name or "Mul", "Mul", "int8", "lookup table x * f(x)"))
            return None
    va, vb = c.vals[a.src], c.vals[b.src]
    if va.rank != vb.rank or va.rank is None:
        return "inputs of different or unknown rank"
    sa, sb, nhwc = _binary_slots(c, a, b)
    v = c.emit_q(qnode, nhwc=nhwc, q=qy, rank=va.rank, fused=fused, op_node=node)
    st = S.MulStep(node.name or "Mul", c.K, sa, sb, v.slot, (a.scale, a.zp), (b.scale, b.zp), qy, lo, hi)
    c.steps.append(st)
    c.entries.append(Entry(node.name or "Mul", "Mul", "int8", st.kernel))
    return None


def _pool_common(c: Compiler, node):
    x = c.views.get(node.input[0])
    if x is None:
        return "its input is not a dequantized uint8 tensor"
    if c.vals[x.src].rank not in (4, None):
        return f"rank {c.vals[x.src].rank} pooling"
    at = _attrs(node)
    ap = at.get("auto_pad", b"NOTSET")
    ap = ap.decode() if isinstance(ap, bytes) else ap
    if ap not in ("NOTSET", "VALID", "", "SAME_UPPER", "SAME_LOWER"):
        return f"auto_pad={ap}"
    if len(node.output) > 1 and node.output[1]:
        return "MaxPool with an Indices output"
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    return x, at, oq


def _rule_maxpool(c: Compiler, node):
    r = _pool_common(c, node)
    if isinstance(r, str):
        return r
    x, at, (qnode, qy, lo, hi, fused) = r
    if at.get("storage_order", 0):
        return "storage_order=1"
    same = (np.float32(x.scale), x.zp) == (np.float32(qy[0]), qy[1]) and lo == 0 and hi == 255
    if not same and (lo != 0 or hi != 255):
        return "MaxPool followed by Relu/Clip and a different scale"
    xs = c.nhwc_input(x.src)
    if same:
        v = c.emit_q(qnode, nhwc=True, q=qy, rank=4, fused=fused, op_node=node)
        c.steps.append(S.MaxPoolStep(node.name or "MaxPool", c.K, xs, v.slot, at))
    else:  # max commutes with the monotonic requantization: pool, then requantize
        mid = c.add_val(node.output[0] + "#pooled", "q", nhwc=True, q=(x.scale, x.zp), rank=4)
        c.steps.append(S.MaxPoolStep(node.name or "MaxPool", c.K, xs, mid.slot, at))
        v = c.emit_q(qnode, nhwc=True, q=qy, rank=4, fused=fused, op_node=node)
        c.steps.append(S.RequantStep(node.name + " requantize", c.K, mid.slot, v.slot, (x.scale, x.zp), qy))
    c.entries.append(Entry(node.name or "MaxPool", "MaxPool", "int8", "maxpool" + ("" if same else " + requantize")))
    return None


def _rule_avgpool(c: Compiler, node):
    r = _pool_common(c, node)
    if isinstance(r, str):
        return r
    x, at, (qnode, qy, lo, hi, fused) = r
    if at.get("ceil_mode", 0) and at.get("count_include_pad", 0):
        return "ceil_mode with count_include_pad"
    if tuple(at.get("dilations", [1, 1])) != (1, 1):
        return "dilated AveragePool"
    xs = c.nhwc_input(x.src)
    v = c.emit_q(qnode, nhwc=True, q=qy, rank=4, fused=fused, op_node=node)
    c.steps.append(S.AvgPoolStep(node.name or "AveragePool", c.K, xs, v.slot, at, (x.scale, x.zp), qy, lo, hi))
    c.entries.append(Entry(node.name or "AveragePool", "AveragePool", "int8", "avgpool"))
    return None


def _rule_gap(c: Compiler, node):
    x = c.views.get(node.input[0])
    if x is None:
        return "its input is not a dequantized uint8 tensor"
    if c.vals[x.src].rank not in (4, None):
        return f"rank {c.vals[x.src].rank} input"
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    qnode, qy, lo, hi, fused = oq
    xs = c.nhwc_input(x.src)
    v = c.emit_q(qnode, nhwc=True, q=qy, rank=4, fused=fused, op_node=node)
    c.steps.append(S.GlobalAvgPoolStep(node.name or "GlobalAveragePool", c.K, xs, v.slot, (x.scale, x.zp), qy, lo, hi))
    c.entries.append(Entry(node.name or "GlobalAveragePool", "GlobalAveragePool", "int8", "global_avgpool"))
    return None


def _rule_concat(c: Compiler, node):
    xs = [c.views.get(i) for i in node.input]
    if any(x is None for x in xs):
        return "an input is not a dequantized uint8 tensor"
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    qnode, qy, lo, hi, fused = oq
    if lo != 0 or hi != 255:
        return "Concat followed by Relu/Clip"
    axis = _attrs(node)["axis"]
    vs = [c.vals[x.src] for x in xs]
    rank = next((v.rank for v in vs if v.rank is not None), None)
    if rank is None:
        return "unknown input rank"
    axis %= rank
    if rank == 4 and any(v.nhwc for v in vs):
        slots = [c.nhwc_input(x.src) for x in xs]
        axis = {0: 0, 1: 3, 2: 1, 3: 2}[axis]
        nhwc = True
    else:
        slots = [v.slot for v in vs]
        nhwc = False
    v = c.emit_q(qnode, nhwc=nhwc, q=qy, rank=rank, fused=fused, op_node=node)
    c.steps.append(S.ConcatStep(node.name or "Concat", c.K, slots, v.slot, axis, [(x.scale, x.zp) for x in xs], qy))
    c.entries.append(Entry(node.name or "Concat", "Concat", "int8", "concat"))
    return None


def _rule_shape_op(c: Compiler, node):
    x = c.views.get(node.input[0])
    if x is None:
        return "its input is not a dequantized uint8 tensor"
    if not all(c.is_const(i) for i in node.input[1:]):
        return "its shape/axes input is not constant"
    if node.op_type in ("Resize", "Upsample"):
        mode = _attrs(node).get("mode", b"nearest")
        if (mode.decode() if isinstance(mode, bytes) else mode) != "nearest":
            return "only nearest Resize selects values (others interpolate)"
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    qnode, qy, lo, hi, fused = oq
    if lo != 0 or hi != 255:
        return f"{node.op_type} followed by Relu/Clip"
    src = c.vals[x.src]
    extra = [c.consts[i] if i else None for i in node.input[1:]]
    same = (np.float32(x.scale), x.zp) == (np.float32(qy[0]), qy[1])
    rank = c.ranks.get(node.output[0])
    v = c.emit_q(qnode, nhwc=False, q=qy, rank=rank, fused=fused, op_node=node)
    at = _attrs(node)
    st = S.ShapeOpStep(node.name or node.op_type, node.op_type, c.K, src.slot, v.slot, extra, at, src.nhwc,
                       None if same else ((x.scale, x.zp), qy))
    c.steps.append(st)
    c.entries.append(Entry(node.name or node.op_type, node.op_type, "int8", "on uint8 data" + ("" if same else " + requantize")))
    return None


def _rule_pad(c: Compiler, node):
    x = c.views.get(node.input[0])
    if x is None:
        return "its input is not a dequantized uint8 tensor"
    at = _attrs(node)
    mode = at.get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "constant":
        return f"mode={mode}"
    if len(node.input) < 2 or not all(c.is_const(i) for i in node.input[1:]) or (len(node.input) > 3 and node.input[3]):
        return "pads/value not constant, or an axes input"
    pads = [int(p) for p in c.consts[node.input[1]]]
    if len(pads) != 8 or any(pads[i] for i in (0, 1, 4, 5)) or min(pads) < 0:
        return "padding other than non-negative H/W padding of a rank-4 tensor"
    src = c.vals[x.src]
    if not src.nhwc or src.rank not in (4, None):
        return "input is not an NHWC tensor"
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    qnode, qy, lo, hi, fused = oq
    if (np.float32(qy[0]), qy[1]) != (np.float32(x.scale), x.zp) or lo != 0 or hi != 255:
        return "the QuantizeLinear after it changes the scale"
    value = float(c.consts[node.input[2]].reshape(-1)[0]) if len(node.input) > 2 and node.input[2] else 0.0
    fill = int(np.clip(np.rint(np.float32(value) / np.float32(x.scale)) + x.zp, 0, 255))
    v = c.emit_q(qnode, nhwc=True, q=qy, rank=4, fused=fused, op_node=node)
    p4 = (pads[2], pads[3], pads[6], pads[7])
    st = S.PadStep(node.name or "Pad", src.slot, v.slot, p4, fill)
    c.steps.append(st)
    c.pads[qnode.output[0]] = (x.src, p4, fill, st)
    c.entries.append(Entry(node.name or "Pad", "Pad", "int8", "pad"))
    return None


LUT_OPS = {"Relu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "LeakyRelu", "Tanh", "Exp", "Neg", "Abs",
           "Sqrt", "Erf", "BatchNormalization", "Identity"}


def _rule_lut(c: Compiler, node):
    """DQ -> elementwise op -> Q == a table lookup on the uint8 values (per channel for BN)."""
    x = c.views.get(node.input[0])
    if x is None:
        return "its input is not a dequantized uint8 tensor"
    if not all(c.is_const(i) for i in node.input[1:]):
        return "a non-constant second input"
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    qnode, qy, lo, hi, fused = oq
    src = c.vals[x.src]
    at = _attrs(node)
    at["_n_outputs"] = 1
    vals = ((np.arange(256, dtype=np.int32) - x.zp).astype(np.float32) * np.float32(x.scale)).astype(np.float32)
    extra = [c.consts[i] if i else None for i in node.input[1:]]
    if node.op_type == "BatchNormalization":
        if not (src.nhwc and src.rank == 4) or any(len(node.output) > 1 and o for o in node.output[1:]):
            return "BatchNormalization on a tensor that is not NHWC rank 4"
        ch = extra[0].reshape(-1).shape[0]
        xin = np.ascontiguousarray(np.broadcast_to(vals, (1, ch, 256)))
    else:
        xin = vals
    y = FP32_OPS[node.op_type]([xin] + extra, at)[0].astype(np.float32)
    q = np.clip(np.clip(np.rint(y / np.float32(qy[0])) + np.float32(qy[1]), 0, 255), lo, hi).astype(np.uint8)
    lut = q.reshape(-1, 256) if node.op_type == "BatchNormalization" else q.reshape(256)
    v = c.emit_q(qnode, nhwc=src.nhwc, q=qy, rank=src.rank, fused=fused, op_node=node)
    st = S.LutStep(node.name or node.op_type, node.op_type, src.slot, v.slot, lut, c.K)
    c.steps.append(st)
    if lut.ndim == 1:
        c.luts[qnode.output[0]] = (x.src, lut, st)
    c.entries.append(Entry(node.name or node.op_type, node.op_type, "int8", "lookup table" + (" per channel" if lut.ndim == 2 else "")))
    return None


ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Relu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish",
               "Tanh", "LeakyRelu", "Exp", "Log", "Neg", "Abs", "Min", "Max", "Erf", "Identity", "Reciprocal"}


def _rule_region(c: Compiler, node):
    """A chain/DAG of elementwise fp32 ops whose only non-constant input is one uint8 tensor and
    which ends in one QuantizeLinear (e.g. hard-swish x * Clip(x + 3, 0, 6) / 6 left in float by
    the quantizer) is a function of that tensor's 256 values: one table (per channel when a
    constant is per channel). Evaluated once at load with the fp32 ops, as ORT would run them."""
    views = {i: c.views[i] for i in node.input if i and i in c.views}
    if not views or any(i and i not in views and not c.is_const(i) for i in node.input):
        return "inputs are not one uint8 tensor and constants"
    keys = {(v.src, float(v.scale), v.zp) for v in views.values()}
    if len(keys) != 1:
        return "inputs come from different uint8 tensors"
    src_name, scale, zp = next(iter(keys))
    names = set(views)
    region, ids, produced = [node], {id(node)}, {o for o in node.output if o}
    final = None
    for _ in range(64):
        if produced & c.graph_outputs:
            return "part of the chain is a graph output"
        ext = [(v, m) for v in produced for m in c.consumers.get(v, []) if id(m) not in ids]
        if len(ext) == 1 and ext[0][1].op_type == "QuantizeLinear" and c.scalar_q(ext[0][1]) is not None \
                and all(len([m for m in c.consumers.get(v, []) if id(m) not in ids]) == 0 for v in produced if v != ext[0][0]):
            final = ext[0]
            break
        added = False
        for v, m in ext:
            if id(m) in ids or id(m) in c.done:
                continue
            if m.op_type in ELEMENTWISE and all(not i or i in produced or i in names or c.is_const(i) for i in m.input):
                region.append(m)
                ids.add(id(m))
                produced |= {o for o in m.output if o}
                added = True
        if not added:
            return "the elementwise chain does not end in one QuantizeLinear"
    if final is None:
        return "elementwise chain too long"
    out_name, qnode = final
    qy = c.scalar_q(qnode)
    srcv = c.vals[src_name]
    consts = [i for m in region for i in m.input if i and c.is_const(i)]
    per_channel = None
    for i in consts:
        a = c.consts[i]
        if a.size > 1:
            sq = np.squeeze(a)
            if sq.ndim != 1 or not (srcv.nhwc and srcv.rank == 4) or a.ndim not in (3, 4) or a.shape[-1] != 1 or a.shape[-2] != 1:
                return f"constant of shape {list(a.shape)} is neither a scalar nor per channel"
            if per_channel not in (None, sq.shape[0]):
                return "per-channel constants of different lengths"
            per_channel = sq.shape[0]
    vals = ((np.arange(256, dtype=np.int32) - zp).astype(np.float32) * np.float32(scale)).astype(np.float32)
    if per_channel:
        vals = np.ascontiguousarray(np.broadcast_to(vals, (per_channel, 256)))
    env = {n: vals for n in names}
    for m in region:
        ins = []
        for i in m.input:
            if not i:
                ins.append(None)
            elif i in env:
                ins.append(env[i])
            else:
                a = c.consts[i]
                ins.append(a.reshape(()) if a.size == 1 else np.squeeze(a).reshape(-1, 1))
        at = _attrs(m)
        at["_n_outputs"] = len(m.output)
        try:
            ys = FP32_OPS[m.op_type](ins, at)
        except Exception as e:  # an attribute combination the numpy op does not take
            return f"cannot tabulate {m.op_type}: {e}"
        for o, y in zip(m.output, ys):
            if o:
                env[o] = np.asarray(y, np.float32)
    y = np.broadcast_to(env[out_name], vals.shape).astype(np.float32)
    lut = np.clip(np.rint(y / np.float32(qy[0])) + np.float32(qy[1]), 0, 255).astype(np.uint8)
    for m in region[1:]:
        c.done.add(id(m))
        c.entries.append(Entry(m.name or m.op_type, m.op_type, "fused", f"into the table of {node.name or node.op_type}"))
    v = c.emit_q(qnode, nhwc=srcv.nhwc, q=qy, rank=srcv.rank, fused=[qnode], op_node=node)
    st = S.LutStep(node.name or node.op_type, node.op_type, srcv.slot, v.slot, lut, c.K)
    c.steps.append(st)
    if lut.ndim == 1:
        c.luts[qnode.output[0]] = (src_name, lut, st)
    c.entries.append(Entry(node.name or node.op_type, node.op_type, "int8",
                           f"lookup table of {len(region)} elementwise ops" + (" per channel" if lut.ndim == 2 else "")))
    return None


INT_RULES = {
    **{op: _rule_lut for op in LUT_OPS},
    "Pad": _rule_pad,
    "Conv": _rule_conv,
    "Gemm": _rule_gemm,
    "MatMul": _rule_matmul,
    "Add": _rule_add,
    "Mul": _rule_mul,
    "MaxPool": _rule_maxpool,
    "AveragePool": _rule_avgpool,
    "GlobalAveragePool": _rule_gap,
    "Concat": _rule_concat,
    "Reshape": _rule_shape_op,
    "Flatten": _rule_shape_op,
    "Squeeze": _rule_shape_op,
    "Unsqueeze": _rule_shape_op,
    "Transpose": _rule_shape_op,
    "Slice": _rule_shape_op,
    "Resize": _rule_shape_op,
    "Upsample": _rule_shape_op,
    **{op: _rule_shape_op for op in ("Gather", "GatherElements", "Expand", "Tile", "DepthToSpace", "SpaceToDepth",
                                     "ReduceMax", "ReduceMin")},
}
