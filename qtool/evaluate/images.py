"""The loop over a folder of images (with the calibration preprocessing): every output of int8 against fp32,
and where the first output is a classifier's, its logits kept for labels (accuracy) and top-5."""
from __future__ import annotations

import os
import warnings

import numpy as np
from tqdm import tqdm

from qtool import graph as G
from qtool.data.config import config_from_any
from qtool.data.images import list_images
from qtool.data.sources import ImageData
from qtool.evaluate.batching import batch_for_memory
from qtool.evaluate.exact import ExactCheck
from qtool.evaluate.kinds import classifier
from qtool.evaluate.options import EvalOptions
from qtool.evaluate.meaning import output_meanings
from qtool.evaluate.runs import Engines, Outputs
from qtool.evaluate.stats import OutputStats, headline
from qtool.evaluate.timing import latency_ms, ort_latency
from qtool.evaluate.where import engines_at
from qtool.labels import labels_from_file, labels_from_folders
from qtool.modelio import check_pair, load_model, model_bytes
from qtool.ortsession import session

IMAGE_BATCH = 16  # images per run, fewer where one image's activations are large (batching.batch_for_memory)
VARIED_SIZES = ("limit", "height", "none")  # resize modes that keep each image's own size (or width)


def evaluate(fp32_path: str, int8_path: str, data: str, options: EvalOptions = EvalOptions(),
             files: list | None = None, show_progress: bool = True) -> dict:
    """The images in `data` (or `files` of it) through both models; `options.check`: also run the exact int8
    arithmetic on the first CHECK_SAMPLES images and compare it with ONNX Runtime's int8 output
    (res["runtime_check"])."""
    fp32 = load_model(fp32_path)
    alone = G.samples_interact(load_model(int8_path, check=False))
    check_pair(fp32_path, int8_path)
    src = _source(fp32, fp32_path, data, options, files, alone)
    y_true = labels_from_file(options.labels, src.files) if options.labels else labels_from_folders(data, src.files)
    # images of many sizes (a text detector's, --config ppocr-det): each ORT arena grew for every new size
    # (PP-OCR server det, 30 photos: 3.3 GB of the 6.9 GB peak); memory goes back after each run there
    varied = getattr(src, "cfg", None) is not None and getattr(src.cfg, "resize", "") in VARIED_SIZES
    sf = session(fp32_path, options.threads, arena=not varied)
    sq = session(int8_path, options.threads, arena=not varied)
    native = None
    if options.runtime in ("native", "both"):
        from qtool.runtime import NativeSession
        native = NativeSession(int8_path, threads=options.threads)
    exact = ExactCheck(int8_path, options.threads, native=native) if options.check else None
    run = _Pass(sf, sq, output_meanings(fp32, [o.name for o in sf.get_outputs()], options.task), native, exact)
    label_of = dict(zip(src.files, y_true)) if y_true is not None else {}
    fixed = getattr(src, "fixed_batch", None)
    engines = Engines(os.path.abspath(fp32_path), os.path.abspath(int8_path), options.threads, not varied,
                      tuple(run.out_names), native=native is not None)
    batches = ((names, feeds, exact is not None and exact.wants(feeds, len(names))) for names, feeds in src.batches())
    with tqdm(total=len(src), unit="img", desc="eval", disable=not show_progress, leave=False) as bar, \
            engines_at(options.ray, engines, (sf, sq, native, exact.session if exact else None)) as where:
        for names, feeds, outs in where.outputs(batches):
            run.add(names, feeds, outs, label_of, fixed)
            bar.update(len(names))
    if not run.truth and fixed:
        from qtool.errors import QtoolError
        raise QtoolError(f"{data}: {src.left_out} images, but the model's batch is fixed at {src.fixed_batch}: "
                         f"give at least {src.fixed_batch}")
    res = run.figures(src, fp32_path, int8_path)
    if options.latency and run.sample is not None:
        res["latency_ms"] = ort_latency(sf, sq, run.sample)
        if native is not None:
            res["latency_ms"]["native_int8"] = latency_ms(lambda x: native.run(None, x), run.sample)
    return res


