"""Is the preprocessing what the model was trained with? Two checks calibration makes on the way.

1. The stem's statistics (`stem_fit`, before the calibration pass, images only). A model exported
   with its BatchNormalization unfolded carries, in the first one, the mean and variance each
   channel of the stem had on the training data. Under the right preprocessing a few calibration
   images give about those statistics; under a wrong scale or mean they are off by a large factor.
   Per channel c, q_c = E[(y_c - running_mean_c)^2] / running_var_c is about 1 when they match;
   the fit of one preprocessing is median_c |log q_c| (0 is perfect). Every preset's mean, std and
   colour order is scored the same way on the same decoded pixels (they differ only there), so
   the check can say which one fits, not only that the current one does not. On EfficientNet-Lite0
   (6 images of the ImageNet calibration split): imagenet-torchvision 1.27 (channel variance 3.4x
   the trained one), efficientnet-lite 0.37 (0.70x); on benchmarks/resnet50_builder.py's ResNet-50,
   whose BatchNorm statistics come from inputs normalised as torchvision's: 0.40 against 1.34.

2. The outputs (`OutputWatch`, during the calibration pass, any data): a classifier-shaped first
   output [N, C] where every image gets the same class, or values of a size no trained model's
   logits reach (raw 0-255 pixels into ResNet-50: 68000), or NaN/inf, means the inputs are not
   what the model expects.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import onnx
from onnx import helper

from qtool import graph as G

FIT_IMAGES = 6  # calibration images decoded for the stem check (ResNet-50: 6 x 0.12 GMAC per preset)
FIT_MIN_IMAGES = 4  # fewer readable images than this: no check
MAX_STEM_NODES = 64  # the first BatchNormalization must be this close to the input
FIT_MARGIN = 0.5  # another preprocessing fits better by this much (a factor e^0.5 in q): say so
FIT_BAD = 1.5  # the current preprocessing is this far off (q about 4.5x) with no better one: say so too
HUGE = 1e3  # |value| of a classifier output no trained model's logits reach
ONE_CLASS_MIN = 8  # images needed before "every image is one class" means something


@dataclass
class StemFit:
    bn: str  # the BatchNormalization whose statistics the inputs are compared with
    scores: dict  # preprocessing label -> median |log q|
    ratios: dict  # preprocessing label -> exp(median log q): how far off, as a factor
    current: str  # label of the preprocessing in use
    images: int
    assumed: bool = False  # the preprocessing in use was assumed, not given
    alike: dict = field(default_factory=dict)  # label -> how much else (layout, resize) it shares with the current

    def best(self) -> str:
        """The best fit; among near-equal fits (efficientnet-lite and ppocr-cls normalise almost alike)
        the preset most like the current one in everything else."""
        top = min(self.scores.values())
        return min(self.scores, key=lambda k: (self.scores[k] > top + 0.05, -self.alike.get(k, 0), self.scores[k]))

    def warning(self) -> str | None:
        """One line when the preprocessing in use is clearly not what the stem was trained with."""
        cur, best = self.scores[self.current], self.best()
        what = "assumed preprocessing" if self.assumed else "preprocessing"
        if best != self.current and self.scores[best] <= cur - FIT_MARGIN:
            return (f"the {what} ({self.current}) may be wrong for this model: on {self.images} calibration "
                    f"images the stem's channels reach {self.ratios[self.current]:.2g}x the variance its first "
                    f"BatchNormalization ({self.bn}) was trained with, and {self.ratios[best]:.2g}x with {best}'s "
                    f"normalisation; pass --config {best} if the model was trained that way")
        if cur > FIT_BAD:
            return (f"the {what} ({self.current}) may be wrong for this model: on {self.images} calibration "
                    f"images the stem's channels reach {self.ratios[self.current]:.2g}x the variance its first "
                    f"BatchNormalization ({self.bn}) was trained with, and no preset fits better; pass the "
                    f"preprocessing it was trained with as --config FILE")
        return None


def first_batchnorm(model: onnx.ModelProto, input_name: str):
    """(the first BatchNormalization fed from `input_name`, the nodes computing its input) or None
    when there is none within MAX_STEM_NODES nodes of the input."""
    producers = G.producers(model)
    for node in model.graph.node[:MAX_STEM_NODES * 4]:
        if node.op_type != "BatchNormalization":
            continue
        needed, stack, reaches_input = {}, [node.input[0]], False
        while stack:
            t = stack.pop()
            if t == input_name:
                reaches_input = True
            p = producers.get(t)
            if p is None or id(p) in needed:
                continue
            needed[id(p)] = p
            if len(needed) > MAX_STEM_NODES:
                return None
            stack.extend(i for i in p.input if i)
        if reaches_input:
            order = {id(n): k for k, n in enumerate(model.graph.node)}
            return node, sorted(needed.values(), key=lambda n: order[id(n)])
        return None
    return None


def _stem_model(model: onnx.ModelProto, input_name: str, nodes: list, output: str) -> onnx.ModelProto:
    used = {i for n in nodes for i in n.input}
    inp = next(i for i in model.graph.input if i.name == input_name)
    g = helper.make_graph(nodes, "stem", [inp], [helper.make_empty_tensor_value_info(output)],
                          [t for t in model.graph.initializer if t.name in used])
    m = helper.make_model(g, opset_imports=model.opset_import)
    m.ir_version = model.ir_version
    return m


def candidates(cfg, presets: dict) -> dict:
    """label -> (colour, mean, std): the preprocessing in use and every preset of the same channel count."""
    out = {}
    for name, p in presets.items():
        if (p.color == "GRAY") == (cfg.color == "GRAY"):
            out.setdefault((p.color, tuple(p.mean), tuple(p.std)), name)
    return {label: key for key, label in out.items()}


def stem_fit(model: onnx.ModelProto, input_name: str, files: list, cfg, current: str,
             threads: int = 1, assumed: bool = False) -> StemFit | None:
    """Score the preprocessing in use (`cfg`, called `current`) and every preset's normalisation
    against the first BatchNormalization's statistics on a few of `files`; None when the model has
    no such BatchNormalization near its input or no image could be read."""
    from qtool.data.config import load_config, preset_names
    from qtool.data.images import BadImage, load_image
    from qtool.ortsession import session

    found = first_batchnorm(model, input_name)
    if found is None or not files:
        return None
    bn, nodes = found
    inits = G.initializers(model)
    if bn.input[3] not in inits or bn.input[4] not in inits:
        return None
    mean = onnx.numpy_helper.to_array(inits[bn.input[3]]).astype(np.float64).reshape(-1)
    var = onnx.numpy_helper.to_array(inits[bn.input[4]]).astype(np.float64).reshape(-1) + G.attr(bn, "epsilon", 1e-5)
    raw_cfg = replace(cfg, color="RGB" if cfg.color != "GRAY" else "GRAY", mean=(0.0,), std=(1.0,))
    step = max(1, len(files) // FIT_IMAGES)
    pixels = []
    for f in files[::step][:FIT_IMAGES]:
        try:
            pixels.append(load_image(f, raw_cfg))
        except BadImage:
            continue
    pixels = [p for p in pixels if p.shape == pixels[0].shape]  # (images kept at their own sizes: the first size's)
    if len(pixels) < min(FIT_MIN_IMAGES, len(files)) or len(pixels) < 2:
        return None
    x0 = np.concatenate(pixels)
    cax = 1 if cfg.layout == "NCHW" else 3
    presets = {n: load_config(n) for n in preset_names()}
    options = {current: (cfg.color, tuple(cfg.mean), tuple(cfg.std))}
    for label, key in candidates(cfg, presets).items():
        if key not in options.values():
            options[label] = key
    alike = {k: (presets[k].layout == cfg.layout) + (presets[k].resize == cfg.resize) for k in options if k in presets}
    sess = session(_stem_model(model, input_name, nodes, bn.input[0]), threads)
    vi = next(i for i in model.graph.input if i.name == input_name)
    fixed = G.input_dims(vi)[0]
    dtype = np.float16 if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 else np.float32
    chunk = fixed if isinstance(fixed, int) and fixed > 0 else len(x0)  # a fixed batch takes whole batches only
    if chunk > len(x0):
        return None
    scores, ratios = {}, {}
    shape = [1, 1, 1, 1]
    shape[cax] = -1
    for label, (color, m, s) in options.items():
        x = np.flip(x0, axis=cax) if color == "BGR" else x0
        x = ((x - np.reshape(m, shape)) / np.reshape(s, shape)).astype(dtype)
        y = np.concatenate([sess.run(None, {input_name: x[a:a + chunk]})[0]
                            for a in range(0, len(x) - chunk + 1, chunk)])
        if y.ndim < 2 or y.shape[1] != len(mean):
            return None
        # the squared deviations in place, summed with float64 accumulators: a float64 copy of the
        # stem's output per preset (6 x 64 x 112 x 112 on ResNet-50) took 1 of the check's 2 s
        y = y.astype(np.float32, copy=False) - mean.astype(np.float32).reshape((1, -1) + (1,) * (y.ndim - 2))
        np.square(y, out=y)
        spread = y.sum(axis=tuple(a for a in range(y.ndim) if a != 1), dtype=np.float64) / (y.size // len(mean))
        logq = np.log(np.maximum(spread / var, 1e-30))
        scores[label] = float(np.median(np.abs(logq)))
        ratios[label] = float(np.exp(np.median(logq)))
    return StemFit(bn.name or bn.output[0], scores, ratios, current, len(pixels), assumed, alike)


@dataclass
class OutputWatch:
    """The first model output of every calibration sample, summarised as it streams: per sample its
    top-1 class (classifier outputs [N, C]), overall the largest |value| and whether all were finite."""
    name: str
    top1: dict = field(default_factory=dict)  # sample index -> class
    max_abs: float = 0.0
    finite: bool = True
    classes: int = 0

    def observe(self, y: np.ndarray, first: int) -> None:
        y = np.asarray(y)
        if y.size == 0:
            return
        fin = np.isfinite(y)
        self.finite = self.finite and bool(fin.all())
        if fin.any():
            self.max_abs = max(self.max_abs, float(np.abs(y[fin]).max()))
        if y.ndim == 2 and y.shape[1] > 1:
            self.classes = y.shape[1]
            for k, c in enumerate(np.nan_to_num(y).argmax(1)):
                self.top1[first + k] = int(c)

    def merge(self, other: "OutputWatch") -> None:
        self.top1.update(other.top1)
        self.max_abs = max(self.max_abs, other.max_abs)
        self.finite = self.finite and other.finite
        self.classes = self.classes or other.classes

    def summary(self) -> dict:
        """What the calibration pass saw of the output (the manifest keeps it)."""
        d = {"output": self.name, "max_abs": self.max_abs, "finite": self.finite}
        if self.top1:
            d.update(samples=len(self.top1), distinct_top1=len(set(self.top1.values())),
                     largest_class_share=max(np.bincount(list(self.top1.values()))) / len(self.top1))
        return d

    def warning(self, nan_by_design: bool = False) -> str | None:
        """One line when the outputs look degenerate, else None. `nan_by_design`: the output masks
        entries with NaN/inf (graph.unmasked), so those say nothing of the preprocessing."""
        problems = []
        if not self.finite and not nan_by_design:
            problems.append("NaN or infinite values")
        n = len(self.top1)
        if self.classes:
            if self.max_abs > HUGE:
                problems.append(f"values up to {self.max_abs:.4g} (a trained classifier's logits stay far below {HUGE:g})")
            if n >= ONE_CLASS_MIN and self.classes >= 10:
                counts = np.bincount(list(self.top1.values()), minlength=self.classes)
                if counts.max() >= 0.9 * n:
                    problems.append(f"{counts.max()} of the {n} images get the same class ({int(counts.argmax())})")
        if not problems:
            return None
        return (f"the fp32 model's output '{self.name}' looks degenerate on the calibration data: {'; '.join(problems)}; "
                f"the preprocessing is probably not what the model was trained with (see --config)")
