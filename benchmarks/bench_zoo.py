#!/usr/bin/env python3
"""Every real model: the default `qtool quantize` on third-party models it has never seen (../shared/zoo).

For each zoo model (ZOO.json's order, or --models) it fetches the model and makes its inputs where they
are missing, then runs `qtool batch` on the zoo's catalogue (OUT/zoo.toml, written from ZOO.json's list:
`qtool calibrate`, `qtool quantize --strict` and `qtool eval --compare fp32` per model, each step in its
own process, timed, with its peak resident memory, under a timeout and a memory limit; its table is
OUT/batch.md and OUT/batch.json), then judges each int8 model. ONNX Runtime's quantizer (quantize_static:
QDQ, u8 activations, s8 per-channel weights, MinMax, after quant_pre_process) is the anchor, on the same
calibration files.
Both int8 models are scored by output SQNR against fp32 over every evaluation file, per float output
(the headline is the worst output); ORT's model also "exact": its int8 weights stored as uint8 + 128,
which ONNX Runtime computes exactly on every CPU. Then the zoo's task check (check.py) runs on fp32,
qtool's int8 and ORT's int8.

quantize runs a second time, in a copy of the calibrated working folder, with a busy loop on one core
beside it, and the two int8 files are compared byte for byte (issue 45: the same inputs must give the same model, whatever the machine's load).
For each OCR recognizer (family ocr-rec) the share of its evaluation crops whose text, greedy-CTC decoded
(qtool.evaluate's decoder), int8 changes against fp32 is printed too.

A model passes when the three steps succeed, each within 180 s, quantize peaks under 4 GB, qtool's
SQNR is at least the better of ORT's two, qtool's int8 passes the task check wherever fp32 does, and
the two quantize runs wrote the same bytes.
Exit 0 when every model passes. Results: OUT/zoo.json (every figure), OUT/zoo.md (the table).

  python benchmarks/bench_zoo.py --shared ../shared [--models a,b] [--zoo-dir DIR] [--data-dir DIR] [--out DIR]
  python benchmarks/bench_zoo.py --shared ../shared --catalogue zoo.toml   (the catalogue alone, for `qtool batch`)
"""
import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 180  # the budget per step; --step-timeout only stops runaways
QUANT_MB = 4096  # the budget for quantize's peak resident memory
# the same int8 arithmetic summed in another float order differs by ~1e-4 dB: below this it is a tie
SQNR_TIE_DB = 0.01
STEPS = ("calibrate", "quantize", "eval")
HEAD = ["model", "status", "calibrate s/MB", "quantize s/MB", "eval s/MB", "size", "qtool dB", "ORT dB here/exact",
        "check fp32/qtool/ORT", "ops int8/fp32", "2 runs", "reason"]
WIDTH = [24, 16, 14, 14, 12, 5, 8, 17, 20, 13, 9, 0]


def one_line(text, limit=200):
    lines = [s.strip() for s in str(text).replace("\r", "\n").splitlines() if s.strip()]
    return (lines[0] if lines else "")[:limit]


def run_step(cmd, a, env=None, cwd=None):
    """Runs cmd to the end (or until the watchdog kills it past --mem-limit-gb or --step-timeout) and
    measures it: qtool batch's watcher (qtool.batch.watch, standard library only: this process never
    imports numpy or onnx in its main mode)."""
    from qtool.batch.watch import Bounds, run_watched
    return run_watched(cmd, Bounds(a.mem_limit_gb * 1024, a.step_timeout), env, cwd)


# ---- the child side: ORT's quantizer and the SQNR measurement (run as `bench_zoo.py --_ort-anchor|--_sqnr`)

def samples(data_dir):
    """The feeds inputs.py wrote, in index.json's order: an array (.npy, the model's only input) or a dict (.npz)."""
    import numpy as np
    with open(os.path.join(data_dir, "index.json"), encoding="utf-8") as f:
        files = [s["file"] for s in json.load(f)["samples"]]
    for name in files:
        path = os.path.join(data_dir, name)
        if path.endswith(".npy"):
            yield np.load(path)
        else:
            with np.load(path) as z:
                yield {k: z[k] for k in z.files}


def feed(x, names):
    return x if isinstance(x, dict) else {names[0]: x}


def ort_session(path, threads):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def used_names(graph):
    """Every tensor name a node reads, subgraphs included (their nodes may read the outer initializers)."""
    names = set()
    for n in graph.node:
        names.update(n.input)
        for at in n.attribute:
            for g in [at.g] if at.HasField("g") else list(at.graphs):
                names |= used_names(g)
    return names


