"""`eval`: int8 against fp32 on the same inputs: accuracy, agreement, output error, size, speed.

Labels are optional: every model gets, per output, SQNR (dB) and max abs error; a classifier
output [N, C] gets top-1 agreement; a sequence of distributions [N, T, C] (a CTC recognizer, a
tagger) gets top-1 agreement per position and the share of sequences equal at every position; a
detector-like output [N, R, K] (many rows of a few columns: YOLO's x, y, w, h, objectness, class
scores) gets the agreement of its top-scoring rows. Maps and features (a text detector's
probability map) get no top-1 figure: an argmax over their flattened values means nothing.
Only a classifier's outputs are kept for the whole run (labels, top-5); everything else streams.
Images (with the calibration preprocessing) or tensors (.npy / .npz folders, iterables) both work.
"""
from __future__ import annotations

import os
import time
import warnings

import numpy as np
from tqdm import tqdm

from qtool import graph as G
from qtool.ortsession import session
from qtool.data.config import config_from_any
from qtool.data.sources import ImageData
from qtool.data.images import list_images
from qtool.labels import labels_from_file, labels_from_folders
from qtool.arithmetic import ORT_X86_NOVNNI
from qtool.metrics import (UNIT_ROWS_MIN, _anchor_count, agreement_kind, ctc_blank, ctc_collapse,  # noqa: F401
                           detector_like, is_distribution, is_log_distribution, output_kind)
from qtool.modelio import check_pair, load_model, model_bytes, provenance


def _topk(logits: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-logits, axis=1)[:, :k]


LATENCY_SECONDS = 5.0  # past this, three timed runs do (CRAFT at 960x1280: 5.5 s a run in fp32)


def _latency_ms(run, x, repeats: int = 10, budget_s: float = LATENCY_SECONDS) -> float:
    run(x)
    ts = []
    while len(ts) < repeats and (len(ts) < 3 or sum(ts) < budget_s):
        t = time.perf_counter()
        run(x)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1000


CHECK_SAMPLES = 32  # samples on which ORT's int8 output is compared with the exact int8 arithmetic
CHECK_MIN_DB = 50.0  # below this SQNR between ORT int8 and exact int8, ORT's arithmetic differs (not float noise)
# ... where every compute op is int8. Where some run in float (layers kept fp32), float rounding decides
# which side of a quantization step a value lands on downstream, and the two legitimately differ:
# EfficientNet-Lite0 with 5 layers fp32, 31.7 dB (ORT's own float and int8 paths differ by 29-30 dB
# on any Lite0 model), where saturating int16 pairs cost 9-14 dB (arithmetic.py)
CHECK_MIN_DB_WITH_FLOAT_OPS = 20.0
CHECK_SECONDS = 20.0  # the check stops taking samples once it has spent this long (it always takes one batch)


class ExactCheck:
    """ORT's int8 output against the exact int8 arithmetic (qtool's runtime) on the first samples:
    does the int8 path of this machine's ONNX Runtime compute what the QDQ model defines?"""

    def __init__(self, int8_path: str, threads: int, n: int = CHECK_SAMPLES, native=None):
        """`native`: a NativeSession of the model already made (exact arithmetic) to reuse."""
        self.n, self.rows, self.error = n, {"ort": [], "exact": []}, ""
        self.target = provenance(int8_path).get("target")
        self.session = native
        self.float_ops, self.seconds, self.samples = 0, 0.0, 0
        if native is None:
            try:
                from qtool.runtime import NativeSession
                self.session = NativeSession(int8_path, threads=threads)  # exact int32 sums
            except Exception as e:  # a model the runtime cannot load: say so, do not fail eval
                self._give_up(e)
        if self.session is not None:
            self.float_ops = sum(st.kernel.startswith("numpy") for st in self.session.program.steps)

    def _give_up(self, e: Exception) -> None:
        self.session, self.error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def add(self, feeds: dict, ort_out: list, samples: int | None = None) -> None:
        """A whole batch (a model may take its batch whole only) of `samples` samples (None: axis 0 of
        the feed), until n samples are in."""
        if self.session is None or self.samples >= self.n or self.seconds > CHECK_SECONDS:
            return
        t = time.perf_counter()
        try:
            exact = self.session.run(None, feeds)[0]
            self.seconds += time.perf_counter() - t
        except Exception as e:  # the runtime fails on this model: no check, eval goes on
            self._give_up(e)
            return
        if np.shape(exact) != np.shape(ort_out[0]):  # (a runtime bug to report, not a reason to stop eval)
            self._give_up(ValueError(f"the native runtime wrote shape {list(np.shape(exact))} where ONNX Runtime "
                                     f"wrote {list(np.shape(ort_out[0]))}"))
            return
        # each batch kept in its own shape: samples of a model with free input sizes differ in length
        self.rows["exact"].append(np.asarray(exact, np.float64))
        self.rows["ort"].append(np.asarray(ort_out[0], np.float64))
        # (axis 0 of the feed is not always samples: a tagger's [chars, 1] counted 49 for one sentence)
        self.samples += samples if samples is not None else len(next(iter(feeds.values()))) if feeds else 1

    def result(self) -> dict:
        if self.session is None or not self.rows["ort"]:
            return {"checked": 0, "error": self.error or "no samples"}
        a = np.concatenate([x.ravel() for x in self.rows["exact"]])
        b = np.concatenate([x.ravel() for x in self.rows["ort"]])
        both = np.isfinite(a) & np.isfinite(b)
        if not both.all():  # (NaN where the model masks entries by design: compared where both are finite)
            a, b = a[both], b[both]
        from qtool.metrics import sqnr_db
        from qtool.ort_arithmetic import ort_int8_arithmetic
        db = sqnr_db(a, b) if a.size else float("inf")
        floor = CHECK_MIN_DB_WITH_FLOAT_OPS if self.float_ops else CHECK_MIN_DB
        r = {"checked": self.samples, "sqnr_ort_vs_exact_db": db,
             "max_abs_diff": float(np.abs(a - b).max()) if a.size else 0.0,
             "ort_int8_arithmetic": ort_int8_arithmetic(), "exact": bool(db >= floor), "target": self.target,
             "float_ops": self.float_ops, "min_sqnr_db": floor}
        if all(agreement_kind(x.shape) is not None for x in self.rows["ort"]):
            same = [x.reshape(-1, x.shape[-1]).argmax(1) == y.reshape(-1, y.shape[-1]).argmax(1)
                    for x, y in zip(self.rows["exact"], self.rows["ort"])]
            r["top1_agreement_ort_vs_exact"] = float(np.concatenate(same).mean())
        return r