def _source(fp32, fp32_path: str, data: str, options: EvalOptions, files: list | None,
            alone: bool = False) -> ImageData:
    """The images in batches of IMAGE_BATCH, or fewer where one image's activations are large (16 photos of
    a 640x480 text detector at once: two ORT arenas and the runtime's plan held 16 images' activations each,
    eval at 3.3 GB), sized as a folder of tensors is."""
    cfg = None if options.config is None else config_from_any(options.config)  # None: the model's metadata
    files = list_images(data) if files is None else files
    src = ImageData(data, cfg, fp32, fp32_path, batch=1 if alone else IMAGE_BATCH, limit=options.limit, files=files)
    if not alone and not getattr(src, "fixed_batch", None) and len(src):
        with warnings.catch_warnings():  # (an unreadable image is warned of once, by the run itself)
            warnings.simplefilter("ignore")
            probe = ImageData(data, cfg, fp32, fp32_path, batch=1, files=src.files[:8])
            first = next(iter(probe.batches()), (None, None))[1]
        fit = batch_for_memory(fp32, first, IMAGE_BATCH) if first else IMAGE_BATCH
        if fit < IMAGE_BATCH:
            src = ImageData(data, cfg, fp32, fp32_path, batch=fit, limit=options.limit, files=files)
    return src


class _Pass:
    """What one pass over the images keeps: each output's figures (and the native runtime's against each model
    on the first output), a classifier's logits for labels and top-5, the labels, and one sample to time."""

    def __init__(self, sf, sq, meanings: dict, native, exact):
        """`meanings`: output name -> meaning.Meaning (what the graph and --task say each output is)."""
        self.sf, self.sq, self.native, self.exact = sf, sq, native, exact
        self.out_names = [o.name for o in sf.get_outputs()]
        self.out_name = self.out_names[0]
        self.stats = {n: OutputStats(n, meaning=meanings[n]) for n in self.out_names}
        self.native_stats = {k: OutputStats(self.out_name, meaning=meanings[self.out_name]) for k in ("fp32", "int8")}
        self.rows = {"fp32": [], "int8": []}  # a classifier's logits, for labels and top-5
        self.truth: list = []
        self.sample = None

    def add(self, names: list, feeds: dict, outs: Outputs, label_of: dict, fixed_batch) -> None:
        """One batch's outputs (runs.py: computed here or by a worker), in the batches' order."""
        for name, u, v in zip(self.out_names, outs.fp32, outs.int8):
            self.stats[name].add(u, v, len(names))
        a, b = outs.fp32[0], outs.int8[0]
        if self.exact is not None and outs.exact is not None:
            self.exact.take(outs.exact, [b])
        if self._classes():
            self.rows["fp32"].append(a)
            self.rows["int8"].append(b)
        if self.native is not None:
            c = outs.native
            self.native_stats["fp32"].add(a, c, len(names))
            self.native_stats["int8"].add(b, c, len(names))
        self.truth.extend(label_of.get(n) for n in names)
        if self.sample is None:  # (a model whose batch is fixed takes that batch only)
            self.sample = feeds if fixed_batch else {k: v[:1] for k, v in feeds.items()}

    def _classes(self) -> bool:
        """Whether the first output is judged as a classifier's [N, C] scores (kept for labels and top-5)."""
        first = self.stats[self.out_name].first
        return first is not None and first.task == "classifier" and first.agreement == "class"

    def figures(self, src, fp32_path: str, int8_path: str) -> dict:
        first = headline([self.stats[self.out_name].result()])
        is_classifier = bool(self.rows["fp32"])
        lf = np.concatenate(self.rows["fp32"]) if is_classifier else None
        lq = np.concatenate(self.rows["int8"]) if is_classifier else None
        size = {"fp32": model_bytes(fp32_path), "int8": model_bytes(int8_path)}
        res = {
            "n_images": len(self.truth), "skipped": list(src.skipped), "left_out": getattr(src, "left_out", 0),
            "fp32_model": os.path.abspath(fp32_path), "int8_model": os.path.abspath(int8_path),
            "top5_overlap": classifier.top5_overlap(lf, lq) if is_classifier else None,
            "output_sqnr_db": first["sqnr_db"], "max_abs_error": first["max_abs_error"],
            "outputs": {n: st.result() for n, st in self.stats.items()}, "size_bytes": size,
        }
        for k in ("top1_agreement", "agreement_over", "sequence_agreement", "ctc_text_agreement", "ctc_blank", "encoder"):
            if k in first:
                res[k] = first[k]
        res["size_ratio"] = size["int8"] / size["fp32"]
        if is_classifier:
            res.update(classifier.accuracy(lf, lq, self.truth))
        if self.native is not None:
            vf, vq = self.native_stats["fp32"].result(), self.native_stats["int8"].result()
            res["native"] = {"max_abs_diff_vs_ort_int8": vq["max_abs_error"]}
            if "top1_agreement" in vq:
                res["native"].update(top1_agreement_vs_fp32=vf["top1_agreement"],
                                     top1_agreement_vs_ort_int8=vq["top1_agreement"])
        if self.exact is not None:
            res["runtime_check"] = self.exact.result()
        return res
