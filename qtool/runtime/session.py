"""NativeSession: run a QDQ int8 ONNX model on qtool's kernels, with an ORT-like API.

    sess = NativeSession("model.int8.onnx", threads=2)
    [logits] = sess.run(None, {"input": x})
    print(sess.report())

Loading compiles the graph once (qtool.runtime.compiler) and packs every weight. The first
run with a new set of input shapes traces the plan, then assigns every intermediate tensor a
buffer from a pool (a buffer is reused as soon as the last reader of its tensor has run), and
binds each step to its buffers; later runs with those shapes only call the bound steps.
"""
from __future__ import annotations

import os
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
import onnx

from qtool.blas import blas_threads
from qtool.errors import QtoolError
from qtool.modelio import check_tensor, load_model
from qtool.runtime.backend import kernel_info, load_backend
from qtool.runtime.compiler import Compiler
from qtool.runtime.plan_static import static_steps

_ELEM = {1: "tensor(float)", 2: "tensor(uint8)", 3: "tensor(int8)", 6: "tensor(int32)", 7: "tensor(int64)",
         10: "tensor(float16)", 11: "tensor(double)"}


@dataclass
class NodeArg:
    name: str
    shape: list
    type: str


PLANS = 8  # plans (one per set of input shapes) kept at most
PLAN_BYTES = 512 << 20  # ... and their buffers together (the newest is kept whatever its size)


class _Plan:
    __slots__ = ("env", "calls", "steps_calls", "in_slots", "bytes", "bytes_no_reuse", "n_buffers")


def _load(model):
    if isinstance(model, onnx.ModelProto):
        for t in model.graph.initializer:
            check_tensor(t, "model")
        return model, "model"
    path = os.fspath(model)
    if not os.path.exists(path):
        raise QtoolError(f"{path}: no such file")
    # modelio's checks: a regular file, external data inside its folder, every tensor as long as its shape
    return load_model(path, check=False), path


def _liveness(steps, aliases):
    """Liveness over buffer roots (a view keeps its source alive): -> (slot -> root slot,
    root slot -> index of the last step reading it)."""
    root = {}
    last = {}
    for k, st in enumerate(steps):
        for i in st.ins:
            if i is not None:
                r = root.get(i, i)
                last[r] = k
        for o, i in aliases.get(k, ()):
            root[o] = root.get(i, i)
    return root, last


def _new_buffer(nb):
    raw = np.empty(nb + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off:off + nb]


def _assign_buffers(env, steps, views, live):
    """Every traced output of a step (but views) gets a 64-byte aligned buffer, the smallest free
    one that fits, else a new one; a buffer returns to the pool after its root's last reader.
    live = (root, last, forever: roots never freed). -> (slot -> buffer, (bytes allocated, bytes
    without reuse, buffers))."""
    root, last, forever = live
    pool = []  # free raw buffers
    owner = {}  # root slot -> raw buffer
    bufs = {}
    total = no_reuse = n_buffers = 0
    for k, st in enumerate(steps):
        if st.uses_out and k not in views:
            for o in st.outs:
                a = env[o]
                nb = max(a.nbytes, 1)
                no_reuse += nb
                best = None
                for j, raw in enumerate(pool):
                    if raw.nbytes >= nb and (best is None or raw.nbytes < pool[best].nbytes):
                        best = j
                if best is None:
                    raw = _new_buffer(nb)
                    total += nb
                    n_buffers += 1
                else:
                    raw = pool.pop(best)
                owner[o] = raw
                bufs[o] = raw[:a.nbytes].view(a.dtype).reshape(a.shape)
                if last.get(o, -1) < k and o not in forever:  # never read: free at once
                    pool.append(owner.pop(o))
        for i in set(st.ins):
            if i is None:
                continue
            r = root.get(i, i)
            if last.get(r) == k and r in owner and r not in forever:
                pool.append(owner.pop(r))
    return bufs, (total, no_reuse, n_buffers)


VIEW_OPS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity")


