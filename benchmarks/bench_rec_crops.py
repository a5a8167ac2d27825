"""A CTC text recognizer int8, judged by the words it reads on crops quantize never saw (issue 45).

Any PaddleOCR-style recognizer (input [1, 3, H, W] normalized to [-1, 1], output [1, T, classes] with the
blank at 0 and the charset after it, a space last): PP-OCRv4's as RapidOCR ships it (its charset in the
model's `character` metadata), the zoo's PP-OCRv5 and PP-OCRv2 (a charset file). Crops are those of
`text-samples` (crops.tsv): the crops of images 0000-0099 calibrate, those of 0100-0199 judge. Each crop is
prepared as RapidOCR's TextRecognizer prepares one crop alone: BGR, resized to height H keeping its aspect
(width ceil(H * w / h), at most max(W, H * w / h)), scaled to [-1, 1], padded with zeros to width
max(W, H * w / h) (PIL's bilinear resize stands in for cv2's).

Systems: fp32; qtool's default (`calibrate` on the calibration crops' tensors, then `quantize`);
`quantize --rounding nearest` on the same calibration; optionally the default of another qtool
(--before, e.g. a checkout of an earlier commit); ORT's quantize_static (bench_zoo.py's anchor).
Figures per system on the evaluation crops: words read (greedy CTC, spaces removed on both sides), mean
character accuracy (1 - edit distance / max length), and crops whose text differs from fp32's.

  python benchmarks/bench_rec_crops.py --rec ch_PP-OCRv4_rec_infer.onnx --charset meta:character \
      --text-samples ../shared/text-samples --out bench_out/rec-crops [--before OTHER/.venv/bin/qtool]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ocr import char_acc  # noqa: E402  (the OCR bench's scoring, one copy)
from bench_zoo import ort_quantize, ort_session  # noqa: E402
from qtool.metrics import ctc_collapse  # noqa: E402


def charset(model, spec):
    """['blank', chars..., ' ']: from a file (one char per line) or the model's metadata (`meta:KEY`)."""
    if spec.startswith("meta:"):
        import onnx
        meta = {p.key: p.value for p in onnx.load(model, load_external_data=False).metadata_props}
        chars = meta[spec[5:]].splitlines()
    else:
        with open(spec, encoding="utf-8") as f:
            chars = [line.rstrip("\r\n") for line in f]
    return ["blank"] + chars + [" "]


def crops(text_samples, split):
    """(path, text) of each crop of the split: images 0000-0099 calibrate, 0100-0199 evaluate."""
    out = []
    with open(os.path.join(text_samples, "crops.tsv"), encoding="utf-8") as f:
        for line in f:
            name, _, text = line.rstrip("\n").partition("\t")
            if not name or name == "file":
                continue
            image = int(os.path.basename(name)[:4])
            if (image < 100) == (split == "calib"):
                out.append((os.path.join(text_samples, "crops", os.path.basename(name)), text))
    return out