def u8_weights(model):
    """ORT's int8 weights (zero point 0) as uint8 + 128 with zero point 128: the same dequantized values.
    Without VNNI, ONNX Runtime adds u8 x s8 pairs in a saturating int16; u8 x u8 it computes exactly."""
    import numpy as np
    from onnx import TensorProto, numpy_helper
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    replaced = set()
    for n in g.node:
        w = inits.get(n.input[0]) if n.op_type == "DequantizeLinear" else None
        if w is None or w.data_type != TensorProto.INT8 or n.input[1] not in inits:
            continue
        has_zp = len(n.input) > 2 and n.input[2]
        if has_zp and (n.input[2] not in inits or numpy_helper.to_array(inits[n.input[2]]).any()):
            continue
        zp_shape = numpy_helper.to_array(inits[n.input[2] if has_zp else n.input[1]]).shape
        if w.name + "_u8" not in inits:
            q = (numpy_helper.to_array(w).astype(np.int16) + 128).astype(np.uint8)
            for t in (numpy_helper.from_array(q, w.name + "_u8"),
                      numpy_helper.from_array(np.full(zp_shape, 128, np.uint8), w.name + "_u8_zp")):
                g.initializer.append(t)
                inits[t.name] = t
        replaced.add(w.name)
        n.input[0] = w.name + "_u8"
        if has_zp:
            n.input[2] = w.name + "_u8_zp"
        else:
            n.input.append(w.name + "_u8_zp")
    keep = used_names(g) | {o.name for o in g.output}
    for name in replaced - keep:
        g.initializer.remove(inits[name])
    return model


def ort_quantize(model, calib_dir, out_dir, names):
    """ORT's quantize_static as ../shared/anchors/ort_anchor.py runs it; returns the int8 model's path."""
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Feed(CalibrationDataReader):
        def __init__(self):
            self.it = (feed(x, names) for x in samples(calib_dir))

        def get_next(self):
            return next(self.it, None)

    pre = os.path.join(out_dir, "pre.onnx")
    try:
        quant_pre_process(model, pre)
    except Exception as e:  # noqa: BLE001 - ORT's symbolic shape inference rejects some exported graphs
        print(f"note: ORT quant_pre_process failed ({type(e).__name__}); quantized the model as it is", file=sys.stderr)
        pre = model
    out = os.path.join(out_dir, "model.int8.onnx")
    quantize_static(pre, out, Feed(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax)
    return out


def ort_anchor_main(model, calib_dir, out_dir):
    """ORT's int8 model and its u8-weight copy in out_dir. Below opset 13 ORT writes per-channel
    DequantizeLinear that the opset lacks; such a model is quantized again from a copy at opset 13
    (qtool upgrades those models itself), so the anchor is ORT's quantizer, not an opset accident."""
    import onnx
    from onnx import version_converter
    names = [i.name for i in ort_session(model, 1).get_inputs()]
    out = ort_quantize(model, calib_dir, out_dir, names)
    try:
        ort_session(out, 1)
    except Exception as e:  # noqa: BLE001
        opset = next((o.version for o in onnx.load(model).opset_import if o.domain in ("", "ai.onnx")), 0)
        if opset >= 13:
            raise
        print(f"note: ORT quantized an opset-13 copy (its int8 model of the opset-{opset} original does not load: "
              f"{type(e).__name__})", file=sys.stderr)
        up = os.path.join(out_dir, "opset13.onnx")
        onnx.save(version_converter.convert_version(onnx.load(model), 13), up)
        out = ort_quantize(up, calib_dir, out_dir, names)
    onnx.save(u8_weights(onnx.load(out)), os.path.join(out_dir, "model.int8.u8.onnx"))


def first_float_path(y):
    """The top-1 path of a recognizer's output for one sample: its size-1 axes (the batch) dropped,
    [T, classes] -> [T]; None where that leaves no such matrix."""
    import numpy as np
    y = np.squeeze(np.asarray(y))
    return y.argmax(-1) if y.ndim == 2 and y.dtype.kind == "f" else None


def texts_main(fp32, data_dir, out_json, threads, int8):
    """The share of samples whose greedy-CTC text (qtool.evaluate.ctc_agreement, the one decoder qtool has)
    of the first float output differs between fp32 and int8."""
    from qtool.evaluate import ctc_agreement
    ref, q = ort_session(fp32, threads), ort_session(int8, threads)
    names = [i.name for i in ref.get_inputs()]
    out = next(o.name for o in ref.get_outputs() if "float" in o.type)
    paths = []
    for x in samples(data_dir):
        p, r = (first_float_path(s.run([out], feed(x, names))[0]) for s in (ref, q))
        if p is not None and r is not None:
            paths.append((p, r))
    agree = ctc_agreement(paths)
    res = {"samples": len(paths), "output": out}
    if agree:
        res.update(changed=1 - agree["ctc_text_agreement"], blank=agree["ctc_blank"],
                   changed_n=round((1 - agree["ctc_text_agreement"]) * len(paths)))
    else:
        res["error"] = "the output does not look like CTC (no blank at most positions)"
    with open(out_json, "w") as f:
        json.dump(res, f)


def db(signal_, noise):
    """10 log10(signal / noise): inf when equal; -inf for a non-finite output or noise on a zero signal."""
    if not math.isfinite(noise):
        return -math.inf
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal_ / noise) if signal_ > 0 else -math.inf


