"""Conv (incl. grouped and depthwise) -> one ConvStep; a zero Pad before it folds into its pads.
ConvTranspose -> one DeconvStep (one convolution per output phase, the exact int32 sums)."""
from __future__ import annotations

import numpy as np

from qtool.arithmetic import conv_rows, is_depthwise
from qtool.kernel_params import ConvGeometry
from qtool.runtime import saturating
from qtool.runtime import steps as S
from qtool.runtime.backend import conv_multiplier
from qtool.runtime.fp32_ops import conv_pads
from qtool.runtime.lower.common import deconv_geometry, image_input, window_attrs
from qtool.runtime.program import Entry, QView, node_attrs


def _fold_pad(c, node, x, pads):
    """Pad(0) -> Conv, the Pad read by this Conv alone: the convolution pads instead (its padding
    reads x_zp, a real 0). -> (input view, pads), the Pad's step removed when it folds."""
    pd = c.pads.get(x.src)
    if pd is None or pd[2] != x.zp or len(c.consumers.get(node.input[0], [])) != 1 \
            or sum(len(c.consumers.get(d.output[0], [])) for d in c.consumers.get(x.src, [])) != 1:
        return x, pads
    src, (pt, pl, pb, pr), _, pad_step = pd
    pads = (pads[0] + pt, pads[1] + pl, pads[2] + pb, pads[3] + pr)
    c.steps.remove(pad_step)
    for e in c.entries:
        if e.detail == "pad" and e.node == pad_step.name:
            e.mode, e.detail = "fused", f"into {node.name or 'Conv'}"
    return QView(src, x.scale, x.zp), pads


def _image_and_weight(c, node, axis: int, what: str):
    """(dq view of the image, int8 weight, its scales along `axis`) of a 2-D convolution-like node, or the reason."""
    x = image_input(c, node, what)
    if isinstance(x, str):
        return x
    w = c.weight(node.input[1], axis)
    if isinstance(w, str):
        return w
    if w[0].ndim != 4:
        return f"{w[0].ndim - 2}-D {what} (only 2-D has an int8 kernel)"
    return x, w[0], w[1]


def rule_conv(c, node):
    xw = _image_and_weight(c, node, 0, "convolution")
    if isinstance(xw, str):
        return xw
    x, wq, sw = xw
    wa = window_attrs(node)
    if isinstance(wa, str):
        return wa
    at, ap = wa
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    qnode, qy, lo, hi, fused = oq
    group = at.get("group", 1)
    bias = c.bias(node.input[2] if len(node.input) > 2 else "", x.scale, sw, wq, x.zp)
    mult = conv_multiplier(c.K, x.scale, sw, qy[0])
    pads = tuple(at.get("pads", [0, 0, 0, 0])) if ap != "VALID" else (0, 0, 0, 0)
    x, pads = _fold_pad(c, node, x, pads)
    K = saturating if not is_depthwise(wq.shape, group) and c.saturates(node.input[1], lambda: conv_rows(wq), group) \
        else c.K

    def pack(p4):
        geometry = ConvGeometry(tuple(at.get("strides", [1, 1])), p4, tuple(at.get("dilations", [1, 1])), group)
        return K.pack_conv2d(wq, bias, x_zp=x.zp, multiplier=mult, y_zp=qy[1], lo=lo, hi=hi, geometry=geometry)
    if ap.startswith("SAME"):  # pads depend on the input size: pack per input size, at plan time
        packed = S.SamePadPacker(pack, lambda hw: tuple(conv_pads(at, hw, wq.shape[2:])))
    else:
        packed = pack(pads)
    xs = c.nhwc_input(x.src)
    v = c.emit_q(qnode, nhwc=True, q=qy, rank=4, fused=fused, op_node=node)
    st = S.ConvStep(node.name or "Conv", K, packed, xs, v.slot, wq.shape[1], wq.shape[2], wq.shape[3])
    c.steps.append(st)
    c.entries.append(Entry(node.name or "Conv", "Conv", "int8", st.kernel))
    return None


def rule_conv_transpose(c, node):
    """ConvTranspose(DQ(u8 x), DQ(int8 W [Cin, Cout/group, KH, KW], per Cout along axis 1), DQ(int32
    bias)) -> Q: the exact int32 sums requantized as a convolution's; ONNX Runtime runs it in float
    (dequantize, float ConvTranspose, quantize), so the two may differ by one step where its float
    sum rounds across a half."""
    if not hasattr(c.K, "pack_deconv2d"):
        return "the kernel backend has no ConvTranspose"
    xw = _image_and_weight(c, node, 1, "ConvTranspose")
    if isinstance(xw, str):
        return xw
    x, wq, sw = xw
    if wq.size and wq.min() < -127:
        return "its weight holds -128 (the kernels take symmetric int8)"
    group = node_attrs(node).get("group", 1)
    geometry = deconv_geometry(node, wq.shape[2:], group)
    if isinstance(geometry, str):
        return geometry
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    qnode, qy, lo, hi, fused = oq
    sw = np.tile(sw, group)  # (axis 1 holds Cout / group: output channel g * Cout/group + o has scale o)
    rows = wq.reshape(group, wq.shape[0] // group, wq.shape[1], -1).transpose(0, 2, 1, 3).reshape(len(sw), -1)
    bias = c.bias(node.input[2] if len(node.input) > 2 else "", x.scale, sw, rows, x.zp)
    packed = c.K.pack_deconv2d(wq, bias, x_zp=x.zp, multiplier=conv_multiplier(c.K, x.scale, sw, qy[0]),
                               y_zp=qy[1], lo=lo, hi=hi, geometry=geometry)
    xs = c.nhwc_input(x.src)
    v = c.emit_q(qnode, nhwc=True, q=qy, rank=4, fused=fused, op_node=node)
    st = S.DeconvStep(node.name or "ConvTranspose", c.K, packed, xs, v.slot, wq.shape[0] // group, wq.shape[2], wq.shape[3])
    c.steps.append(st)
    c.entries.append(Entry(node.name or "ConvTranspose", "ConvTranspose", "int8", st.kernel))
    return None


RULES = {"Conv": rule_conv, "ConvTranspose": rule_conv_transpose}
