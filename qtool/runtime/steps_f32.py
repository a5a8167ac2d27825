"""float32 steps on the native transformer kernels (qtool.kernels.f32): LayerNormalization (the op, or
its decomposed ReduceMean/Sub/Pow/Sqrt/Div chain fused at compile time, lower/fp32_fused.py), Softmax
over the last axis, and the erf GELU chain (Div/Mul -> Erf -> Add -> Mul -> Mul) or a lone Erf; a
ConvTranspose with constant weights (NCHW, packed at load).

They write into the plan's buffers. The bound call runs the kernel pre-bound to the input buffer
when the input is still the array it was bound to (a producer with a plan buffer); a numpy producer
returns a new array each run, which goes through the checked call.
Fidelity: GELU and Erf give numpy's fp32 ops' bits (the same float32 operations in the same order);
LayerNorm and Softmax differ from numpy's in the order of their float32 sums (about 1e-6 relative)
and Softmax's exp is within 2 ulp of expf."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool.runtime.steps import Step, guarded


def _plain(*arrays) -> bool:
    return all(a is None or (a.dtype == np.float32 and a.flags.c_contiguous) for a in arrays)


class F32Step(Step):
    """One native float32 kernel, input 0 -> output 0, same shape."""
    mode = "fp32"
    uses_out = True

    def __init__(self, name, op, F, x, y, reason):
        super().__init__(name, op, [x], [y])
        self.F, self.reason = F, reason
        self.kernel = "native f32"

    def call(self, x, out):
        raise NotImplementedError

    def bound(self, x, out):
        """The kernel's bind_* partial on these buffers."""
        raise NotImplementedError

    def run(self, env, out):
        x = np.ascontiguousarray(env[self.ins[0]], np.float32)
        y = out[0] if out else np.empty(x.shape, np.float32)
        self.call(x, y)
        env[self.outs[0]] = y

    def bind(self, env, out):
        if out is None:
            return super().bind(env, out)
        x0 = env[self.ins[0]]
        return guarded(env, self.ins, [x0], self.bound(x0, out[0]) if _plain(x0) else None, super().bind(env, out))


@dataclass(frozen=True)
class Affine:
    """LayerNorm's epsilon and its optional scale/bias over the last axis (float32 rows)."""
    eps: float
    gamma: np.ndarray | None
    beta: np.ndarray | None


class LayerNormStep(F32Step):
    def __init__(self, name, F, x, y, affine: Affine, reason):
        super().__init__(name, "LayerNormalization", F, x, y, reason)
        self.a = affine

    def call(self, x, out):
        self.F.layernorm(x, self.a.gamma, self.a.beta, self.a.eps, out=out)

    def bound(self, x, out):
        return self.F.bind_layernorm(x, self.a.gamma, self.a.beta, self.a.eps, out)


class AddLayerNormStep(Step):
    """LayerNorm of a + b (the residual sum, one float32 add as the Add node), the sum kept in a second
    output when read elsewhere. Operands of different shapes (a broadcast) are added by numpy first."""
    mode = "fp32"
    uses_out = True

    def __init__(self, name, F, ins, outs, affine: Affine, reason):
        super().__init__(name, "LayerNormalization", list(ins), [o for o in outs if o is not None])
        self.F, self.a, self.reason = F, affine, reason
        self.kernel = "native f32 (+ residual)"

    def run(self, env, out):
        a, b = (np.ascontiguousarray(env[i], np.float32) for i in self.ins)
        shape = np.broadcast_shapes(a.shape, b.shape)
        y = out[0] if out else np.empty(shape, np.float32)
        s = (out[1] if out else np.empty(shape, np.float32)) if len(self.outs) > 1 else None
        if a.shape == b.shape:
            self.F.layernorm(a, self.a.gamma, self.a.beta, self.a.eps, out=y, residual=b, sum_out=s)
        else:
            t = np.add(a, b, out=s)
            self.F.layernorm(np.ascontiguousarray(t), self.a.gamma, self.a.beta, self.a.eps, out=y)
        env[self.outs[0]] = y
        if s is not None:
            env[self.outs[1]] = s

    def bind(self, env, out):
        if out is None:
            return super().bind(env, out)
        a0, b0 = (env[i] for i in self.ins)
        fast = self.F.bind_layernorm(a0, self.a.gamma, self.a.beta, self.a.eps, out[0], residual=b0,
                                     sum_out=out[1] if len(out) > 1 else None) \
            if _plain(a0, b0) and a0.shape == b0.shape else None
        return guarded(env, self.ins, [a0, b0], fast, super().bind(env, out))


class MatMulStep(Step):
    """MatMul of two float32 activations of rank >= 2 (attention's scores and context) on the native
    kernel, transposed views read in place, rows split over the pool; anything else (rank 1, other
    dtypes) by numpy."""
    mode = "fp32"
    uses_out = True

    def __init__(self, name, F, a, b, y, reason):
        super().__init__(name, "MatMul", [a, b], [y])
        self.F, self.reason = F, reason
        self.kernel = "native f32"

    @staticmethod
    def _ok(a, b):
        return a.dtype == np.float32 and b.dtype == np.float32 and a.ndim >= 2 and b.ndim >= 2

    def run(self, env, out):
        a, b = (env[i] for i in self.ins)
        if not self._ok(a, b):
            y = np.matmul(a, b)
            if out:
                np.copyto(out[0], y)
                y = out[0]
        else:
            y = self.F.matmul(a, b, out=out[0] if out else None)
        env[self.outs[0]] = y

    def bind(self, env, out):
        if out is None:
            return super().bind(env, out)
        a0, b0 = (env[i] for i in self.ins)
        fast = self.F.bind_matmul(a0, b0, out[0]) if self._ok(a0, b0) else None
        return guarded(env, self.ins, [a0, b0], fast, super().bind(env, out))