def sqnr_main(fp32, data_dir, out_json, threads, labelled):
    """Per float output, SQNR of each LABEL=PATH model against fp32 over all evaluation samples together."""
    import numpy as np
    ref = ort_session(fp32, threads)
    names, outs = [i.name for i in ref.get_inputs()], [o.name for o in ref.get_outputs()]
    xs = [feed(x, names) for x in samples(data_dir)]
    refs = [ref.run(outs, x) for x in xs]
    res = {}
    for spec in labelled:
        label, path = spec.split("=", 1)
        try:
            s, acc = ort_session(path, threads), {}
            for x, r_all in zip(xs, refs):
                for o, r, y in zip(outs, r_all, s.run(outs, x)):
                    if r.dtype.kind != "f":
                        continue
                    if r.shape != y.shape:
                        raise ValueError(f"output {o}: shape {y.shape}, fp32 {r.shape}")
                    r64 = r.astype(np.float64)
                    sig_noise = acc.setdefault(o, [0.0, 0.0])
                    sig_noise[0] += float((r64 ** 2).sum())
                    sig_noise[1] += float(((r64 - y.astype(np.float64)) ** 2).sum())
            per = {o: db(*v) for o, v in acc.items()}
            res[label] = {"outputs": per, "min_db": min(per.values(), default=None)}
        except Exception as e:  # noqa: BLE001 - a model ORT cannot load or run is a result, not a crash
            res[label] = {"error": f"{type(e).__name__}: {one_line(e)}"}
    with open(out_json, "w") as f:
        json.dump(res, f)  # Infinity is fine here: only this script reads it back


# ---- the parent side

def failed(row, step, s):
    row["steps"][step] = s.record()
    row.update(status=f"{step} {'killed' if s.killed else f'exit {s.rc}'}", error=s.killed or s.why())


def prepare(a, name, paths, row):
    """The model and its inputs, made only where missing; False (and the row says why) when that fails."""
    env = {**os.environ, "QTOOL_ZOO": a.zoo_dir}
    cmds = []
    if not os.path.isfile(paths["model"]):
        cmds.append(("fetch", [sys.executable, a.zoo_py("fetch.py"), "--dest", a.zoo_dir, name]))
    for split, n in (("calib", a.calib_n), ("eval", a.eval_n)):
        if not os.path.isfile(os.path.join(paths[split], "index.json")):
            cmds.append((f"inputs {split}", [sys.executable, a.zoo_py("inputs.py"), name, "--split", split,
                                             "--n", n, "--out", paths[split]]))
    for step, cmd in cmds:
        s = run_step(cmd, a, env)
        row["steps"][step] = s.record()
        if not s.ok:
            failed(row, step, s)
            return False
    return True


def catalogue(a, names, strict):
    """The zoo as a `qtool batch` catalogue: each model's file and inputs named through the variables
    QTOOL_ZOO and ZOO_DATA (so the file holds no machine's paths), the step limits this script's, quantize
    --strict when asked."""
    lines = ["# qtool batch catalogue of the zoo (benchmarks/bench_zoo.py --catalogue): run it with",
             "# QTOOL_ZOO=<the models' folder> ZOO_DATA=<NAME/calib, NAME/eval inputs> qtool batch <this file>",
             "[defaults]", f"memory_mb = {a.mem_limit_gb * 1024:g}", f"timeout_s = {a.step_timeout:g}"]
    lines += ["[defaults.quantize]", "strict = true"] if strict else []
    for name in names:
        lines += ["", "[[model]]", f'name = "{name}"', f'path = "${{QTOOL_ZOO}}/{name}.onnx"',
                  f'data = "${{ZOO_DATA}}/{name}/calib"', f'eval_data = "${{ZOO_DATA}}/{name}/eval"']
    return "\n".join(lines) + "\n"


def run_batch(a, names, strict):
    """calibrate, quantize, eval of every model through `qtool batch` on the zoo's catalogue (OUT/zoo.toml),
    its table printed as it goes -> {name: its row of OUT/batch.json}."""
    if not names:
        return {}
    path = os.path.join(a.out, "zoo.toml")
    write_atomic(path, catalogue(a, names, strict))
    env = {**os.environ, "QTOOL_ZOO": a.zoo_dir, "ZOO_DATA": a.data_dir}
    r = subprocess.run([a.qtool, "batch", path, "--out", a.out], env=env, stdin=subprocess.DEVNULL)
    try:
        with open(os.path.join(a.out, "batch.json"), encoding="utf-8") as f:
            return {row["name"]: row for row in json.load(f)["rows"]}
    except OSError:
        raise SystemExit(f"qtool batch wrote no table (exit {r.returncode})") from None


