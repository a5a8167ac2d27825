"""Activation-aware ranges: a tensor read only by an activation is quantized for the activation's output.

When x feeds only SiLU (Sigmoid(x) and Mul(x, Sigmoid(x))), hard-swish (Add(x, 3) -> Clip(0, 6)
-> Mul(x, .) -> Div(6), as Paddle and PyTorch export it), hard-sigmoid (the HardSigmoid op, or
Add(x, 3) -> Clip(0, 6) -> Div(6)) or Sigmoid, what matters
is f(x), not x: hard-swish is 0 below -3, HardSigmoid is flat outside [-beta/alpha,
(1-beta)/alpha], SiLU is within 0.003 of 0 below -8. The range of x is chosen to minimise the
expected squared error of f(Q(x)) over the calibration histogram:

    inside [lo, hi]:  s^2 / 12 * f'(x)^2   (uniform rounding error, s = (hi - lo) / 255)
    outside:          (f(clip(x, lo, hi)) - f(x))^2

the same search as the `mse` method (both ends shrunk together, then each end alone),
which it refines: `calibrate` stores it as the `mse` range of such tensors.

Hard-swish inputs keep the plain `mse` range there: the search clips x's negative tail to
the point where the grid's lowest value is above -3, which moves the mean of every later layer
(bias correction only covers weights); on the PP-OCR classifier that cost 2.7 dB of output SQNR
where SiLU gained 1.8 dB on YOLOX.

`flat_bounds` finds where every reader of x is constant beyond a point (hard-swish below -3,
hard-sigmoid outside its ramp, Relu below 0, Clip outside its bounds); `calibrate` stores each
method's ranges again with x's range stopped one step past it (`qparams.clip_to_flat`), as
"METHOD+flat", chosen by name only (calibrate/table.py says why auto does not).
"""
from __future__ import annotations

import numpy as np

from qtool import graph as G


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


AWARE = ("silu", "sigmoid", "hard-sigmoid")  # activations whose input range is fitted to their output

FUNCTIONS = {
    "silu": lambda x: x * _sigmoid(x),
    "sigmoid": _sigmoid,
    "hard-swish": lambda x: x * np.clip(x + 3.0, 0.0, 6.0) / 6.0,
}


def _const(model, name, inits):
    v = G.const_value(model, name, inits)
    return None if v is None or v.size != 1 else float(np.asarray(v).ravel()[0])


def _relu6_gate(add, x, cons, model, inits):
    """Add(x, 3) -> Clip(0, 6) [-> Div(6) or Mul(1/6)]: (nodes, output tensor, divided by 6?) or None."""
    other = add.input[1] if add.input[0] == x else add.input[0]
    if _const(model, other, inits) != 3.0:
        return None
    nxt = cons.get(add.output[0], [])
    if len(nxt) != 1 or nxt[0].op_type != "Clip":
        return None
    clip = nxt[0]
    lo = _const(model, clip.input[1], inits) if len(clip.input) > 1 and clip.input[1] else G.attr(clip, "min")
    hi = _const(model, clip.input[2], inits) if len(clip.input) > 2 and clip.input[2] else G.attr(clip, "max")
    if lo != 0.0 or hi != 6.0:
        return None
    after = cons.get(clip.output[0], [])
    if len(after) == 1 and _is_sixth(after[0], clip.output[0], model, inits):
        return [add, clip, after[0]], after[0].output[0], True
    return [add, clip], clip.output[0], False


def _is_sixth(node, t, model, inits):
    """Div(t, 6) or Mul(t, 1/6)."""
    if node.op_type == "Div" and node.input[0] == t:
        return _const(model, node.input[1], inits) == 6.0
    if node.op_type == "Mul" and t in node.input:
        c = _const(model, node.input[1] if node.input[0] == t else node.input[0], inits)
        return c is not None and abs(c - 1 / 6) < 1e-6
    return False


def _hardswish(x, users, cons, model, inits):
    """x -> Add(3) -> Clip(0, 6) -> [Div(6)] -> Mul(x, .) [-> Div(6)]: x's only readers are the Add and the Mul.
    Returns the chain's nodes (empty when x does not feed a hard-swish)."""
    if sorted(u.op_type for u in users) != ["Add", "Mul"]:
        return []
    add = next(u for u in users if u.op_type == "Add")
    mul = next(u for u in users if u.op_type == "Mul")
    gate = _relu6_gate(add, x, cons, model, inits)
    if gate is None or gate[1] not in mul.input:
        return []
    chain = gate[0] + [mul]
    after = cons.get(mul.output[0], [])
    if not gate[2] and len(after) == 1 and _is_sixth(after[0], mul.output[0], model, inits):
        chain.append(after[0])
    return chain


def _hardsigmoid(x, users, cons, model, inits):
    """x -> Add(3) -> Clip(0, 6) -> Div(6) (PyTorch's hardsigmoid at opsets without the op, Paddle's gates)."""
    if [u.op_type for u in users] != ["Add"]:
        return []
    gate = _relu6_gate(users[0], x, cons, model, inits)
    return gate[0] if gate is not None and gate[2] else []


def activation_chains(model) -> dict:
    """node name -> activation name, for the nodes an exported activation is written with (hard-swish)."""
    cons = G.consumers(model)
    inits = G.initializers(model)
    out = {}
    for x, users in cons.items():
        if x not in inits:
            for n in _hardswish(x, users, cons, model, inits):
                out[n.name] = "hard-swish x * Clip(x + 3, 0, 6) / 6"
            for n in _hardsigmoid(x, users, cons, model, inits):
                out[n.name] = "hard-sigmoid Clip(x + 3, 0, 6) / 6"
    return out


