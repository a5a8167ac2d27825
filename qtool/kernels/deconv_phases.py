"""A ConvTranspose as one ordinary convolution per output phase (the arithmetic only).

Output o = i * s - pad + k takes input i through tap k, so the outputs with o mod s = p see only the
taps k = r + s * t, r = (p + pad) mod s, and read input i = j + q - t for output o = p + s * j
(q = (p + pad - r) / s). Flipping those taps (u = T - 1 - t) makes it a stride-1 correlation
reading input j - (T - 1 - q) + u: a convolution with top padding T - 1 - q. Per axis:
    T = len(range(r, K, s)) taps, pad_before = T - 1 - q
A phase has no taps when K < s, and a negative pad when pad >= K (about); neither is done here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AxisPhase:
    phase: int   # p: the outputs p, p + s, p + 2s, ...
    first: int   # r: the first kernel tap they see
    taps: int    # T
    pad: int     # the stride-1 convolution's padding before the input


def axis_phases(k: int, s: int, pad: int) -> list[AxisPhase]:
    out = []
    for p in range(s):
        r = (p + pad) % s
        t = len(range(r, k, s))
        out.append(AxisPhase(p, r, t, t - 1 - (p + pad - r) // s))
    return out


def unsupported(kernel, strides, pads) -> str | None:
    """Why a ConvTranspose of this geometry cannot be split into phases, or None."""
    for k, s, pb in zip(kernel, strides, pads[:2]):
        for a in axis_phases(k, s, pb):
            if a.taps == 0:
                return f"kernel {k} smaller than stride {s}"
            if a.pad < 0:
                return f"padding {pb} too large for kernel {k} at stride {s}"
    return None


def phase_weights(w: np.ndarray, group: int, ph: AxisPhase, pw: AxisPhase, strides) -> np.ndarray:
    """The phase's convolution weight, OIHW [Cout, Cin/group, T_h, T_w], from ConvTranspose's
    [Cin, Cout/group, KH, KW]: the taps first + s * t, flipped."""
    cin, cout_g, kh, kw = w.shape
    wg = w.reshape(group, cin // group, cout_g, kh, kw)[:, :, :, ph.first::strides[0], pw.first::strides[1]]
    sub = wg[:, :, :, ::-1, ::-1].transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(sub.reshape(group * cout_g, cin // group, ph.taps, pw.taps))


def deconv_out_hw(h: int, w: int, kernel, strides, pads, output_padding) -> tuple[int, int]:
    pt, pl, pb, pr = pads
    oh = (h - 1) * strides[0] + kernel[0] - pt - pb + output_padding[0]
    ow = (w - 1) * strides[1] + kernel[1] - pl - pr + output_padding[1]
    if oh < 1 or ow < 1:
        raise ValueError(f"ConvTranspose output would be empty: input {h}x{w}, kernel {kernel}, strides {strides}, "
                         f"pads {pads}, output_padding {output_padding}")
    return oh, ow