def from_batch(row, b, work):
    """The row's qtool steps from the batch's row of the model; {"qtool": int8 path} when all three succeeded."""
    for step, rec in b["steps"].items():
        row["steps"][step] = rec
    if b["status"] != "ok":
        rc = (b["steps"].get(b["step"]) or {}).get("rc")
        row.update(status=f"{b['step']} {'killed' if b['status'] == 'killed' else f'exit {rc}'}",
                   error=b["reason"])
    if os.path.isfile(os.path.join(work, "quantize.json")):
        row["quantize"] = op_summary(os.path.join(work, "quantize.json"))
        if row["quantize"]["int8_ops"] == 0:
            row["notes"].append("no op in int8")
    if os.path.isfile(os.path.join(work, "eval.json")):
        with open(os.path.join(work, "eval.json"), encoding="utf-8") as f:
            ev = json.load(f)
        row["qtool_eval"] = {k: ev.get(k) for k in ("output_sqnr_db", "top1_agreement", "runtime_check")}
    return {"qtool": os.path.join(work, "model.int8.onnx")} if row["status"] == "ok" else {}


def quantize_again(a, work, strict, row):
    """quantize a second time, in a copy of the calibrated working folder, with a busy loop on one core
    beside it (a machine loaded otherwise than for the first run: nothing quantize decides may follow the
    clock or the load), and compare the int8 files' bytes with the first run's (row["identical"]); the
    copy goes afterwards."""
    again = work + "-again"
    shutil.rmtree(again, ignore_errors=True)
    shutil.copytree(work, again, ignore=shutil.ignore_patterns("ort", "eval.json", "sqnr-*.json", "model.int8.onnx",
                                                               "texts.json"))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if a.loaded_second else None
    try:
        s = run_step([a.qtool, "quantize", "-w", again, "-q"] + (["--strict"] if strict else []), a)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    row["loaded"] = busy is not None
    row["steps"]["quantize again"] = s.record()
    first, second = os.path.join(work, "model.int8.onnx"), os.path.join(again, "model.int8.onnx")
    if s.ok and os.path.isfile(first) and os.path.isfile(second):
        with open(first, "rb") as f1, open(second, "rb") as f2:
            row["identical"] = f1.read() == f2.read()
    else:
        row["identical"] = None
        row["notes"].append(f"second quantize: {s.why()}")
    shutil.rmtree(again, ignore_errors=True)


def texts_changed(a, paths, work, model):
    """For a recognizer: the share of evaluation crops whose decoded text int8 changes (texts_main)."""
    out = os.path.join(work, "texts.json")
    s = run_step([sys.executable, os.path.abspath(__file__), "--threads", a.threads, "--_texts", paths["model"],
                  paths["eval"], out, model], a)
    if not s.ok:
        return {"error": s.why()}
    with open(out) as f:
        return json.load(f)


def run_ort(a, paths, work, row):
    """ORT's int8 model and its u8-weight copy, in a process of its own (its memory is measured apart)."""
    out = os.path.join(work, "ort")
    os.makedirs(out)
    # in its folder: ORT's symbolic shape inference leaves sym_shape_infer_temp.onnx in the current one when it fails
    s = run_step([sys.executable, os.path.abspath(__file__), "--_ort-anchor", paths["model"], paths["calib"], out], a,
                 cwd=out)
    row["steps"]["ort"] = s.record()
    row["notes"] += [x[6:] for x in s.stderr.splitlines() if x.startswith("note: ")]
    if not s.ok:
        row["ort_error"] = s.why()
        return {}
    return {"ort": os.path.join(out, "model.int8.onnx"), "ort_exact": os.path.join(out, "model.int8.u8.onnx")}


def named_like(d, words, depth=2):
    """Entries whose key holds one of `words`, a level down too (quantize.json: optional_steps.fallbacks)."""
    found = {}
    for k, v in d.items():
        if any(w in k.lower() for w in words):
            found[k] = v
        elif isinstance(v, dict) and depth > 1:
            found.update({f"{k}.{kk}": vv for kk, vv in named_like(v, words, depth - 1).items()})
    return found


def op_summary(path):
    """int8 ops, fp32 ops by reason, size, and any record of failures quantize contained."""
    with open(path, encoding="utf-8") as f:
        q = json.load(f)
    nodes, by_reason = q.get("nodes", []), {}
    for n in nodes:
        if n.get("status") == "fp32":
            r = by_reason.setdefault(n.get("reason") or "?", {"count": 0, "ops": []})
            r["count"] += 1
            r["ops"] = sorted(set(r["ops"]) | {n.get("op_type", "?")})
    size = q.get("size_bytes", {})
    inside = sum(b.get("summary", {}).get("int8", 0) for b in q.get("subgraphs", []))  # (If branches)
    return {"int8_ops": sum(n.get("status") == "int8" for n in nodes) + inside,
            "fp32_ops": sum(r["count"] for r in by_reason.values()), "fp32_by_reason": by_reason,
            "summary": q.get("summary"), "size_bytes": size,
            "size_ratio": size["int8"] / size["fp32"] if size.get("fp32") and size.get("int8") else None,
            "step_seconds": q.get("optional_steps", {}).get("seconds"),
            "fallbacks": named_like(q, ("fallback", "warning", "contained"))}