def activation_inputs(model) -> dict:
    """tensor -> (activation name, f) for tensors every reader of which is one activation."""
    cons = G.consumers(model)
    inits = G.initializers(model)
    outputs = G.graph_output_names(model)
    found = {}
    for x, users in cons.items():
        if x in outputs or x in inits:
            continue
        ops = [u.op_type for u in users]
        if ops == ["HardSigmoid"]:
            a, b = float(G.attr(users[0], "alpha", 0.2)), float(G.attr(users[0], "beta", 0.5))
            found[x] = ("hard-sigmoid", lambda v, a=a, b=b: np.clip(a * v + b, 0.0, 1.0))
        elif ops == ["HardSwish"]:
            found[x] = ("hard-swish", FUNCTIONS["hard-swish"])
        elif ops == ["Sigmoid"]:
            found[x] = ("sigmoid", FUNCTIONS["sigmoid"])
        elif sorted(ops) == ["Mul", "Sigmoid"]:
            sig = next(u for u in users if u.op_type == "Sigmoid")
            mul = next(u for u in users if u.op_type == "Mul")
            if sorted(mul.input) == sorted([x, sig.output[0]]):
                found[x] = ("silu", FUNCTIONS["silu"])
        elif _hardswish(x, users, cons, model, inits):
            found[x] = ("hard-swish", FUNCTIONS["hard-swish"])
        elif _hardsigmoid(x, users, cons, model, inits):
            found[x] = ("hard-sigmoid", lambda v: np.clip(v + 3.0, 0.0, 6.0) / 6.0)
    return found


def _flat(node, x, model, inits):
    """(lo, hi) outside which this reader's output does not depend on x (None: no such end), or False."""
    op = node.op_type
    if op == "HardSwish":
        return (-3.0, None)
    if op == "Relu":
        return (0.0, None)
    if op == "HardSigmoid":
        a, b = float(G.attr(node, "alpha", 0.2)), float(G.attr(node, "beta", 0.5))
        return (-b / a, (1.0 - b) / a) if a > 0 else False
    if op == "Clip" and node.input[0] == x:
        lo = _const(model, node.input[1], inits) if len(node.input) > 1 and node.input[1] else G.attr(node, "min")
        hi = _const(model, node.input[2], inits) if len(node.input) > 2 and node.input[2] else G.attr(node, "max")
        return (lo, hi) if lo is not None or hi is not None else False
    return False


def flat_bounds(model) -> dict:
    """tensor -> (lo, hi): beyond lo (below) and hi (above) no reader of the tensor sees a change
    (None: that end is not flat). Readers are the activation ops above or an exported hard-swish /
    hard-sigmoid chain; with several readers, the ends that hold for all of them."""
    cons = G.consumers(model)
    inits = G.initializers(model)
    outputs = G.graph_output_names(model)
    found = {}
    for x, users in cons.items():
        if x in outputs or x in inits or not users:
            continue
        if _hardswish(x, users, cons, model, inits):
            found[x] = (-3.0, None)
            continue
        if _hardsigmoid(x, users, cons, model, inits):
            found[x] = (-3.0, 3.0)
            continue
        ends = [_flat(u, x, model, inits) for u in users]
        if any(e is False for e in ends):
            continue
        lo = None if any(e[0] is None for e in ends) else min(e[0] for e in ends)
        hi = None if any(e[1] is None for e in ends) else max(e[1] for e in ends)
        if lo is not None or hi is not None:
            found[x] = (lo, hi)
    return found


def _cost(c, w, f, df2, lo, hi):
    lo = np.minimum(lo, 0.0)[:, None]
    hi = np.maximum(hi, 0.0)[:, None]
    s2 = ((hi - lo) / 255.0) ** 2
    cc = np.clip(c[None, :], lo, hi)
    err = np.where(cc == c[None, :], s2 / 12.0 * df2[None, :], (f(cc) - f(c)[None, :]) ** 2)
    return (err * w[None, :]).sum(axis=1)


def activation_mse_range(hist, f, steps: int = 100) -> tuple:
    """The [lo, hi] of x minimising the squared error of f(Q(x)) over the histogram."""
    if hist.n == 0:
        return 0.0, 0.0
    nz = hist.counts > 0
    c = np.clip(hist.centers()[nz], hist.min, hist.max)
    w = hist.counts[nz].astype(np.float64)
    eps = 1e-3 * max(hist.width, 1e-6)
    df2 = ((f(c + eps) - f(c - eps)) / (2 * eps)) ** 2
    lo0, hi0 = min(hist.min, 0.0), max(hist.max, 0.0)
    fr = np.linspace(0.02, 1.0, steps)
    k = int(np.argmin(_cost(c, w, f, df2, lo0 * fr, hi0 * fr)))
    lo, hi = lo0 * fr[k], hi0 * fr[k]
    for _ in range(3):
        hi = float((fr * hi0)[int(np.argmin(_cost(c, w, f, df2, np.full(steps, lo), fr * hi0)))])
        if lo0 < 0:
            lo = float((fr * lo0)[int(np.argmin(_cost(c, w, f, df2, fr * lo0, np.full(steps, hi))))])
    return float(max(lo, hist.min) if hist.min < 0 else hist.min), float(min(hi, hist.max) if hist.max > 0 else hist.max)