PAIR_EXACT = ("portable", "u8-weights", "7bit")  # targets exact under the x86-without-VNNI arithmetic


def check_warning(c: dict) -> str | None:
    """The one line `qtool eval` prints when ORT's int8 output is not the exact int8 result, or when that
    could not be checked (qtool's runtime cannot run the model: without the line, "not checked" read as
    "checked, exact")."""
    if c and not c.get("checked") and c.get("error") and c["error"] != "no samples":
        return (f"note: not checked whether ONNX Runtime's int8 output here is the exact int8 result: qtool's "
                f"runtime could not run the model ({c['error'][:200]})")
    if not c or c.get("exact", True) or not c.get("checked"):
        return None
    agree = f"top-1 agreement {c['top1_agreement_ort_vs_exact']:.4f}, " if "top1_agreement_ort_vs_exact" in c else ""
    head = (f"warning: on this CPU ONNX Runtime's int8 output is not the exact int8 result ({agree}SQNR "
            f"{c['sqnr_ort_vs_exact_db']:.1f} dB between the two on {c['checked']} samples)")
    if c.get("ort_int8_arithmetic") == ORT_X86_NOVNNI and c.get("target") not in PAIR_EXACT:
        return (f"{head}: its int8 path here adds weight pairs in a saturating int16 (no VNNI); the figures above "
                f"are what this CPU gives. Fix: `qtool quantize --target portable` (exact on every CPU), or run the "
                f"model on qtool's runtime")
    return (f"{head}, which neither this ONNX Runtime's known arithmetic ({c.get('ort_int8_arithmetic')}) nor the "
            f"model's target ({c.get('target') or 'not a qtool model'}) explains; the figures above are what this "
            f"CPU gives; qtool's runtime gives the exact result")


