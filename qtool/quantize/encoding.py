"""How a layer's int8 weights are encoded for the CPUs that will run the model (`--target`).

The QDQ model is quantized once and then runs wherever its user deploys it. ONNX Runtime is
exact on CPUs with VNNI, AMX or ARM dot products; on x86 without VNNI it adds neighbouring
u8 x s8 products in a saturating int16 (qtool/arithmetic.py), and a model whose weights can
saturate loses accuracy there. Three encodings give the exact int8 result on every ORT path:

  pair-safe  int8 weights in which no same-sign neighbouring pair (ORT's K order) sums past 128
             in magnitude. Same kernels, same speed as plain int8 everywhere; the channels whose
             largest pairs are too big get a larger scale (or, where cheaper in output error, the
             offending pair is trimmed), at some precision cost, measured per layer.
  u8         the same int8 values stored as uint8 with zero point 128: ORT takes its u8 x u8
             kernels, exact everywhere with no precision cost, but slower on CPUs without VNNI.
  s8         plain int8 (the vnni target): exact only where ORT's int8 path is exact.

Depthwise convolutions are exact on every path and stay s8, as do ConvTranspose weights (ORT
dequantizes them and runs the layer in float).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool import qparams as Q
from qtool.arithmetic import PAIR_LIMIT, can_saturate, conv_rows, is_depthwise

S8, PAIR_SAFE, U8, S7 = "s8", "pair-safe", "u8", "s7"
W_MAX_OF = {S7: 63}  # 7-bit weights: no pair of two can pass 126


@dataclass(frozen=True)
class Target:
    name: str
    encoding: str  # the encoding of every layer ORT pairs (depthwise layers are always s8)
    description: str


TARGETS = {
    "portable": Target("portable", PAIR_SAFE, "exact int8 on every ONNX Runtime CPU path (x86 with or without VNNI, "
                                              "AMX, ARM) at full int8 speed: pair-safe int8 weights"),
    "vnni": Target("vnni", S8, "plain int8 weights: exact on CPUs with VNNI, AMX or ARM dot products and on qtool's "
                               "runtime; on x86 without VNNI ONNX Runtime saturates and loses accuracy"),
    "u8-weights": Target("u8-weights", U8, "int8 weights stored as uint8 + 128: exact everywhere without a precision "
                                           "cost, but ONNX Runtime is slower on CPUs without VNNI"),
    "7bit": Target("7bit", S7, "7-bit weights in [-63, 63] (ONNX Runtime's reduce_range): exact everywhere at full "
                               "speed, half the weight precision; the baseline portable improves on"),
}
DEFAULT_TARGET = "portable"


def pair_partners(w_shape, op_type: str, axis: int, group: int = 1) -> np.ndarray | None:
    """For the rows qtool rounds (w moved to output-channel-first and flattened, the order of
    np.moveaxis(w, axis, 0).reshape(C, -1)), the index of each weight's pair partner in ONNX
    Runtime's K order (-1: paired with padding), or None where ORT never pairs (depthwise; ConvTranspose,
    which it dequantizes and runs in float: rules/conv.py)."""
    if op_type == "ConvTranspose":
        return None
    if op_type == "Conv":
        if is_depthwise(w_shape, group):
            return None
        # ORT's K order is arithmetic.conv_rows' (one place defines it): run it on the row indices
        k = int(np.prod(w_shape[1:]))
        row_at = conv_rows(np.arange(k).reshape((1,) + tuple(w_shape[1:])))[0]  # K position -> row index
        partners = np.full(k, -1)
        mates = np.arange(k) ^ 1
        ok = mates < k
        partners[row_at[ok]] = row_at[mates[ok]]
        return partners
    k = int(np.prod(w_shape)) // w_shape[axis]
    return _flat_partners(k)


def _flat_partners(k: int) -> np.ndarray:
    mate = np.arange(k) ^ 1
    return np.where(mate < k, mate, -1)


def _first_of_pairs(partners: np.ndarray) -> np.ndarray:
    k = np.arange(len(partners))
    return k[(partners > k)]


def project(v: np.ndarray, q: np.ndarray, partners: np.ndarray) -> np.ndarray:
    """Integer rows `q` [C, K] made pair-safe: each same-sign pair summing past 128 in magnitude is
    trimmed to exactly 128, the cut split so the two stay closest to their unrounded values `v`."""
    q = np.array(q, np.int64)
    a = _first_of_pairs(partners)
    b = partners[a]
    qa, qb = q[:, a], q[:, b]
    bad = can_saturate(qa, qb)
    if bad.any():
        sign = np.sign(qa)
        ua, ub = np.abs(v[:, a]) , np.abs(v[:, b])
        xa = np.clip(np.rint(ua - (ua + ub - PAIR_LIMIT) / 2), PAIR_LIMIT - Q.W_MAX, Q.W_MAX)
        q[:, a] = np.where(bad, sign * xa, qa)
        q[:, b] = np.where(bad, sign * (PAIR_LIMIT - xa), qb)
    return q


SCALE_STEPS = 9  # candidate scales per channel between the plain scale and the one that needs no trim


def pair_safe_scales(w_rows: np.ndarray, partners: np.ndarray, hessian: np.ndarray | None = None):
    """Per output channel, the scale (and nearest-rounded, trimmed int weights) with the least
    weight error among SCALE_STEPS candidates from max|w|/127 up to the scale at which the
    largest same-sign pair sums to 128 (where nothing needs trimming). The error is dw^T H dw
    with the layer's input covariance `hessian` [G, K, K] when given (channels split evenly into
    G groups), else sum dw^2. -> (q [C, K] int64, scale [C] float32)."""
    w = np.asarray(w_rows, np.float64)
    c, k = w.shape
    s0 = Q.weight_scales(w.astype(np.float32), 0).astype(np.float64)
    a = _first_of_pairs(partners)
    b = partners[a]
    same = np.sign(w[:, a]) * np.sign(w[:, b]) > 0
    top = np.where(same, np.abs(w[:, a] + w[:, b]), 0).max(axis=1, initial=0.0) / s0
    fmax = np.maximum(1.0, top / PAIR_LIMIT * (1 + 1e-6))
    s = s0.astype(np.float32)
    v = w / s.astype(np.float64)[:, None]
    best_q = project(v, np.clip(np.rint(v), -Q.W_MAX, Q.W_MAX), partners)
    best_s = s
    rows = np.flatnonzero(fmax > 1)  # only channels with a pair past the limit have a choice to make
    if len(rows) == 0:
        return best_q, best_s.astype(np.float32)
    g = 1 if hessian is None else hessian.shape[0]
    if g > 1:  # (grouped: each channel reads its group's covariance; score every channel)
        rows = np.arange(c)
    group = rows // (c // g)

    def error(q, s):
        dw = q * s.astype(np.float64)[:, None] - w[rows]
        if hessian is None:
            return (dw ** 2).sum(axis=1)
        if g == 1:
            return (dw @ hessian[0] * dw).sum(axis=1)
        return (np.einsum("rk,rkl->rl", dw, hessian[group]) * dw).sum(axis=1)

    best_e = error(best_q[rows], best_s[rows])
    for t in np.linspace(0.0, 1.0, SCALE_STEPS)[1:]:
        s = (s0[rows] * (1 + (fmax[rows] - 1) * t)).astype(np.float32)
        v = w[rows] / s.astype(np.float64)[:, None]
        q = project(v, np.clip(np.rint(v), -Q.W_MAX, Q.W_MAX), partners)
        e = error(q, s)
        take = e < best_e
        best_q[rows[take]] = q[take]
        best_s[rows[take]] = s[take]
        best_e = np.where(take, e, best_e)
    return best_q, best_s.astype(np.float32)


# portable: the layers that carry little of the model's compute store their weights as uint8 + 128
# where pair-safety costs them precision. ORT's u8 x u8 kernels are slower than its u8 x s8 ones
# (about 2x on x86), so the u8 layers may hold at most U8_SHARE of the model's MACs (their extra
# time stays within about that share), or U8_FLOOR_MACS in all for a model whose whole run is
# microseconds. A classifier's or detector's last Gemm is typically one of them: 0.05 % of
# ResNet-50's MACs; openWakeWord's three Gemms (0.2 MMAC in all) lost 6 dB of output SQNR to pair-safety.
U8_SHARE = 0.02
U8_FLOOR_MACS = 1_000_000
U8_MIN_COST_DB = 0.5  # a layer whose pairs cost less keeps full-speed pair-safe weights


def pair_safe_cost_db(w_rows: np.ndarray, partners: np.ndarray) -> float:
    """How much larger the weight error of pair-safe rows [C, K] (pair_safe_scales, nearest rounding)
    is than plain int8's, in dB: 0 where no pair binds."""
    w = np.asarray(w_rows, np.float64)
    s0 = Q.weight_scales(w.astype(np.float32), 0).astype(np.float64)
    plain = np.clip(np.rint(w / s0[:, None]), -Q.W_MAX, Q.W_MAX) * s0[:, None] - w
    q, s = pair_safe_scales(w, partners)
    safe = q * s.astype(np.float64)[:, None] - w
    e0, e1 = float((plain ** 2).sum()), float((safe ** 2).sum())
    if e1 <= e0:
        return 0.0
    return float("inf") if e0 == 0 else 10 * np.log10(e1 / e0)