def _fixed_views(steps, aliases, views, bufs, static):
    """fp32 shape ops (numpy views) of a plan buffer, or of such a view, whose other inputs are constants
    or values made once per plan (`static`: slots): the same view on every run, so made once at binding
    like the int8 views (the Reshape/Transpose pairs around every attention cost no call)."""
    fixed = set(bufs)
    made = set()
    for k, st in enumerate(steps):
        if k in views:
            if st.ins and st.ins[0] in fixed:
                fixed.update(o for o in st.outs if o is not None)
            continue
        if st.mode == "fp32" and not st.uses_out and st.op in VIEW_OPS and k in aliases and st.ins \
                and st.ins[0] in fixed and all(i is None or i in static for i in st.ins[1:]):
            made.add(k)
            fixed.update(o for o in st.outs if o is not None)
    return made


def _bound_indices(steps, views):
    """The step index of each call _bind_steps returns (views are made at binding, not called)."""
    return [k for k in range(len(steps)) if k not in views]


def _bind_steps(env, steps, views, bufs):
    """Binds in order (every input is a fixed buffer by then): -> [(step, bound call)]."""
    steps_calls = []
    for k, st in enumerate(steps):
        if k in views:  # a view of a fixed buffer stays valid: make it once
            st.run(env, None)
            continue
        out = [bufs[o] for o in st.outs] if st.uses_out else None
        if out:
            for o, b in zip(st.outs, out):
                env[o] = b
        steps_calls.append((st, st.bind(env, out)))
    return steps_calls


