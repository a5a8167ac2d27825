"""The parameter groups the kernels take (the same in qtool.kernels, its numpy reference and the
runtime's numpy stand-ins): a convolution's geometry, a pooling window, and the requantization of
a two-input elementwise op. Plain frozen values, built once when a model is loaded. (Outside
qtool.kernels, whose import needs the built extension, so that the numpy stand-ins share them.)"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ConvGeometry:
    """Strides, pads (top, left, bottom, right; or (h, w) for both sides), dilations and groups of a
    2-D convolution."""
    strides: tuple = (1, 1)
    pads: tuple = (0, 0, 0, 0)
    dilations: tuple = (1, 1)
    group: int = 1


@dataclass(frozen=True)
class DeconvGeometry:
    """Strides, pads (top, left, bottom, right; or (h, w) for both sides), output_padding (h, w) and
    groups of a 2-D ConvTranspose (dilations 1): OH = (H - 1) * sh + KH - top - bottom + output_padding."""
    strides: tuple = (1, 1)
    pads: tuple = (0, 0, 0, 0)
    output_padding: tuple = (0, 0)
    group: int = 1


@dataclass(frozen=True)
class PoolWindow:
    """A pooling window: kernel (kh, kw), strides, pads (top, left, bottom, right), dilations, ONNX's
    ceil_mode, and whether an average counts the padding."""
    kernel: tuple
    strides: tuple = (1, 1)
    pads: tuple = (0, 0, 0, 0)
    dilations: tuple = (1, 1)
    ceil_mode: bool = False
    count_include_pad: bool = False


@dataclass(frozen=True)
class BinaryQuant:
    """uint8 a (a_scale, a_zp) op uint8 b (b_scale, b_zp) -> uint8 y (y_scale, y_zp), clamped to [lo, hi]."""
    a_scale: float
    a_zp: int
    b_scale: float
    b_zp: int
    y_scale: float
    y_zp: int
    lo: int = 0
    hi: int = 255

    def swapped(self) -> "BinaryQuant":
        """The same op with its inputs exchanged."""
        return replace(self, a_scale=self.b_scale, a_zp=self.b_zp, b_scale=self.a_scale, b_zp=self.a_zp)