def evaluate(fp32_path: str, int8_path: str, data: str, config=None, labels: str | None = None,
             limit: int | None = None, files: list | None = None, threads: int = 2, batch: int = 16,
             show_progress: bool = True, runtime: str = "ort", latency: bool = True, check: bool = True) -> dict:
    """`check`: also run the exact int8 arithmetic on the first CHECK_SAMPLES images and compare it
    with ONNX Runtime's int8 output (res["runtime_check"])."""
    fp32 = load_model(fp32_path)
    load_model(int8_path, check=False)
    check_pair(fp32_path, int8_path)
    cfg = None if config is None else config_from_any(config)  # None: the model's metadata, else assumed
    files = list_images(data) if files is None else files
    src = ImageData(data, cfg, fp32, fp32_path, batch=batch, limit=limit, files=files)
    if not getattr(src, "fixed_batch", None) and len(src):
        # 16 photos of a 640x480 text detector at once: two ORT arenas and the runtime's plan held 16 images'
        # activations each (hx8: eval at 3.3 GB on 16 photos); sized as a folder of tensors is
        with warnings.catch_warnings():  # (an unreadable image is warned of once, by the run itself)
            warnings.simplefilter("ignore")
            probe = ImageData(data, cfg, fp32, fp32_path, batch=1, files=src.files[:8])
            first = next(iter(probe.batches()), (None, None))[1]
        fit = batch_for_memory(fp32, first, batch) if first else batch
        if fit < batch:
            src = ImageData(data, cfg, fp32, fp32_path, batch=fit, limit=limit, files=files)
    y_true = None
    if labels:
        y_true = labels_from_file(labels, src.files)
    else:
        y_true = labels_from_folders(data, src.files)
    # images of many sizes (a text detector's, --config ppocr-det): each ORT arena grew for every new size
    # (PP-OCR server det, 30 photos: 3.3 GB of the 6.9 GB peak); memory goes back after each run there
    varied = getattr(src, "cfg", None) is not None and getattr(src.cfg, "resize", "") in VARIED_SIZES
    sf, sq = session(fp32_path, threads, arena=not varied), session(int8_path, threads, arena=not varied)
    native = None
    if runtime in ("native", "both"):
        from qtool.runtime import NativeSession
        native = NativeSession(int8_path, threads=threads)
    exact = ExactCheck(int8_path, threads, native=native) if check else None
    out_name = sf.get_outputs()[0].name
    out_names = [o.name for o in sf.get_outputs()]
    states = recurrent_states(fp32)
    stats = {n: OutputStats(n, state=n in states) for n in out_names}
    native_stats = {"fp32": OutputStats(out_name), "int8": OutputStats(out_name)}  # native vs each
    label_of = dict(zip(src.files, y_true)) if y_true is not None else {}
    rows = {"fp32": [], "int8": []}  # a classifier's logits, for labels and top-5
    truth = []
    sample = None
    with tqdm(total=len(src), unit="img", desc="eval", disable=not show_progress, leave=False) as bar:
        for names, feeds in src.batches():
            outs_f, outs_q = sf.run(out_names, feeds), sq.run(out_names, feeds)
            for name, u, v in zip(out_names, outs_f, outs_q):
                stats[name].add(u, v, len(names))
            a, b = outs_f[0], outs_q[0]
            if exact is not None:
                exact.add(feeds, [b], len(names))
            if agreement_kind(a.shape) == "class":
                rows["fp32"].append(a)
                rows["int8"].append(b)
            if native is not None:
                c = native.run([out_name], feeds)[0]
                native_stats["fp32"].add(a, c, len(names))
                native_stats["int8"].add(b, c, len(names))
            truth.extend(label_of.get(n) for n in names)
            if sample is None:  # (a model whose batch is fixed takes that batch only)
                sample = feeds if getattr(src, "fixed_batch", None) else {k: v[:1] for k, v in feeds.items()}
            bar.update(len(names))
    if not truth and getattr(src, "fixed_batch", None):
        from qtool.errors import QtoolError
        raise QtoolError(f"{data}: {src.left_out} images, but the model's batch is fixed at {src.fixed_batch}: "
                         f"give at least {src.fixed_batch}")
    first = _headline([stats[out_name].result()])
    classifier = bool(rows["fp32"])
    lf = np.concatenate(rows["fp32"]) if classifier else None
    lq = np.concatenate(rows["int8"]) if classifier else None
    res = {
        "n_images": len(truth), "skipped": list(src.skipped), "left_out": getattr(src, "left_out", 0),
        "fp32_model": os.path.abspath(fp32_path), "int8_model": os.path.abspath(int8_path),
        "top5_overlap": float(np.mean([len(set(p) & set(q)) / 5 for p, q in zip(_topk(lf, 5), _topk(lq, 5))]))
        if classifier and lf.shape[1] >= 5 else None,
        "output_sqnr_db": first["sqnr_db"], "max_abs_error": first["max_abs_error"],
        "outputs": {n: st.result() for n, st in stats.items()},
        "size_bytes": {"fp32": _size(fp32_path), "int8": _size(int8_path)},
    }
    for k in ("top1_agreement", "agreement_over", "sequence_agreement", "ctc_text_agreement", "ctc_blank"):
        if k in first:
            res[k] = first[k]
    res["size_ratio"] = res["size_bytes"]["int8"] / res["size_bytes"]["fp32"]
    have = [t is not None for t in truth]
    if any(have) and classifier and lf.shape[1] > 1:
        m = np.array(have)
        yt = np.array([t for t in truth if t is not None])
        res["n_labelled"] = int(m.sum())
        for key, logits in (("fp32", lf), ("int8", lq)):
            top = _topk(logits[m], 5)
            res[key] = {"top1": float((top[:, 0] == yt).mean()), "top5": float((top == yt[:, None]).any(1).mean())}
        res["top1_delta_pt"] = 100 * (res["int8"]["top1"] - res["fp32"]["top1"])
        res["top5_delta_pt"] = 100 * (res["int8"]["top5"] - res["fp32"]["top5"])
    if native is not None:
        vf, vq = native_stats["fp32"].result(), native_stats["int8"].result()
        res["native"] = {"max_abs_diff_vs_ort_int8": vq["max_abs_error"]}
        if "top1_agreement" in vq:
            res["native"].update(top1_agreement_vs_fp32=vf["top1_agreement"], top1_agreement_vs_ort_int8=vq["top1_agreement"])
    if exact is not None:
        res["runtime_check"] = exact.result()
    if latency and sample is not None:
        res["latency_ms"] = {"ort_fp32": _latency_ms(lambda x: sf.run(None, x), sample),
                             "ort_int8": _latency_ms(lambda x: sq.run(None, x), sample)}
        if native is not None:
            res["latency_ms"]["native_int8"] = _latency_ms(lambda x: native.run(None, x), sample)
    return res


