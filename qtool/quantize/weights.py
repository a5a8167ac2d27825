"""Weight and bias quantization for one layer, with empirical bias correction.

Per-channel int8 rounding shifts each output channel's mean by dW . E[x]
(dW = dequantized minus float weight, E[x] the per-channel mean of the layer's input
over the calibration images). Subtracting that shift from the bias removes the
systematic part of the rounding error: Nagel et al., "Data-Free Quantization Through
Weight Equalization and Bias Correction" (2019), the empirical variant.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool import qparams as Q
from qtool.quantize import encoding
from qtool.quantize.rounding import round_weights


@dataclass
class QuantizedWeight:
    q: np.ndarray  # int8
    scale: np.ndarray  # float32 per output channel
    axis: int
    bias: np.ndarray | None  # float32, corrected
    weight_sqnr_db: float


def _expected_input_per_weight(w_shape, axis, mean_x, op_type, groups):
    """E[x] broadcast to the weight's shape: which input channel each weight multiplies."""
    if op_type == "Conv":
        cout, cin_g = w_shape[0], w_shape[1]
        g = np.arange(cout) // (cout // groups)
        idx = g[:, None] * cin_g + np.arange(cin_g)[None, :]  # [Cout, Cin_g]
        e = np.asarray(mean_x, np.float64)[idx]
        return e.reshape(e.shape + (1,) * (len(w_shape) - 2))
    if op_type == "ConvTranspose":  # W [Cin, Cout, k...] (group 1: rules/conv.py)
        e = np.asarray(mean_x, np.float64)
        return e.reshape((len(e),) + (1,) * (len(w_shape) - 1))
    # Gemm/MatMul: W is [K, N] (axis 1 = output) or [N, K] (axis 0 = output)
    m = np.asarray(mean_x, np.float64)
    return m[:, None] if axis == 1 else m[None, :]


BIAS_HEADROOM = 2.0 ** 30  # an int32 bias stays within half the int32 range


@dataclass(frozen=True)
class WeightLayer:
    """One layer's weight as it is quantized: the weight, its output channels' axis, its bias, and what the
    bias correction needs (the op, its groups, `mean_x`: E[x] per input channel, None: not corrected)."""
    w: np.ndarray
    axis: int
    bias: np.ndarray | None
    mean_x: object
    op_type: str
    groups: int = 1
    # how many of W's taps (per input channel) one output value reads, as a share of all of them: 1, but
    # 1 / prod(strides) on average for a ConvTranspose, whose output pixels each read one stride phase
    taps_per_output: float = 1.0


@dataclass(frozen=True)
class WeightRounding:
    """How a layer's weights are rounded. `hessian` ([G, K, K] input covariance, rounding.py): round each
    weight down or up to lower the layer's output error instead of to the nearest step.
    `s_in`: the input's activation scale. With it, a channel whose weights are almost zero
    (a dead channel: max |w| ~ 1e-7) gets a larger weight scale, enough that bias / (s_in * s_w)
    fits in int32 with room to spare; otherwise the int32 bias saturates (ONNX Runtime even
    wraps it around). Those weights round to 0 either way.
    `partners` (encoding.pair_partners): make the weights pair-safe for ONNX Runtime's int16 pair
    sums (encoding.py); each channel's scale is then chosen by the same error (`scale`: that
    choice, made already, pair_safe_scale)."""
    correct_bias: bool = True
    s_in: float | None = None
    hessian: np.ndarray | None = None
    partners: np.ndarray | None = None
    w_max: int = Q.W_MAX
    scale: np.ndarray | None = None


def quantize_weight(layer: WeightLayer, how: WeightRounding) -> QuantizedWeight:
    """The layer's int8 weights, per-channel scales and corrected bias, rounded as `how` says."""
    w, axis = layer.w, layer.axis
    if how.partners is None:
        scale = Q.weight_scales(w, axis, how.w_max)
    else:
        scale = how.scale if how.scale is not None else pair_safe_scale(w, axis, how.partners, how.hessian)
    q, corrected = _round_and_correct(layer, scale, how)
    if how.s_in is not None and corrected is not None:
        floor = (np.abs(corrected.astype(np.float64)) / (float(how.s_in) * BIAS_HEADROOM)).astype(np.float32)
        if (floor > scale).any():
            scale = np.maximum(scale, floor).astype(np.float32)
            q, corrected = _round_and_correct(layer, scale, how)
    dw = Q.dequantize_weight(q, scale, axis).astype(np.float64) - w.astype(np.float64)
    err = float(np.sum(dw ** 2))
    sqnr = float(10 * np.log10(np.sum(w.astype(np.float64) ** 2) / err)) if err > 0 else float("inf")
    return QuantizedWeight(q, scale, axis, corrected, sqnr)


def pair_safe_scale(w: np.ndarray, axis: int, partners: np.ndarray, hessian: np.ndarray | None = None) -> np.ndarray:
    """Per output channel, the scale pair-safe weights get (encoding.pair_safe_scales)."""
    return encoding.pair_safe_scales(_rows(w, axis), partners, hessian)[1]


def _rows(w, axis):
    """[C, K]: one row per output channel, in the order qtool rounds (and pair_partners indexes)."""
    return np.moveaxis(np.asarray(w), axis, 0).reshape(w.shape[axis], -1)


def _round_and_correct(layer: WeightLayer, scale, how: WeightRounding):
    """int8 weights at `scale`, and the bias corrected for their rounding (None if no bias)."""
    w, axis, bias, mean_x = layer.w, layer.axis, layer.bias, layer.mean_x
    if how.partners is not None:
        q = round_weights(w, scale, axis, how.hessian, partners=how.partners)
    elif how.hessian is None:
        q = Q.quantize_weight(w, scale, axis, how.w_max)
    else:
        q = round_weights(w, scale, axis, how.hessian, w_max=how.w_max)
    cout = w.shape[axis]
    if how.correct_bias and mean_x is not None:
        dw = Q.dequantize_weight(q, scale, axis).astype(np.float64) - w.astype(np.float64)
        e = _expected_input_per_weight(w.shape, axis, mean_x, layer.op_type, layer.groups)
        if e.size and np.broadcast_shapes(e.shape, dw.shape) == dw.shape:
            shift = np.sum(dw * e, axis=tuple(k for k in range(dw.ndim) if k != axis)) * layer.taps_per_output
            bias = (np.zeros(cout) if bias is None else bias.astype(np.float64)) - shift
    return q, None if bias is None else np.asarray(bias, np.float32).ravel()