def task_check(a, name, data, model=None):
    s = run_step([sys.executable, a.zoo_py("check.py"), name, "--data", data, "--zoo-dir", a.zoo_dir]
                 + (["--model", model] if model else []), a, {**os.environ, "CHECK_THREADS": str(a.threads)})
    lines = [x for x in s.stdout.splitlines() if x.strip()]
    verdict = "PASS" if s.ok else "FAIL" if s.rc == 1 and not s.killed else "error"
    return {"verdict": verdict, "line": lines[-1] if lines and verdict != "error" else s.why(),
            "seconds": round(s.seconds, 1)}


def zoo_paths(a, name):
    return {"model": os.path.join(a.zoo_dir, f"{name}.onnx"), "calib": os.path.join(a.data_dir, name, "calib"),
            "eval": os.path.join(a.data_dir, name, "eval")}


def checks(a, row, b, strict):
    """After the batch: a model's second quantize, ORT's anchor, the SQNR figures and the task checks;
    every failure becomes part of the row, never an exception."""
    name, paths, work = row["name"], zoo_paths(a, row["name"]), os.path.join(a.out, row["name"])
    models = from_batch(row, b, work)
    if "qtool" in models:
        quantize_again(a, work, strict, row)
        if a.families.get(name) == "ocr-rec":
            row["texts_changed"] = texts_changed(a, paths, work, models["qtool"])
    if not a.no_ort:
        models.update(run_ort(a, paths, work, row))
    row["sqnr"] = measure_sqnr(a, paths, work, models)
    if "error" in row["sqnr"].get("ort", {}):  # ORT wrote a model that it cannot run itself
        row["ort_error"] = row["sqnr"]["ort"]["error"]
    if row.get("ort_error"):
        row["notes"].append(f"ORT n/a ({row['ort_error'][:160]})")
    row["check"] = {"fp32": task_check(a, name, paths["eval"])}
    row["check"].update({k: task_check(a, name, paths["eval"], models[k]) for k in ("qtool", "ort") if k in models})


def measure_sqnr(a, paths, work, models):
    """Each model scored in a process of its own: ONNX Runtime crashes on some int8 graphs (ORT's own
    model of eeg-spindle-seg: a segmentation fault), and that must not take the others' figures."""
    res = {}
    for k, v in models.items():
        out = os.path.join(work, f"sqnr-{k}.json")
        s = run_step([sys.executable, os.path.abspath(__file__), "--threads", a.threads, "--_sqnr", paths["model"],
                      paths["eval"], out, f"{k}={v}"], a)
        if not s.ok:
            res[k] = {"error": s.why() + (" (ONNX Runtime crashed: segmentation fault)" if s.rc == -11 else "")}
            continue
        with open(out) as f:
            res.update(json.load(f))
    for k in ("ort", "ort_exact"):  # a model with nothing quantized is no int8 anchor to compare with
        if k in models and k in res and "error" not in res[k] and not quantizes(models[k]):
            res[k] = {"error": "ORT's quantizer quantized nothing in this model", "fp32_as_is": res[k].get("min_db")}
    return res


def quantizes(path) -> bool:
    """Whether a model holds a QuantizeLinear anywhere (its subgraphs included)."""
    import onnx
    stack = [onnx.load(path, load_external_data=False).graph]
    while stack:
        g = stack.pop()
        for n in g.node:
            if n.op_type == "QuantizeLinear":
                return True
            stack.extend(x.g for x in n.attribute if x.type == onnx.AttributeProto.GRAPH)
    return False


def headline(row, label):
    return row.get("sqnr", {}).get(label, {}).get("min_db")


def ort_best(row):
    got = [v for v in (headline(row, "ort"), headline(row, "ort_exact")) if v is not None]
    return max(got) if got else None


def misses(row):
    """Why this model misses the issue's bar (empty: it meets it)."""
    m = [f"{row['status']}: {row['error']}"] if row["status"] != "ok" else []
    for step in STEPS:
        s = row["steps"].get(step)
        if s and s["seconds"] > BUDGET_S:
            m.append(f"{step} {s['seconds']:.0f} s > {BUDGET_S} s")
    q = row["steps"].get("quantize")
    if q and q["peak_mb"] > QUANT_MB:
        m.append(f"quantize peak {q['peak_mb'] / 1024:.1f} GB > {QUANT_MB // 1024} GB")
    contained = {k: v for k, v in row.get("quantize", {}).get("fallbacks", {}).items() if v}
    if contained:
        m.append("quantize contained failures: " + one_line(json.dumps(contained), 160))
    if row["status"] == "ok":
        qd, od = headline(row, "qtool"), ort_best(row)
        if qd is None:
            m.append(f"qtool SQNR: {row.get('sqnr', {}).get('qtool', {}).get('error', 'not measured')}")
        elif od is not None and qd < od - SQNR_TIE_DB:
            m.append(f"SQNR {qd:.1f} < ORT {od:.1f} dB")
        ck = row["check"]
        if ck["fp32"]["verdict"] == "PASS" and ck.get("qtool", {}).get("verdict") != "PASS":
            m.append(f"check {ck.get('qtool', {}).get('verdict', 'not run')} where fp32 PASSes")
        if row.get("identical") is False:
            m.append("two quantize runs wrote different int8 models")
    return m