class OutputStats:
    """Streaming comparison of one output: SQNR, max abs error, and row/class agreement."""

    def __init__(self, name: str, top_rows=(1, 10, 100), state: bool = False):
        """`state`: a recurrent layer's last hidden or cell state (recurrent_states), vectors and no classes."""
        self.name, self.top_rows, self.state = name, top_rows, state
        self.sig = self.noise = self.maxerr = 0.0
        self.n = 0
        self.kind = None  # what agreement means here: decided on the first batch (output_kind)
        self.layout = None  # a detector head's layout, or None
        self.same = self.positions = self.seq_same = 0
        self.paths: list = []  # per sequence: (fp32's, int8's) top-1 class at each position (int32, small)
        self.rows: dict = {}  # k -> fraction of fp32's top-k rows also in int8's top-k, per sample
        self.row_err: list = []
        self.shape = None
        self.text = False  # strings, compared for equality only
        self.labels = False  # integers (a tagger's ArgMax, a class id): equal or not, per value and per sample
        self.mismatch = 0  # batches whose int8 output has another shape than fp32's (not compared)
        self.mismatch_shapes = None
        self.not_finite = self.finite_differs = 0  # positions NaN/inf in either; in one only
        # cosine of fp32's and int8's vectors along the last axis (an embedding's, a token's): sum, count, min
        self.cos_sum, self.cos_n, self.cos_min = 0.0, 0, 1.0
        self.unit_rows = False  # fp32's vectors all of length 1: an embedding, where no argmax means anything

    def add(self, a: np.ndarray, b: np.ndarray, samples: int | None = None) -> None:
        """`samples`: how many samples the batch holds, where known: a [T, N, C] output (sequence
        first, as many CRNN exports write) is then read as N sequences of T positions."""
        if isinstance(a, list) or isinstance(b, list):  # a sequence output: its tensors' values, end to end
            a, b = (np.concatenate([np.ravel(x) for x in v]) if len(v) else np.zeros(0, np.float32) for v in (a, b))
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind in "OSU" or b.dtype.kind in "OSU":
            # text out (a tokenizer's, a label's name): equal or not is all there is to say
            self.text = True
            self.shape = list(a.shape)
            self.n += len(a) if a.ndim else 1
            self.positions += a.size
            self.same += int(np.sum(a == b)) if a.shape == b.shape else 0
            return
        if a.dtype.kind in "iub" and b.dtype.kind in "iub" and a.shape == b.shape and not _pixels(a):
            # ids out (unidic's tags from an ArgMax): an SQNR over ids, or an argmax over them, means nothing
            self.labels = True
            self.shape = list(a.shape)
            rows = a.reshape(len(a), -1) if a.ndim else a.reshape(1, 1)
            eq = rows == b.reshape(rows.shape)
            self.n += len(rows)
            self.positions += eq.size
            self.same += int(eq.sum())
            self.seq_same += int(eq.all(axis=1).sum())
            return
        if a.shape != b.shape:
            # never broadcast one on the other (a figure for a broken graph); a detector's count of boxes
            # may differ honestly, so this is counted and said, not an error
            self.mismatch += 1
            self.mismatch_shapes = self.mismatch_shapes or (list(a.shape), list(b.shape))
            return
        if samples is not None and a.ndim == 3 and a.shape[0] != samples and a.shape[1] == samples:
            a, b = a.swapaxes(0, 1), b.swapaxes(0, 1)
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        fa, fb = np.isfinite(a64), np.isfinite(b64)
        if not (fa.all() and fb.all()):
            # NaN where the model masks an entry by design (caustic-nmr's shifts of atoms a residue lacks):
            # compared where both are finite, and counted; a NaN made the noise NaN, reported as exact
            both = fa & fb
            self.not_finite += int(both.size - both.sum())
            self.finite_differs += int((fa != fb).sum())
            a64, b64 = np.where(both, a64, 0.0), np.where(both, b64, 0.0)
        if self.shape is not None and len(self.shape) == a.ndim:
            # a size that changes between samples is a length ("?"), never a set of classes
            self.shape = [d if d == e or k == 0 else "?" for k, (d, e) in enumerate(zip(self.shape, a.shape))]
            if self.shape and self.shape[-1] == "?" and self.kind is not None:
                self.kind = None
                self.same = self.positions = self.seq_same = 0
                self.paths = []
        else:
            self.shape = list(a.shape)
        self.sig += float((a64 ** 2).sum())
        self.noise += float(((a64 - b64) ** 2).sum())
        self.maxerr = max(self.maxerr, float(np.abs(a64 - b64).max()) if a64.size else 0.0)
        if a64.ndim >= 2 and a64.shape[-1] >= 2 and a64.size:
            va, vb = a64.reshape(-1, a64.shape[-1]), b64.reshape(-1, a64.shape[-1])
            na, nb = np.sqrt((va * va).sum(1)), np.sqrt((vb * vb).sum(1))
            ok = (na > 0) & (nb > 0)
            if ok.any():
                cos = (va[ok] * vb[ok]).sum(1) / (na[ok] * nb[ok])
                self.cos_sum += float(cos.sum())
                self.cos_n += int(ok.sum())
                self.cos_min = min(self.cos_min, float(cos.min()))
            if not self.n:
                # (a confident softmax's rows are near length 1 too: probabilities are classes)
                self.unit_rows = (a64.shape[-1] >= UNIT_ROWS_MIN and bool(np.abs(na - 1).max() <= 1e-2)
                                  and not is_distribution(a64))
        if not self.n:
            self.kind, self.layout = output_kind(a64)
            if self.state:  # (an LSTM's [directions, N, H] h and c: "top-1 per position" meant nothing)
                self.kind = self.layout = None
            if self.unit_rows:  # (a face's or a sentence's normalized embedding: its cosine says it)
                self.kind = None
        self.n += len(a64) if a64.ndim else 1
        kind, layout = self.kind, self.layout
        if kind is not None:
            ia, ib = a64.argmax(-1), b64.argmax(-1)  # [N] or [N, T]
            eq = ia == ib
            self.same += int(eq.sum())
            self.positions += eq.size
            if kind == "position":
                self.seq_same += int(eq.all(axis=1).sum())
                self.paths += list(zip(ia.astype(np.int32), ib.astype(np.int32)))
        if layout:
            for x, y in zip(a64, b64):
                if layout == "columns":
                    x, y = x.T, y.T
                sf, sq = row_scores(x, objectness=layout == "rows"), row_scores(y, objectness=layout == "rows")
                for k in sorted({min(k, len(sf)) for k in self.top_rows}):  # top-k over at most R rows
                    tf, tq = np.argsort(-sf)[:k], np.argsort(-sq)[:k]
                    self.rows.setdefault(k, []).append(len(set(tf) & set(tq)) / k)
                top = np.argsort(-sf)[:min(10, len(sf))]
                self.row_err.append(float(np.abs(x[top] - y[top]).max()))

    def result(self) -> dict:
        if self.text:
            return {"shape": self.shape, "equal_fraction": self.same / max(self.positions, 1)}
        if self.labels:
            return {"shape": self.shape, "labels_equal": self.same / max(self.positions, 1),
                    "samples_equal": self.seq_same / max(self.n, 1)}
        r = {"shape": self.shape, "sqnr_db": float(10 * np.log10(self.sig / self.noise)) if self.noise > 0
             else (float("inf") if self.shape is not None else None), "max_abs_error": self.maxerr}
        if self.mismatch:
            r["shape_mismatch"] = {"batches": self.mismatch, "fp32": self.mismatch_shapes[0],
                                   "int8": self.mismatch_shapes[1]}
        if self.not_finite:
            r["not_finite"] = {"positions": self.not_finite, "finite_in_one_only": self.finite_differs}
        if self.cos_n:
            r["cosine"] = {"mean": self.cos_sum / self.cos_n, "min": self.cos_min, "vectors": self.cos_n,
                           "unit_length": self.unit_rows}
        if self.kind is not None:
            r["top1_agreement"] = self.same / max(self.positions, 1)
            r["agreement_over"] = "samples" if self.kind == "class" else "positions"
            if self.kind == "position":
                r["sequence_agreement"] = self.seq_same / max(self.n, 1)
                r.update(ctc_agreement(self.paths))
        if any(self.rows.values()):
            r["top_rows_agreement"] = {f"top{k}": float(np.mean(v)) for k, v in self.rows.items() if v}
            r["top10_rows_max_abs_error"] = float(max(self.row_err))
        return r


