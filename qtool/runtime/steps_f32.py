"""float32 steps on the native transformer kernels (qtool.kernels.f32): LayerNormalization (the op, or
its decomposed ReduceMean/Sub/Pow/Sqrt/Div chain fused at compile time, lower/fp32_fused.py), Softmax
over the last axis, and the erf GELU chain (Div/Mul -> Erf -> Add -> Mul -> Mul) or a lone Erf.

They write into the plan's buffers. The bound call runs the kernel pre-bound to the input buffer
when the input is still the array it was bound to (a producer with a plan buffer); a numpy producer
returns a new array each run, which goes through the checked call.
Fidelity: GELU and Erf give numpy's fp32 ops' bits (the same float32 operations in the same order);
LayerNorm and Softmax differ from numpy's in the order of their float32 sums (about 1e-6 relative)
and Softmax's exp is within 2 ulp of expf."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool.runtime.steps import Step


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
        i, y, x0 = self.ins[0], out[0], env[self.ins[0]]
        fast = self.bound(x0, y) if x0.dtype == np.float32 and x0.flags.c_contiguous else None
        call = self.call

        def step():
            x = env[i]
            if x is x0 and fast is not None:
                fast()
                return
            if x.dtype != np.float32 or not x.flags.c_contiguous:
                x = np.ascontiguousarray(x, np.float32)
            call(x, y)
        return step


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


class SoftmaxStep(F32Step):
    def __init__(self, name, F, x, y, reason):
        super().__init__(name, "Softmax", F, x, y, reason)

    def call(self, x, out):
        self.F.softmax(x, out=out)

    def bound(self, x, out):
        return self.F.bind_softmax(x, out)


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