def fmt_db(x):
    return "-" if x is None else f"{x:.1f}" if math.isfinite(x) else str(x)


def cells(row):
    def step(name, limit_mb=None):
        s = row["steps"].get(name)
        if not s:
            return "-"
        if s["killed"]:
            return "killed"
        over = s["seconds"] > BUDGET_S or (limit_mb and s["peak_mb"] > limit_mb)
        return f"{s['seconds']:.1f}/{s['peak_mb']:.0f}" + ("!" if over else "")
    q = row.get("quantize", {})
    qd, od = headline(row, "qtool"), ort_best(row)
    ort = "n/a" if row.get("ort_error") else "-" if "ort" not in row.get("sqnr", {}) else \
        f"{fmt_db(headline(row, 'ort'))}/{fmt_db(headline(row, 'ort_exact'))}"
    ck = row.get("check", {})
    return [row["name"], row["status"], step("calibrate"), step("quantize", QUANT_MB), step("eval"),
            f"{100 * q['size_ratio']:.0f}%" if q.get("size_ratio") else "-",
            fmt_db(qd) + ("!" if qd is not None and od is not None and qd < od - SQNR_TIE_DB else ""), ort,
            "/".join(ck.get(k, {}).get("verdict", "-") for k in ("fp32", "qtool", "ort")),
            f"{q['int8_ops']}/{q['fp32_ops']}" if q else "-",
            {True: "identical", False: "DIFFER!", None: "-"}[row.get("identical")],
            "; ".join(row["misses"] + [f"(note: {n})" for n in row["notes"]])]


def text_row(c):
    return " ".join(v.ljust(w) if w else v for v, w in zip(c, WIDTH)).rstrip()