def _pixels(a: np.ndarray) -> bool:
    """uint8 / uint16 values out (depth2normal's normal map, a picture, 16-bit audio) are magnitudes,
    judged by SQNR: an off-by-one in a 0-255 pixel is no wrong class. Ids come as int32/int64 (ArgMax)."""
    return a.dtype.kind == "u" and a.dtype.itemsize <= 2


RECURRENT = ("LSTM", "GRU", "RNN")
STATE_CARRIERS = ("Identity", "Squeeze", "Unsqueeze", "Reshape", "Transpose", "Flatten")


def recurrent_states(model) -> set:
    """The graph outputs that are a recurrent layer's last states (its outputs 1 and 2: Y_h, Y_c), directly or
    through ops that only reshape them: a streaming model's carried state, vectors with no classes."""
    prod = G.producers(model)
    states = set()
    for o in model.graph.output:
        t = o.name
        while t in prod and prod[t].op_type in STATE_CARRIERS:
            t = prod[t].input[0]
        n = prod.get(t)
        if n is not None and n.op_type in RECURRENT and list(n.output).index(t) >= 1:
            states.add(o.name)
    return states


VARIED_SIZES = ("limit", "height", "none")  # resize modes that keep each image's own size (or width)


def ctc_agreement(paths: list) -> dict:
    """Where the outputs look like CTC (metrics.ctc_blank), the share of sequences whose greedy-decoded
    texts are equal: what a reader of the text sees, where "equal at every position" also counts a blank
    moved by one step. {} where they do not."""
    blank = ctc_blank([p for p, _ in paths])
    if blank is None:
        return {}
    same = sum(ctc_collapse(p, blank) == ctc_collapse(q, blank) for p, q in paths)
    return {"ctc_text_agreement": same / len(paths), "ctc_blank": blank}


