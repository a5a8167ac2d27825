"""`eval`: int8 against fp32 on the same inputs: accuracy, agreement, output error, size, speed."""
from __future__ import annotations

import os
import time

import numpy as np
from tqdm import tqdm

from qtool.calibrate.collect import session
from qtool.calibrate.config import from_dict, load_config
from qtool.calibrate.data import ImageData
from qtool.calibrate.images import list_images
from qtool.labels import labels_from_file, labels_from_folders
from qtool.modelio import load_model


def _topk(logits: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-logits, axis=1)[:, :k]


def _latency_ms(run, x, repeats: int = 10) -> float:
    run(x)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        run(x)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1000


def evaluate(fp32_path: str, int8_path: str, data: str, config=None, labels: str | None = None,
             limit: int | None = None, files: list | None = None, threads: int = 2, batch: int = 16,
             show_progress: bool = True, runtime: str = "ort", latency: bool = True) -> dict:
    fp32 = load_model(fp32_path)
    load_model(int8_path, check=False)
    cfg = from_dict_or_load(config)
    files = list_images(data) if files is None else files
    src = ImageData(data, cfg, fp32, fp32_path, batch=batch, limit=limit, files=files)
    y_true = None
    if labels:
        y_true = labels_from_file(labels, src.files)
    else:
        y_true = labels_from_folders(data, src.files)
    sf, sq = session(fp32_path, threads), session(int8_path, threads)
    native = None
    if runtime in ("native", "both"):
        from qtool.runtime import NativeSession
        native = NativeSession(int8_path, threads=threads)
    out_name = sf.get_outputs()[0].name
    label_of = dict(zip(src.files, y_true)) if y_true is not None else {}
    rows = {"fp32": [], "int8": [], "native": []}
    truth, sig, noise, maxerr = [], 0.0, 0.0, 0.0
    sample = None
    with tqdm(total=len(src), unit="img", desc="eval", disable=not show_progress, leave=False) as bar:
        for names, feeds in src.batches():
            a = sf.run([out_name], feeds)[0]
            b = sq.run([out_name], feeds)[0]
            rows["fp32"].append(a.reshape(len(a), -1))
            rows["int8"].append(b.reshape(len(b), -1))
            if native is not None:
                rows["native"].append(native.run([out_name], feeds)[0].reshape(len(a), -1))
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            sig += float((a64 ** 2).sum())
            noise += float(((a64 - b64) ** 2).sum())
            maxerr = max(maxerr, float(np.abs(a64 - b64).max()))
            truth.extend(label_of.get(n) for n in names)
            if sample is None:
                sample = {k: v[:1] for k, v in feeds.items()}
            bar.update(len(names))
    lf, lq = np.concatenate(rows["fp32"]), np.concatenate(rows["int8"])
    n = len(lf)
    res = {
        "n_images": n, "skipped": list(src.skipped),
        "fp32_model": os.path.abspath(fp32_path), "int8_model": os.path.abspath(int8_path),
        "top1_agreement": float((lf.argmax(1) == lq.argmax(1)).mean()),
        "top5_overlap": float(np.mean([len(set(p) & set(q)) / 5 for p, q in zip(_topk(lf, 5), _topk(lq, 5))]))
        if lf.shape[1] >= 5 else None,
        "output_sqnr_db": float(10 * np.log10(sig / noise)) if noise > 0 else float("inf"),
        "max_abs_error": maxerr,
        "size_bytes": {"fp32": _size(fp32_path), "int8": _size(int8_path)},
    }
    res["size_ratio"] = res["size_bytes"]["int8"] / res["size_bytes"]["fp32"]
    have = [t is not None for t in truth]
    if any(have) and lf.shape[1] > 1:
        m = np.array(have)
        yt = np.array([t for t in truth if t is not None])
        res["n_labelled"] = int(m.sum())
        for key, logits in (("fp32", lf), ("int8", lq)):
            top = _topk(logits[m], 5)
            res[key] = {"top1": float((top[:, 0] == yt).mean()), "top5": float((top == yt[:, None]).any(1).mean())}
        res["top1_delta_pt"] = 100 * (res["int8"]["top1"] - res["fp32"]["top1"])
        res["top5_delta_pt"] = 100 * (res["int8"]["top5"] - res["fp32"]["top5"])
    if native is not None:
        ln = np.concatenate(rows["native"])
        res["native"] = {"top1_agreement_vs_fp32": float((lf.argmax(1) == ln.argmax(1)).mean()),
                         "top1_agreement_vs_ort_int8": float((lq.argmax(1) == ln.argmax(1)).mean()),
                         "max_abs_diff_vs_ort_int8": float(np.abs(ln - lq).max())}
    if latency and sample is not None:
        res["latency_ms"] = {"ort_fp32": _latency_ms(lambda x: sf.run(None, x), sample),
                             "ort_int8": _latency_ms(lambda x: sq.run(None, x), sample)}
        if native is not None:
            res["latency_ms"]["native_int8"] = _latency_ms(lambda x: native.run(None, x), sample)
    return res


def from_dict_or_load(config):
    if config is None or isinstance(config, str):
        return load_config(config)
    if isinstance(config, dict):
        return from_dict({"input": {k: config[k] for k in ("layout", "size", "color") if k in config}
                          | ({"name": config["input_name"]} if config.get("input_name") else {}),
                          "preprocess": {k: config[k] for k in ("resize", "resize_to", "crop", "interpolation",
                                                                "mean", "std") if k in config}},
                         config.get("source", "(manifest)"))
    return config


def _size(path: str) -> int:
    total = os.path.getsize(path)
    data = path + ".data"
    return total + (os.path.getsize(data) if os.path.exists(data) else 0)