def markdown(rows, machine):
    lines = [f"Zoo run at {machine['commit'][:7]}{' (dirty tree)' if machine['dirty'] else ''}, {machine['date']}; "
             f"`!` marks a miss (step > {BUDGET_S} s, quantize > {QUANT_MB // 1024} GB, SQNR below ORT's).", "",
             "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(r)) + " |" for r in rows]
    lines += ["", f"{sum(bool(r.get('identical')) for r in rows)} of {len(rows)} byte-identical across two quantize runs"
              + (" (the second with a busy loop on one core beside it)." if any(r.get("loaded") for r in rows) else ".")]
    for r in rows:
        t = r.get("texts_changed", {})
        if "changed" in t:
            lines.append(f"- {r['name']}: {t['changed_n']}/{t['samples']} evaluation crops ({100 * t['changed']:.1f} %) "
                         f"read differently by int8 than by fp32 (greedy CTC)")
    return "\n".join(lines) + "\n"


FAMILY = {"ocr-det": "ocr", "ocr-rec": "ocr", "classifier": "classifiers", "bytes": "classifiers",
          "detector": "detectors", "face": "detectors", "segmentation": "text", "text": "text", "signal": "audio",
          "audio": "audio"}
RESULT_COLS = [("model", "model"), ("family", "family"), ("status", "status"), ("calibrate_s", "calibrate s"),
               ("calibrate_mb", "calibrate MB"), ("quantize_s", "quantize s"), ("quantize_mb", "quantize MB"),
               ("eval_s", "eval s"), ("eval_mb", "eval MB"), ("size_pct", "size %"), ("sqnr_db", "qtool dB"),
               ("ort_sqnr_db", "ORT dB here"), ("ort_exact_sqnr_db", "ORT dB exact"), ("fp32", "check fp32"),
               ("int8", "check qtool"), ("ort", "check ORT"), ("int8_ops", "ops int8"), ("fp32_ops", "ops fp32"),
               ("notes", "notes")]


def result_row(row, entry):
    """The figures a results table shows for one zoo model (benchmarks/results_io.py's format)."""
    def db(v):
        if v is None:
            return None
        v = float(v)
        if not math.isfinite(v):
            return "exact (no op int8)" if v > 0 else str(v)
        return round(v, 1)
    q, ck, st = row.get("quantize", {}), row.get("check", {}), row["steps"]
    out = {"model": row["name"], "family": FAMILY.get(entry.get("family"), entry.get("family")),
           "what": entry.get("what", "").split(":")[0], "metric": "zoo task check", "status": row["status"],
           "fp32": ck.get("fp32", {}).get("verdict"), "int8": ck.get("qtool", {}).get("verdict"),
           "ort": ck.get("ort", {}).get("verdict"), "sqnr_db": db(headline(row, "qtool")),
           "ort_sqnr_db": db(headline(row, "ort")) if "ort" in row.get("sqnr", {}) else None,
           "ort_exact_sqnr_db": db(headline(row, "ort_exact")) if "ort_exact" in row.get("sqnr", {}) else None,
           "size_pct": round(100 * q["size_ratio"], 1) if q.get("size_ratio") else None, "speed": None,
           "int8_ops": q.get("int8_ops"), "fp32_ops": q.get("fp32_ops"),
           "notes": "; ".join(row["misses"] + row["notes"]) or None}
    for step in ("calibrate", "quantize", "eval"):
        if st.get(step):
            out[f"{step}_s"], out[f"{step}_mb"] = st[step]["seconds"], st[step]["peak_mb"]
    return out


def write_results(a, rows, info):
    """benchmarks/results/zoo.json, which `make results` turns into tables (only for a run of the whole zoo)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import results_io
    with open(a.zoo_py("ZOO.json"), encoding="utf-8") as f:
        entries = {e["name"]: e for e in json.load(f)}
    prov = results_io.provenance(info_text=info["qtool_info"])
    prov.update(commit=info["commit"], dirty=info["dirty"], date=info["date"])
    path = results_io.write("zoo", "bench_zoo.py", "make zoo", RESULT_COLS,
                            [result_row(r, entries.get(r["name"], {})) for r in rows], prov, a.results or None)
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    doc["title"] = "Every real model: the zoo (make zoo)"
    doc["about"] = ("The default `qtool calibrate`, `quantize --strict` and `eval` on the third-party models of "
                    "`$SHARED/zoo`, ONNX Runtime's `quantize_static` (QDQ, per channel, MinMax) on the same inputs; "
                    "SQNR of each int8 model against fp32 on the evaluation inputs; 'ORT dB here' is what this CPU's "
                    "ONNX Runtime computes, 'exact' its model with u8 weights; the checks are the zoo's task checks.")
    write_atomic(path, json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    return path


def plain(x):
    """JSON has no infinity: an exact output's SQNR is written as the string "inf"."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    return [plain(v) for v in x] if isinstance(x, (list, tuple)) else x


def write_atomic(path, text):
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def machine(a):
    def out(cmd):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return (r.stdout + r.stderr).strip()
    return {"qtool_info": out([a.qtool, "info"]), "date": datetime.datetime.now().astimezone().isoformat("T", "seconds"),
            "commit": out(["git", "-C", ROOT, "rev-parse", "HEAD"]),
            "dirty": bool(out(["git", "-C", ROOT, "status", "--porcelain"]))}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shared", default=os.path.join(ROOT, "..", "shared"))
    p.add_argument("--zoo-dir", default=os.environ.get("QTOOL_ZOO") or "~/.cache/qtool-zoo",
                   help="downloaded models (fetch.py's cache)")
    p.add_argument("--data-dir", default="bench_out/zoo-data", help="generated inputs, NAME/{calib,eval}")
    p.add_argument("--out", default="bench_out/zoo", help="per-model working folders, zoo.json, zoo.md")
    p.add_argument("--models", help="comma-separated subset (default: all of ZOO.json, in its order)")
    p.add_argument("--calib-n", type=int, default=32)
    p.add_argument("--eval-n", type=int, default=16)
    p.add_argument("--step-timeout", type=float, default=900, help=f"kill a step after this (the bar is {BUDGET_S} s)")
    p.add_argument("--mem-limit-gb", type=float, default=8, help="kill a step whose process tree holds more")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads for the SQNR runs and task checks")
    p.add_argument("--no-strict", action="store_true", help="run qtool quantize without --strict")
    p.add_argument("--no-ort", action="store_true", help="skip ORT's quantizer")
    p.add_argument("--quiet-second", dest="loaded_second", action="store_false",
                   help="run the second quantize without the busy loop on one core beside it")
    p.add_argument("--json", help="results (default: OUT/zoo.json)")
    p.add_argument("--catalogue", metavar="PATH", help="only write the zoo's `qtool batch` catalogue (of --models) "
                                                       "to PATH, paths through $QTOOL_ZOO and $ZOO_DATA")
    p.add_argument("--results", help="folder of the results files `make results` reads (default: benchmarks/results; "
                                     "written only when every model of ZOO.json ran)")
    p.add_argument("--_ort-anchor", nargs=3, help=argparse.SUPPRESS)  # MODEL CALIB_DIR OUT_DIR
    p.add_argument("--_sqnr", nargs="+", help=argparse.SUPPRESS)  # FP32 EVAL_DIR OUT_JSON LABEL=PATH...
    p.add_argument("--_texts", nargs=4, help=argparse.SUPPRESS)  # FP32 EVAL_DIR OUT_JSON INT8
    a = p.parse_args(argv)
    for k in ("shared", "zoo_dir", "data_dir", "out"):
        setattr(a, k, os.path.abspath(os.path.expanduser(getattr(a, k))))
    a.json = os.path.abspath(a.json or os.path.join(a.out, "zoo.json"))
    a.zoo_py = lambda script: os.path.join(a.shared, "zoo", script)
    a.qtool = shutil.which("qtool", path=os.path.dirname(sys.executable)) or shutil.which("qtool")
    if not (a._ort_anchor or a._sqnr or a._texts):
        with open(a.zoo_py("ZOO.json"), encoding="utf-8") as f:
            entries = json.load(f)
        zoo = [e["name"] for e in entries]
        a.families = {e["name"]: e.get("family") for e in entries}
        a.names = [m.strip() for m in a.models.split(",") if m.strip()] if a.models else zoo
        unknown = [m for m in a.names if m not in zoo]
        if unknown:
            p.error(f"not in ZOO.json: {', '.join(unknown)}")
        if not a.qtool:
            p.error("no qtool next to this python or on PATH (run it with the venv's python)")
    return a


def child(a):
    """The ORT anchor and the SQNR run, in their own process: a one-line error on stderr, exit 1."""
    try:
        if a._ort_anchor:
            ort_anchor_main(*a._ort_anchor)
        elif a._texts:
            texts_main(*a._texts[:3], a.threads, a._texts[3])
        else:
            sqnr_main(*a._sqnr[:3], a.threads, a._sqnr[3:])
        return 0
    except Exception as e:  # noqa: BLE001
        print(f"{type(e).__name__}: {one_line(e)}", file=sys.stderr)
        return 1


def main(argv=None):
    a = parse(argv)
    if a._ort_anchor or a._sqnr or a._texts:
        return child(a)
    if a.catalogue:
        write_atomic(os.path.abspath(a.catalogue), catalogue(a, a.names, not a.no_strict))
        return 0
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    # --strict (contained failures fail the command) is being added to qtool; use it once it is there.
    strict = not a.no_strict and "--strict" in subprocess.run([a.qtool, "quantize", "--help"], capture_output=True,
                                                               text=True).stdout
    info = machine(a)
    print(f"{len(a.names)} zoo models; qtool quantize {'--strict' if strict else 'without --strict'}"
          f"{'' if strict or a.no_strict else ' (this qtool has no --strict)'}; commit {info['commit'][:7]}"
          f"{' (dirty)' if info['dirty'] else ''}", flush=True)
    settings = {k: getattr(a, k) for k in ("shared", "zoo_dir", "data_dir", "out", "calib_n", "eval_n", "step_timeout",
                                           "mem_limit_gb", "threads", "no_ort")}
    settings.update(strict=strict, budget_s=BUDGET_S, quantize_budget_mb=QUANT_MB)
    rows = []
    for name in a.names:  # each model and its inputs, fetched or made where missing
        rows.append({"name": name, "status": "ok", "error": "", "steps": {}, "notes": []})
        prepare(a, name, zoo_paths(a, name), rows[-1])
    batch = run_batch(a, [r["name"] for r in rows if r["status"] == "ok"], strict)
    print("\n" + text_row(HEAD), flush=True)
    for row in rows:
        if row["status"] == "ok":
            checks(a, row, batch[row["name"]], strict)
        row["misses"] = misses(row)
        print(text_row(cells(row)), flush=True)
        write_atomic(a.json, json.dumps(plain({"machine": info, "args": settings, "rows": rows}), indent=1))
    write_atomic(os.path.join(a.out, "zoo.md"), markdown(rows, info))
    print("\n" + "\n".join(text_row(c) for c in [HEAD] + [cells(r) for r in rows]))
    recognizers = [r for r in rows if "texts_changed" in r]
    if recognizers:
        print("\nOCR recognizers, evaluation crops whose greedy-CTC text int8 changes against fp32:")
        for r in recognizers:
            t = r["texts_changed"]
            print(f"  {r['name']:24s} " + (f"{t['changed_n']}/{t['samples']} ({100 * t['changed']:.1f} %)"
                                             if "changed" in t else t.get("error", "?")))
    same = [r for r in rows if r.get("identical")]
    print(f"{len(same)} of {len(rows)} byte-identical across two quantize runs"
          + (" (the second with a busy loop on one core beside it)" if any(r.get("loaded") for r in rows) else "")
          + (f"; differ or not compared: {', '.join(r['name'] for r in rows if not r.get('identical'))}"
             if len(same) < len(rows) else ""))
    if not a.models:
        print(f"wrote {write_results(a, rows, info)}")
    missed = [r["name"] for r in rows if r["misses"]]
    print(f"{len(rows) - len(missed)} of {len(rows)} models pass" + (f"; missed: {', '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