def cheap_u8_layers(layers: dict, total_macs: int) -> dict:
    """The layers (name -> (MACs, pair_safe_cost_db)) whose weights portable stores as uint8 + 128:
    the costliest first, while their MACs fit the budget (U8_SHARE of total_macs, at least
    U8_FLOOR_MACS). -> name -> why."""
    budget = max(U8_SHARE * total_macs, U8_FLOOR_MACS)
    used, chosen = 0, {}
    for name, (macs, cost) in sorted(layers.items(), key=lambda kv: (-kv[1][1], kv[1][0], kv[0])):
        if cost < U8_MIN_COST_DB or used + macs > budget:
            continue
        used += macs
        share = 100.0 * macs / total_macs if total_macs else 100.0
        chosen[name] = (f"weights stored as uint8 + 128 (exact on every CPU, slower on some): pair-safe int8 "
                        f"would cost {cost:.1f} dB of weight precision; {macs / 1e6:.3g} MMAC per sample, "
                        f"{share:.2g} % of the model's")
    return chosen


def portable_u8_layers(model, shapes: dict) -> dict:
    """cheap_u8_layers of `model` (a fused graph) for inputs of these shapes (input name -> shape)."""
    from onnx import numpy_helper

    from qtool import graph as G
    from qtool.rules import RULES

    macs = G.layer_macs(model, shapes)
    if not macs:
        return {}
    total = sum(macs.values())
    budget = max(U8_SHARE * total, U8_FLOOR_MACS)
    inits = G.initializers(model)
    costs = {}
    for node in model.graph.node:
        rule = RULES.get(node.op_type)
        if node.name not in macs or macs[node.name] > budget or rule is None:
            continue  # (too big to be stored u8 whatever it costs: no need to measure it)
        spec = rule.weight(node, model)
        if spec is None or node.input[spec[0]] not in inits:
            continue
        widx, axis = spec
        w = numpy_helper.to_array(inits[node.input[widx]]).astype(np.float32)
        partners = pair_partners(w.shape, node.op_type, axis, G.attr(node, "group", 1))
        if partners is not None:
            rows = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
            costs[node.name] = (macs[node.name], pair_safe_cost_db(rows, partners))
    return cheap_u8_layers(costs, total)