class NativeSession:
    def __init__(self, model, threads: int = 2, backend: str | None = None, reuse_buffers: bool = True,
                 arithmetic: str = "exact"):
        """`arithmetic` (qtool/arithmetic.py): "exact" int32 sums, or "ort-x86-novnni", what ONNX
        Runtime computes on an x86 CPU without VNNI (its int16 pair saturation, emulated)."""
        m, self.where = _load(model)
        self.arithmetic = arithmetic
        self.reuse_buffers = reuse_buffers  # False keeps every intermediate (for debugging)
        self.K, self.backend = load_backend(backend)
        self.threads = int(threads)
        self._set_threads()
        self._prewake = getattr(self.K, "pool_prewake", None) if self.threads > 1 else None
        t = time.perf_counter()
        self.program = Compiler(m, self.K, self.where, arithmetic).compile()
        self.load_seconds = time.perf_counter() - t
        self._plans: OrderedDict = OrderedDict()
        self._inputs = [NodeArg(n, [d if d is not None else "N" for d in dims] if dims is not None else None,
                                _ELEM.get(et, str(et))) for n, _, dims, et in self.program.inputs]
        self._out_names = [o[0] for o in self.program.outputs]

    # ---------------------------------------------------------------- ORT-like API
    def get_inputs(self):
        return list(self._inputs)

    def get_outputs(self):
        return [NodeArg(n, None, "tensor") for n in self._out_names]

    def run(self, output_names, feeds: dict):
        if self._prewake is not None:  # the workers wake while Python checks the inputs
            self._prewake()
        # numpy's BLAS (fp32 MatMul fallbacks) on one thread: OpenBLAS's waiting threads spin against the
        # kernels' pool (a ViT's attention MatMul took 117 ms on 2 BLAS threads inside a run, 4 ms alone)
        with blas_threads(1):
            plan = self._plan_for(feeds)
            for f in plan.calls:
                f()
        return self._collect(plan, output_names)

    # ---------------------------------------------------------------- internals
    def _set_threads(self):
        f = getattr(self.K, "set_num_threads", None)
        g = getattr(self.K, "get_num_threads", None)
        if f is not None and (g is None or g() != self.threads):
            f(self.threads)

    def _check_feeds(self, feeds):
        if not isinstance(feeds, dict):
            raise QtoolError(f"{self.where}: run() needs a dict of input name -> array, got {type(feeds).__name__}")
        names = [i[0] for i in self.program.inputs]
        extra = set(feeds) - set(names)
        if extra:
            raise QtoolError(f"{self.where}: unknown input '{sorted(extra)[0]}'; the model's inputs are {names}")
        arrs = []
        for name, slot, dims, et in self.program.inputs:
            if name not in feeds:
                raise QtoolError(f"{self.where}: input '{name}' is missing; expected shape {self._shape_str(dims)}")
            x = feeds[name]
            if not isinstance(x, np.ndarray):
                x = np.asarray(x)
            if et == 1:
                if x.dtype != np.float32:
                    if not np.issubdtype(x.dtype, np.floating):
                        raise QtoolError(f"{self.where}: input '{name}' has dtype {x.dtype}, expected float32")
                    x = x.astype(np.float32)
            if dims is not None:
                bad = x.ndim != len(dims) or any(d is not None and d != s for d, s in zip(dims, x.shape)) \
                    or any(s == 0 for s in x.shape)
                if bad:
                    raise QtoolError(f"{self.where}: input '{name}' has shape {list(x.shape)}, "
                                     f"expected {self._shape_str(dims)}")
            if not x.flags.c_contiguous:
                x = np.ascontiguousarray(x)
            arrs.append((slot, x))
        return arrs

    @staticmethod
    def _shape_str(dims):
        if dims is None:
            return "(any)"
        return "[" + ", ".join("N" if d is None else str(d) for d in dims) + "]"

    def _plan_for(self, feeds):
        self._set_threads()
        arrs = self._check_feeds(feeds)
        key = tuple(x.shape for _, x in arrs)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._make_plan(arrs)
            self._plans[key] = plan
            # plans of input shapes met before are kept for their next run, up to PLANS and PLAN_BYTES of
            # buffers together: photos of as many sizes as plans (a text detector's) held 8 x 350 MB
            while len(self._plans) > 1 and (len(self._plans) > PLANS or
                                            sum(p.bytes for p in self._plans.values()) > PLAN_BYTES):
                self._plans.popitem(last=False)
        env = plan.env
        for slot, x in arrs:
            env[slot] = x
        return plan

    def _run_step(self, st, env, out):
        try:
            st.run(env, out)
        except QtoolError:
            raise
        except Exception as e:
            shapes = [list(env[i].shape) if i is not None and env[i] is not None and hasattr(env[i], "shape") else None
                      for i in st.ins]
            raise QtoolError(f"{self.where}: node '{st.name}' ({st.op}) failed on input shapes {shapes}: "
                             f"{type(e).__name__}: {e}") from None

    def _make_plan(self, arrs):
        prog = self.program
        env = [None] * prog.n_slots
        for slot, a in prog.consts.items():
            env[slot] = a
        for slot, x in arrs:
            env[slot] = x
        steps = prog.steps
        aliases = self._trace(env, steps)
        # steps whose output 0 is a view of input 0's fixed buffer: made once, at binding
        views = {k for k in aliases if steps[k].uses_out}
        root, last = _liveness(steps, aliases)
        forever = {root.get(o[1], o[1]) for o in prog.outputs}
        if not self.reuse_buffers:
            forever = set(range(prog.n_slots))
        plan = _Plan()
        plan.env = env
        bufs, (plan.bytes, plan.bytes_no_reuse, plan.n_buffers) = _assign_buffers(env, steps, views, (root, last, forever))
        once = static_steps(steps, {slot for slot, _ in arrs}, set(prog.consts))
        static = set(prog.consts) | {o for k in once for o in steps[k].outs if o is not None}
        views |= _fixed_views(steps, aliases, views, bufs, static)
        plan.steps_calls = [sc for k, sc in zip(_bound_indices(steps, views), _bind_steps(env, steps, views, bufs))
                            if k not in once]
        plan.calls = [f for _, f in plan.steps_calls]
        for slot, x in arrs:
            env[slot] = x
        for f in plan.calls:  # once on the bound buffers, so that binding errors show up here
            f()
        return plan

    def _trace(self, env, steps) -> dict:
        """The trace run: every step allocates. -> step index -> [(output, input)]: the outputs
        that are views of an input."""
        aliases = {}
        for k, st in enumerate(steps):
            self._run_step(st, env, None)
            if st.uses_out and st.outs and st.ins and st.ins[0] is not None and env[st.ins[0]] is not None \
                    and isinstance(env[st.outs[0]], np.ndarray) and np.shares_memory(env[st.outs[0]], env[st.ins[0]]):
                aliases[k] = [(st.outs[0], st.ins[0])]
            elif not st.uses_out:
                # an fp32 fallback (Reshape, Slice, Split, Transpose in numpy) returns views of its inputs on
                # every run: those inputs' buffers must outlive every reader of the views (nudenet's YOLOv8
                # head read a Split's halves after the buffer under them was handed to the next step)
                pairs = [(o, i) for o in st.outs if o is not None and isinstance(env[o], np.ndarray)
                         for i in dict.fromkeys(st.ins) if i is not None and isinstance(env[i], np.ndarray)
                         and np.may_share_memory(env[o], env[i])]
                if pairs:
                    aliases[k] = pairs
        return aliases

    def _collect(self, plan, output_names):
        env = plan.env
        res = {}
        for name, slot, kind, nhwc in self.program.outputs:
            a = env[slot]
            if kind == "q" and nhwc and a.ndim == 4:
                a = a.transpose(0, 3, 1, 2)
            res[name] = np.array(a, copy=True)
        if output_names is None:
            return [res[n] for n in self._out_names]
        try:
            return [res[n] for n in output_names]
        except KeyError as e:
            raise QtoolError(f"{self.where}: unknown output {e}; the model's outputs are {self._out_names}") from None

    # ---------------------------------------------------------------- reporting
    def report(self) -> str:
        """Which nodes run as int8 kernels, which in fp32 (and why)."""
        e = self.program.entries
        by_mode = Counter(x.mode for x in e)
        lines = [f"{self.where}: backend {self.backend} ({kernel_info(self.K).get('isa', '?')}), {self.threads} threads, "
                 f"compiled in {self.load_seconds * 1000:.0f} ms"]
        lines.append("  " + ", ".join(f"{by_mode[m]} {m}" for m in ("int8", "fused", "fp32", "convert", "folded") if by_mode[m]))
        int_ops = Counter(x.op for x in e if x.mode == "int8")
        if int_ops:
            lines.append("  int8: " + ", ".join(f"{n} {op}" for op, n in int_ops.most_common()))
        fused = Counter(x.op for x in e if x.mode == "fused")
        if fused:
            lines.append("  fused into the step of another node: " + ", ".join(f"{n} {op}" for op, n in fused.most_common()))
        fp = [x for x in e if x.mode == "fp32"]
        if fp:
            lines.append(f"  fp32 fallback ({len(fp)} nodes):")
            for x in fp:
                lines.append(f"    {x.node} ({x.op}): {x.detail}")
        else:
            lines.append("  fp32 fallback: none")
        for key, p in self._plans.items():
            lines.append(f"  plan for input shapes {[list(k) for k in key]}: {p.n_buffers} buffers, "
                         f"{p.bytes / 1e6:.2f} MB ({p.bytes_no_reuse / 1e6:.2f} MB without reuse), {len(p.calls)} calls")
        return "\n".join(lines)

    def report_entries(self):
        return list(self.program.entries)

    def fallback_nodes(self):
        return [(x.node, x.op, x.detail) for x in self.program.entries if x.mode == "fp32"]

    def profile(self, feeds, repeats: int = 10, threads: int | None = None):
        """Time every step: -> list of dicts (name, op, mode, kernel, ms (median), macs); on `threads`
        threads when given (the session's own afterwards)."""
        pc = time.perf_counter
        keep, self.threads = self.threads, int(threads or self.threads)
        try:
            with blas_threads(1):  # as run() does
                plan = self._plan_for(feeds)
                times = [[] for _ in plan.steps_calls]
                for _ in range(repeats):
                    for j, (st, f) in enumerate(plan.steps_calls):
                        t = pc()
                        f()
                        times[j].append(pc() - t)
        finally:
            self.threads = keep
            self._set_threads()
        return [{"name": st.name, "op": st.op, "mode": st.mode, "kernel": st.kernel,
                 "ms": float(np.median(ts)) * 1000, "macs": st.macs(plan.env)}
                for (st, _), ts in zip(plan.steps_calls, times)]
