"""The checks int8 rules open with, written once. Each returns what the rule goes on with, or a
string: the reason the rule does not apply (the node then runs in fp32, and report() shows it)."""
from __future__ import annotations

from qtool.kernel_params import DeconvGeometry
from qtool.runtime.program import node_attrs

NOT_UINT8 = "its input is not a dequantized uint8 tensor"
AUTO_PADS = ("NOTSET", "VALID", "", "SAME_UPPER", "SAME_LOWER")


def only_reader(c, name, op=None):
    """The one node reading `name` (of type `op` if given), when `name` is not a graph output; else None."""
    cons = c.consumers.get(name, [])
    if name in c.graph_outputs or len(cons) != 1 or (op is not None and cons[0].op_type != op):
        return None
    return cons[0]


def uint8_input(c, node):
    """The dq view (DequantizeLinear of a uint8 tensor) the node's first input is."""
    x = c.views.get(node.input[0])
    return NOT_UINT8 if x is None else x


def image_input(c, node, what: str):
    """uint8_input, of rank 4 (or unknown rank): what a convolution or a pooling window reads.
    `what` names the op in the reason ('rank 3 convolution')."""
    x = uint8_input(c, node)
    if isinstance(x, str):
        return x
    rank = c.vals[x.src].rank
    if rank not in (4, None):
        return f"rank {rank} {what}"
    return x


def auto_pad(at: dict) -> str:
    ap = at.get("auto_pad", b"NOTSET")
    return ap.decode() if isinstance(ap, bytes) else ap


def window_attrs(node):
    """(attributes, auto_pad) of a sliding-window op whose auto_pad the kernels take."""
    at = node_attrs(node)
    ap = auto_pad(at)
    if ap not in AUTO_PADS:
        return f"auto_pad={ap}"
    return at, ap


def plain_output(c, node):
    """c.out_quant for an op that only moves values: no Relu/Clip may follow it."""
    oq = c.out_quant(node.output[0])
    if isinstance(oq, str):
        return oq
    _, _, lo, hi, _ = oq
    if lo != 0 or hi != 255:
        return f"{node.op_type} followed by Relu/Clip"
    return oq


def deconv_geometry(node, kernel, group, phases=True):
    """DeconvGeometry of a 2-D ConvTranspose, or the reason the kernels do not take it (`phases`: the
    int8 kernel's split into output phases must work too)."""
    at = node_attrs(node)
    if at.get("output_shape") is not None:
        return "ConvTranspose with output_shape"
    ap = at.get("auto_pad", b"NOTSET")
    ap = ap.decode() if isinstance(ap, bytes) else ap
    if ap not in ("NOTSET", "", "VALID"):
        return f"ConvTranspose with auto_pad={ap}"
    if any(d != 1 for d in at.get("dilations", [1, 1])):
        return "dilated ConvTranspose"
    strides = tuple(at.get("strides", [1, 1]))
    pads = tuple(at.get("pads", [0, 0, 0, 0])) if ap != "VALID" else (0, 0, 0, 0)
    geometry = DeconvGeometry(strides, pads, tuple(at.get("output_padding", [0, 0])), group)
    if not phases:
        return geometry
    from qtool.kernels.deconv_phases import unsupported
    why = unsupported(kernel, strides, pads)
    return f"ConvTranspose: {why}" if why else geometry