class ConvTransposeStep(Step):
    """float32 ConvTranspose (rank 4, NCHW) on the native kernel, weights packed at load."""
    mode = "fp32"
    uses_out = True

    def __init__(self, name, F, packed, x, y, reason):
        super().__init__(name, "ConvTranspose", [x], [y])
        self.F, self.p, self.reason = F, packed, reason
        self.kernel = "native f32"

    def run(self, env, out):
        x = np.ascontiguousarray(env[self.ins[0]], np.float32)
        env[self.outs[0]] = self.F.conv_transpose(self.p, x, out=out[0] if out else None)

    def bind(self, env, out):
        if out is None:
            return super().bind(env, out)
        x0 = env[self.ins[0]]
        fast = self.F.bind_conv_transpose(self.p, x0, out[0]) if _plain(x0) else None
        return guarded(env, self.ins, [x0], fast, super().bind(env, out))

    def macs(self, env):
        p = self.p
        return int(env[self.ins[0]].size) * (p.cout // int(p.geometry.group)) * p.kh * p.kw


class SoftmaxStep(F32Step):
    def __init__(self, name, F, x, y, reason):
        super().__init__(name, "Softmax", F, x, y, reason)

    def call(self, x, out):
        self.F.softmax(x, out=out)

    def bound(self, x, out):
        return self.F.bind_softmax(x, out)


class ScaledSoftmaxStep(Step):
    """Softmax over the last axis of (x / k or x * k) + mask (either part optional): the scores of an
    attention, scaled and masked, in one pass. ins: [x, mask or None]; scale: (k, divide) or None. A
    mask that broadcasts other than over whole rows (its leading dims x's, then 1s) is added by numpy
    first (the same float32 sums)."""
    mode = "fp32"
    uses_out = True

    def __init__(self, name, F, x, mask, y, scale, reason):
        super().__init__(name, "Softmax", [x, mask], [y])
        self.F, self.scale, self.reason = F, scale, reason
        self.kernel = "native f32"

    def _args(self, env):
        x, m = env[self.ins[0]], None if self.ins[1] is None else env[self.ins[1]]
        if m is not None and self.scale is None and m.size > x.size:  # Add(mask, scores): the same sum
            x, m = m, x
        return x, m

    @staticmethod
    def _rows_mask(x, m):
        """m as whole rows for x (the kernel's broadcast), or None."""
        if m is None or m.dtype != np.float32 or m.ndim > x.ndim or m.shape[-1] != x.shape[-1]:
            return None
        ms = (1,) * (x.ndim - m.ndim) + m.shape
        j = 0
        while j < x.ndim - 1 and ms[j] == x.shape[j]:
            j += 1
        if any(d != 1 for d in ms[j:-1]):
            return None
        return np.ascontiguousarray(m)

    def run(self, env, out):
        x, m = self._args(env)
        x = np.ascontiguousarray(x, np.float32)
        rows = self._rows_mask(x, m) if m is not None else None
        shape = np.broadcast_shapes(x.shape, m.shape) if m is not None else x.shape
        y = out[0] if out else np.empty(shape, np.float32)
        if m is None or rows is not None:
            self.F.softmax(x, out=y, scale=self.scale, mask=rows)
        else:
            k, div = self.scale or (None, False)
            s = x if k is None else (x / np.float32(k) if div else x * np.float32(k))
            self.F.softmax(np.ascontiguousarray(s + m, np.float32), out=y)
        env[self.outs[0]] = y

    def bind(self, env, out):
        if out is None:
            return super().bind(env, out)
        x0, m0 = self._args(env)
        rows = self._rows_mask(x0, m0) if m0 is not None else None
        fast = self.F.bind_softmax(x0, out[0], self.scale, rows) if _plain(x0) and (m0 is None or rows is m0) else None
        return guarded(env, self.ins, [env[i] if i is not None else None for i in self.ins], fast, super().bind(env, out))


@dataclass(frozen=True)
class GeluConsts:
    """y = (x * (erf(x / k_in or x * k_in) + k_add)) * k_out."""
    k_in: float
    div: bool
    k_add: float
    k_out: float


class GeluStep(F32Step):
    def __init__(self, name, F, x, y, k: GeluConsts, reason):
        super().__init__(name, "Gelu", F, x, y, reason)
        self.k = k

    def call(self, x, out):
        k = self.k
        self.F.gelu_erf(x, k.k_in, k.div, k.k_add, k.k_out, out=out)

    def bound(self, x, out):
        k = self.k
        return self.F.bind_gelu_erf(x, k.k_in, k.div, k.k_add, k.k_out, out)


class ErfStep(F32Step):
    def __init__(self, name, F, x, y, reason):
        super().__init__(name, "Erf", F, x, y, reason)

    def call(self, x, out):
        self.F.erf(x, out=out)

    def bound(self, x, out):
        return self.F.bind_erf(x, out)


class EmbeddingStep(Step):
    """ids -> float32(table[ids]) * scale[ids][..., None]: an int8 embedding table's rows (lower/embedding.py),
    the Cast and the Mul of the nodes it replaces (numpy; negative ids count from the end, as Gather's)."""
    mode = "fp32"
    uses_out = False

    def __init__(self, name, ids, y, table, scale):
        super().__init__(name, "Gather", [ids], [y])
        self.table, self.scale = table, scale.astype(np.float32)
        self.kernel = "numpy"

    def run(self, env, out):
        ids = env[self.ins[0]]
        env[self.outs[0]] = self.table[ids].astype(np.float32) * self.scale[ids][..., None]