def row_scores(rows: np.ndarray, objectness: bool = True) -> np.ndarray:
    """Each row's score: objectness (column 4) times the best class score (columns 5...) in the YOLOv5
    convention; the best class score (columns 4...) without objectness (YOLOv8)."""
    if not objectness:
        return rows[:, 4:].max(1)
    return rows[:, 4] * rows[:, 5:].max(1) if rows.shape[1] > 5 else rows[:, 4]


EVAL_MEMORY = 1 << 30  # about what the fp32 and int8 sessions' activations may take together


def eval_batch(model, data, path: str, files: list | None, batch: int) -> int:
    """Samples per run for a folder of tensors: fewer where one sample's activations are large (afis's
    fingerprint network: 31 MB tensors, each ORT session 2.0 GB at 8 samples, 0.33 GB at 1; eval peaked
    at 3.9 GB). About 8 x its largest tensor per sample and session, from shape inference on the first."""
    from qtool.data.tensors import tensor_source
    try:
        probe = tensor_source(data, model, path, batch=1, files=files, limit=1)
        _, feeds = next(iter(probe.batches()))
    except Exception:  # (a shape inference that cannot follow the graph: the default batch)
        return batch
    return batch_for_memory(model, feeds, batch)


def batch_for_memory(model, feeds: dict, batch: int) -> int:
    """`batch`, or fewer where one sample's (`feeds`) largest tensor is large: about 8 x it per sample and
    session within EVAL_MEMORY."""
    from qtool.limits import elems
    try:
        dims = G.inferred_shapes(model, {k: np.shape(v) for k, v in feeds.items()}).values()
        largest = max((elems(d) * 4 for d in dims if d and all(isinstance(x, int) for x in d)), default=0)
    except Exception:  # (a shape inference that cannot follow the graph: the default batch)
        return batch
    return int(max(1, min(batch, EVAL_MEMORY // (2 * 8 * largest)))) if largest else batch


def evaluate_tensors(fp32_path: str, int8_path: str, data, limit: int | None = None, files: list | None = None,
                     threads: int = 2, batch: int = 8, latency: bool = True, check: bool = True) -> dict:
    """Every output of int8 vs fp32 over tensor data (a .npy/.npz folder or an iterable of input dicts)."""
    from qtool.data.tensors import tensor_source
    fp32 = load_model(fp32_path)
    if isinstance(data, (str, os.PathLike)) and batch > 1:
        batch = eval_batch(fp32, data, fp32_path, files, batch)
    # (a model nothing of which runs in int8 has no int8 arithmetic to check: luscinia's 194 MB tree ensemble
    # took a third copy in the runtime for it, eval peaked at 5.9 GB)
    int8_ops = bool(G.quantized_ops(load_model(int8_path, check=False)))
    check_pair(fp32_path, int8_path)
    src = tensor_source(data, fp32, fp32_path, batch=batch, files=files, limit=limit)
    if src is None:
        from qtool.errors import QtoolError
        raise QtoolError(f"{data}: holds images; evaluate them with a preprocessing config")
    sf, sq = session(fp32_path, threads), session(int8_path, threads)
    names = [o.name for o in sf.get_outputs()]
    states = recurrent_states(fp32)
    stats = {n: OutputStats(n, state=n in states) for n in names}
    exact = ExactCheck(int8_path, threads) if check and int8_ops else None
    sample, n_samples = None, 0
    runs = {"ort_fp32": [], "ort_int8": []}  # seconds per run; at batch 1 these are the latencies
    for batch_names, feeds in src.batches():
        t0 = time.perf_counter()
        outs_q = sq.run(names, feeds)
        t1 = time.perf_counter()
        outs_f = sf.run(names, feeds)
        runs["ort_int8"].append(t1 - t0)
        runs["ort_fp32"].append(time.perf_counter() - t1)
        # (a file is one sample, whatever its axis 0 holds; an iterable's item may be a batch)
        n_batch = len(batch_names) if src.kind in ("npy", "npz") else len(next(iter(feeds.values())))
        if exact is not None:
            exact.add(feeds, outs_q, n_batch)
        for name, a, b in zip(names, outs_f, outs_q):
            stats[name].add(a, b, n_batch)
        n_samples += n_batch
        sample = sample or feeds
    if n_samples == 0:
        from qtool.errors import QtoolError
        raise QtoolError("no evaluation samples")
    outs = {n: s.result() for n, s in stats.items()}
    first = _headline([outs[n] for n in names])
    res = {"n_samples": n_samples, "data_kind": src.kind, "fp32_model": os.path.abspath(fp32_path),
           "int8_model": os.path.abspath(int8_path), "outputs": outs,
           "output_sqnr_db": first["sqnr_db"], "max_abs_error": first["max_abs_error"],
           "size_bytes": {"fp32": _size(fp32_path), "int8": _size(int8_path)}}
    if "top1_agreement" in first:
        res["top1_agreement"] = first["top1_agreement"]
    if exact is not None:
        res["runtime_check"] = exact.result()
    res["size_ratio"] = res["size_bytes"]["int8"] / res["size_bytes"]["fp32"]
    if latency and sample is not None:  # (a sample fed whole where samples are not stacked: a state [2, N, C])
        one = sample if src.batch == 1 else {k: v[:1] for k, v in sample.items()}
        if src.batch == 1 and len(runs["ort_fp32"]) > 3:  # the runs above, the first one (warm-up) left out
            res["latency_ms"] = {k: float(np.median(v[1:])) * 1000 for k, v in runs.items()}
        else:
            res["latency_ms"] = {"ort_fp32": _latency_ms(lambda x: sf.run(None, x), one),
                                 "ort_int8": _latency_ms(lambda x: sq.run(None, x), one)}
    return res


def _headline(results: list) -> dict:
    """The output whose figures head the report: the first numeric one. A model that only writes text
    gets an SQNR of inf when every string matched and NaN when not (strings have no error size)."""
    for r in results:
        if "sqnr_db" in r:
            return r
    same = all(r.get("equal_fraction", r.get("labels_equal")) == 1.0 for r in results)
    head = {"sqnr_db": float("inf") if same else float("nan"), "max_abs_error": 0.0}
    ids = next((r for r in results if "labels_equal" in r), None)
    if ids is not None:  # (a tagger that writes only its tags: how many it keeps is its top-1 agreement)
        head["top1_agreement"] = ids["labels_equal"]
    return head


def _size(path: str) -> int:
    return model_bytes(path)


def evaluate_workdir(workdir: str | None = None, data=None, labels: str | None = None, model: str | None = None,
                     int8_path: str | None = None, config=None, limit: int | None = None, threads: int = 2,
                     runtime: str = "ort", show_progress: bool = True, say=print, also_writes=()) -> dict:
    """`qtool eval`: the int8 model against its fp32 original, every path not given taken from the
    working directory (the calibrated model and its data and preprocessing, the quantized model).
    `data`: a folder of images or of .npy/.npz files, or an iterable of input dicts (or of arrays, for
    a one-input model). Images and tensors the ranges were fitted to are left out when `data` is the
    calibration folder. Records the headline figures in the manifest. Paths taken from the working
    directory are checked against the sha256 recorded for them, and the int8 model against the fp32
    model it records it came from. What it writes (the manifest, and `also_writes`: outputs.File, as the
    command's --json) is checked against what it reads, and writable, before the evaluation; should the
    manifest fail to be written anyway, the LateWriteError raised carries the figures."""
    from qtool.workdir import Workdir

    wd = Workdir(workdir)
    with wd.lock():  # no other run rewrites the working directory while this one reads it
        return _evaluate_workdir(wd, data, labels, model, int8_path, config, limit, threads, runtime, show_progress,
                                 say, also_writes)


def _record(wd, r: dict, entry: dict) -> dict:
    """The headline figures into the manifest; a failure there is a LateWriteError carrying `r`."""
    from qtool.errors import LateWriteError, QtoolError
    try:
        wd.update(eval=entry)
    except QtoolError as e:
        raise LateWriteError(str(e), r) from None
    return r


def _evaluate_workdir(wd, data, labels, model, int8_path, config, limit, threads, runtime, show_progress, say,
                      also_writes=()):
    from qtool import outputs
    from qtool.workdir import MANIFEST
    from qtool.data.tensors import classify_folder, list_tensor_files
    from qtool.errors import QtoolError
    from qtool.modelio import model_hash

    cal = wd.manifest().get("calibrate", {})
    if model is None or config is None or data is None:
        cal = wd.require("calibrate", "calibrate")
    if int8_path is None:  # the int8 model recorded here: still the file quantize wrote, from this calibration
        q = wd.require("quantize", "quantize")
        int8_path = q["int8_path"]
        wd.verify(int8_path, q["int8_sha256"], "quantize", "int8 model")
        if model is None and q["model_sha256"] != cal["model_sha256"]:
            raise QtoolError(f"{int8_path}: quantized from another calibration than the one in {wd.path}; run "
                             f"`qtool quantize` again")
    if model is None and model_hash(cal["model_path"]) != cal["model_sha256"]:
        raise QtoolError(f"{cal['model_path']}: the model changed since `qtool calibrate` recorded it; run "
                         f"`qtool calibrate` again")
    model = model or cal["model_path"]
    data = cal["data"] if data is None else data
    cfg = config if config is not None else cal.get("config")
    outputs.check(writes=list(also_writes) + [outputs.File("manifest", wd.file(MANIFEST))],
                  reads=outputs.model("fp32 model", model) + outputs.model("int8 model", int8_path)
                  + outputs.data("data folder", data) + [outputs.File("labels file", labels)]
                  + outputs.config("--config file", config) + outputs.recorded(wd.manifest()))
    if runtime != "ort":
        try:
            import qtool.runtime  # noqa: F401
        except ImportError as e:
            raise QtoolError(f"--runtime {runtime}: the native runtime is not available ({e})") from None
    if not isinstance(data, (str, os.PathLike)):
        r = evaluate_tensors(model, int8_path, data, limit, threads=threads)
        return _record(wd, r, {"n_samples": r["n_samples"], "output_sqnr_db": r["output_sqnr_db"]})
    data = os.fspath(data)
    if data == "(python iterable)":
        raise QtoolError("calibration data was a Python iterable; pass data (a folder or an iterable) to evaluate on")
    kind = classify_folder(data)
    images = kind == "images"
    files = list_images(data) if images else list_tensor_files(data, "." + kind)
    what = "images" if images else "samples"
    calib = set(cal.get("files", [])) if os.path.abspath(data) == cal.get("data") else set()
    if calib:
        # never score on the samples the ranges were fitted to
        held_out = [f for f in files if os.path.abspath(f) not in calib]
        if held_out:
            files = held_out
            say(f"evaluating on {_count(len(files), limit, what)} of {data} (the {len(calib)} calibration {what} "
                f"excluded)")
        else:
            say(f"note: every {what[:-1]} in {data} was used for calibration; evaluating on them (pass --data with "
                f"held-out {what} for an unbiased figure)")
    if not images:
        r = evaluate_tensors(model, int8_path, data, limit, files=files, threads=threads)
        return _record(wd, r, {"n_samples": r["n_samples"], "output_sqnr_db": r["output_sqnr_db"],
                               "outputs": {k: v.get("sqnr_db") for k, v in r["outputs"].items()}})  # (a ZipMap has none)
    r = evaluate(model, int8_path, data, cfg, labels, limit, files=files, threads=threads, show_progress=show_progress,
                 runtime=runtime)
    return _record(wd, r, {k: r[k] for k in ("n_images", "top1_agreement", "output_sqnr_db") if k in r}
                   | ({"top1_delta_pt": r["top1_delta_pt"]} if "top1_delta_pt" in r else {}))


def _count(n: int, limit: int | None, what: str) -> str:
    """'900 images', or with a limit of 200 '200 of the 900 images'."""
    return f"{limit} of the {n} {what}" if limit is not None and 0 <= limit < n else f"{n} {what}"