def prepare(path, height, width):
    img = np.asarray(Image.open(path).convert("RGB"))[:, :, ::-1]  # BGR, as cv2.imread reads it
    h, w = img.shape[:2]
    full = max(width, int(height * w / h))
    rw = min(full, int(math.ceil(height * w / h)))
    x = np.asarray(Image.fromarray(np.ascontiguousarray(img)).resize((rw, height), Image.BILINEAR), np.float32)
    x = (x.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    out = np.zeros((3, height, full), np.float32)
    out[:, :, :rw] = x
    return out[None]


def write_tensors(items, folder, height, width):
    os.makedirs(folder, exist_ok=True)
    for k, (path, _) in enumerate(items):
        np.save(os.path.join(folder, f"{k:04d}.npy"), prepare(path, height, width))
    with open(os.path.join(folder, "index.json"), "w", encoding="utf-8") as f:
        json.dump({"samples": [{"file": f"{k:04d}.npy"} for k in range(len(items))]}, f)
    return folder


def decode(probs, chars):
    """Greedy CTC (qtool.metrics.ctc_collapse, blank 0) to text."""
    ids = ctc_collapse(probs.argmax(-1).reshape(-1), 0)
    return "".join(chars[i] if i < len(chars) else "" for i in ids)


def read_all(model, folder, n, chars):
    s = ort_session(model, 1)
    name = s.get_inputs()[0].name
    return [decode(s.run(None, {name: np.load(os.path.join(folder, f"{k:04d}.npy"))})[0], chars) for k in range(n)]


def score(texts, truth, ref):
    clean = [t.replace(" ", "") for t in texts]
    gold = [t.replace(" ", "") for t in truth]
    words = sum(c == g for c, g in zip(clean, gold))
    chars = np.mean([char_acc(c, g) for c, g in zip(clean, gold)])
    changed = sum(t != r for t, r in zip(texts, ref))
    return {"words_read": round(words / len(gold), 4), "words": f"{words}/{len(gold)}",
            "char_accuracy": round(float(chars), 4), "changed_vs_fp32": changed}


def qtool_model(qtool, model, calib, work, extra, base=None):
    """The int8 model of `qtool quantize EXTRA`: calibrated once per qtool (base: a folder to copy)."""
    shutil.rmtree(work, ignore_errors=True)
    if base:
        shutil.copytree(base, work, ignore=shutil.ignore_patterns("model.int8.onnx", "quantize*.json", "sensitivity.*"))
    else:
        subprocess.run(qtool + ["calibrate", "--model", model, "--data", calib, "-w", work, "-q"], check=True)
    subprocess.run(qtool + ["quantize", "-w", work, "-q"] + extra, check=True)
    return os.path.join(work, "model.int8.onnx")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rec", required=True)
    p.add_argument("--charset", required=True, help="a file, one character per line, or meta:KEY")
    p.add_argument("--text-samples", required=True)
    p.add_argument("--height", type=int, default=48)
    p.add_argument("--width", type=int, default=320)
    p.add_argument("--out", default="bench_out/rec-crops")
    p.add_argument("--qtool", help="the qtool command (default: this Python's -m qtool)")
    p.add_argument("--before", help="another qtool command whose default is judged too (e.g. an earlier commit's)")
    p.add_argument("--no-ort", action="store_true")
    a = p.parse_args(argv)
    qtool = a.qtool.split() if a.qtool else [sys.executable, "-m", "qtool"]
    chars = charset(a.rec, a.charset)
    calib_items, eval_items = crops(a.text_samples, "calib"), crops(a.text_samples, "eval")
    calib = write_tensors(calib_items, os.path.join(a.out, "calib"), a.height, a.width)
    evals = write_tensors(eval_items, os.path.join(a.out, "eval"), a.height, a.width)
    models = {"fp32": a.rec}
    models["qtool default"] = qtool_model(qtool, a.rec, calib, os.path.join(a.out, "qtool"), [])
    models["qtool --rounding nearest"] = qtool_model(qtool, a.rec, calib, os.path.join(a.out, "qtool-nearest"),
                                                     ["--rounding", "nearest"], base=os.path.join(a.out, "qtool"))
    if a.before:
        models["before: default"] = qtool_model(a.before.split(), a.rec, calib, os.path.join(a.out, "before"), [])
    if not a.no_ort:
        ort_dir = os.path.join(a.out, "ort")
        os.makedirs(ort_dir, exist_ok=True)
        models["ORT quantize_static"] = ort_quantize(a.rec, calib, ort_dir, [ort_session(a.rec, 1).get_inputs()[0].name])
    truth = [t for _, t in eval_items]
    texts = {k: read_all(m, evals, len(eval_items), chars) for k, m in models.items()}
    rows = {k: score(t, truth, texts["fp32"]) for k, t in texts.items()}
    result = {"model": os.path.basename(a.rec), "calibration_crops": len(calib_items),
              "evaluation_crops": len(eval_items), "rows": rows}
    print(f"{result['model']}: {len(calib_items)} calibration crops, {len(eval_items)} evaluation crops")
    for k, r in rows.items():
        print(f"  {k:26s} words {r['words']} ({r['words_read']:.3f})  chars {r['char_accuracy']:.3f}  "
              f"changed vs fp32 {r['changed_vs_fp32']}")
    with open(os.path.join(a.out, "rec-crops.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
