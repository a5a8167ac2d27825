#!/usr/bin/env python3
"""qtool's three steps on the models the `onnx` package ships for its backend tests.

The installed onnx wheel carries about 150 small real exports under onnx/backend/test/data: PyTorch's
converted layers and operators (IR 3, opsets 6-9: Conv1d/2d/3d with groups and dilations, pads,
pooling, PReLU, GLU...), the `light_*` CNNs (AlexNet, DenseNet-121, Inception v1/v2, ResNet-50,
ShuffleNet, SqueezeNet, VGG-19, ZFNet-512 at opset 9), sequence and string models. Old exporters'
conventions (initializers listed as inputs, Dropout masks, attribute-form ops) are what they test.

Each model runs in its own process: calibrate on its test input and 7 perturbed copies, quantize with
the defaults, eval, then ONNX Runtime on the int8 model against fp32. Outcomes:
  ok        int8 model written, ORT runs it, every output the fp32 shape and finite where fp32 is
  refused   a one-line qtool error; "expected" when ONNX Runtime cannot load the fp32 model either
  FAIL      a traceback, a timeout, an internal error, or an int8 output of the wrong shape / NaN
Exit 1 when any model FAILs. Results: OUT/backend.json, OUT/backend.md.

  python benchmarks/bench_onnx_backend.py --out DIR [--jobs 2] [--match Conv]
  python benchmarks/bench_onnx_backend.py --write-node-tests NODE_DIR   # onnx's ~1900 one-op tests
  python benchmarks/bench_onnx_backend.py --dir NODE_DIR --out DIR
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

TIMEOUT_S = 300


def backend_models(match=None, root=None):
    """The installed onnx package's test models, or the test folders (model.onnx + test_data_set_0) under
    `root`: onnx's node tests, which the wheel no longer carries, are written by
    `onnx.backend.test.case.node.collect_testcases()` (see --write-node-tests)."""
    import onnx
    if root is None:
        root = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
        found = sorted(d for d in glob.glob(os.path.join(root, "*", "*")) if os.path.isfile(os.path.join(d, "model.onnx")))
        found += sorted(glob.glob(os.path.join(root, "light", "*.onnx")))
    else:
        found = sorted(d for d in glob.glob(os.path.join(root, "*")) if os.path.isfile(os.path.join(d, "model.onnx")))
    return [p for p in found if not match or match in os.path.basename(p.rstrip("/"))]


def write_node_tests(out):
    """onnx's ~1900 node test cases (one op each, every opset's variants) as test folders under `out`."""
    import numpy as np
    from onnx import TensorProto, numpy_helper
    from onnx.backend.test.case.node import collect_testcases
    n = 0
    for case in collect_testcases():
        d = os.path.join(out, case.name, "test_data_set_0")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(out, case.name, "model.onnx"), "wb") as f:
            f.write(case.model.SerializeToString())
        for j, x in enumerate(case.data_sets[0][0] if case.data_sets else []):
            vi = case.model.graph.input[j]
            if not vi.type.HasField("tensor_type"):
                break
            t = x if isinstance(x, TensorProto) else numpy_helper.from_array(np.asarray(x), vi.name)
            with open(os.path.join(d, f"input_{j}.pb"), "wb") as f:
                f.write(t.SerializeToString())
        n += 1
    return n


def name_of(path):
    return os.path.basename(path)[:-5] if path.endswith(".onnx") else os.path.basename(path)


def _inputs(path):
    """The test's own inputs ({name: array}), or seeded normal values for a model without any."""
    import numpy as np
    import onnx
    from onnx import numpy_helper
    mpath = path if path.endswith(".onnx") else os.path.join(path, "model.onnx")
    m = onnx.load(mpath, load_external_data=False)
    inits = {t.name for t in m.graph.initializer}
    real = [vi for vi in m.graph.input if vi.name not in inits]
    files = sorted(glob.glob(os.path.join(os.path.dirname(mpath), "test_data_set_0", "input_*.pb")))
    if files:
        out = {}
        for vi, f in zip(real, files):
            t = onnx.TensorProto()
            with open(f, "rb") as fh:
                t.ParseFromString(fh.read())
            out[vi.name] = numpy_helper.to_array(t)
        return mpath, out
    rng = np.random.default_rng(0)
    return mpath, {vi.name: rng.standard_normal([d.dim_value if d.dim_value > 0 else 1
                                                 for d in vi.type.tensor_type.shape.dim]).astype(np.float32)
                   for vi in real}


def run_one(path, work):
    """In the child: the three steps and the ORT comparison, as one JSON-able dict."""
    import numpy as np
    res = {"model": name_of(path)}
    try:
        mpath, feeds = _inputs(path)
        res["inputs"] = {k: [list(v.shape), str(v.dtype)] for k, v in feeds.items()}
        rng = np.random.default_rng(1)
        samples = [{k: (v + 0.05 * (np.std(v) + 1e-3) * rng.standard_normal(v.shape)).astype(v.dtype)
                    if v.dtype.kind == "f" and i else v for k, v in feeds.items()} for i in range(8)]
        import onnxruntime as ort
        from qtool.api import calibrate, evaluate, quantize
        from qtool.errors import QtoolError
        try:
            ort.InferenceSession(mpath, providers=["CPUExecutionProvider"])
            res["ort_loads_fp32"] = True
        except Exception:
            res["ort_loads_fp32"] = False
        t0 = time.time()
        try:
            calibrate(mpath, samples, workdir=work)
            q = quantize(work)
            r = evaluate(workdir=work, data=samples)
        except QtoolError as e:
            res["outcome"] = "refused" if "internal error" not in str(e) else "FAIL"
            res["message"] = str(e).splitlines()[0][:300]
            return res
        res["seconds"] = round(time.time() - t0, 1)
        res["summary"] = q.report.get("summary")
        res["eval_sqnr_db"] = r.get("output_sqnr_db")
        s8 = ort.InferenceSession(q.path, providers=["CPUExecutionProvider"])
        s32 = ort.InferenceSession(mpath, providers=["CPUExecutionProvider"])
        problems, sqnr = [], []
        for name, a, b in zip([o.name for o in s32.get_outputs()], s32.run(None, samples[0]), s8.run(None, samples[0])):
            if isinstance(a, list) or isinstance(b, list):  # a sequence output: its tensors one by one
                if len(a) != len(b) or any(np.shape(x) != np.shape(y) for x, y in zip(a, b)):
                    problems.append(f"{name}: sequence of {len(a)} -> {len(b)} tensors or shapes differ")
                continue
            a, b = np.asarray(a), np.asarray(b)
            if a.shape != b.shape:
                problems.append(f"{name}: shape {a.shape} -> {b.shape}")
            elif a.dtype.kind == "f" and np.isfinite(a).all() and not np.isfinite(b).all():
                problems.append(f"{name}: NaN/inf in int8 only")
            elif a.dtype.kind == "f":
                e = float(np.sum((a.astype(np.float64) - b) ** 2))
                sqnr.append(round(10 * np.log10(float(np.sum(a.astype(np.float64) ** 2)) / e), 1) if e > 0 else "exact")
        res["ort_sqnr_db"] = sqnr
        res["outcome"] = "FAIL" if problems else "ok"
        if problems:
            res["message"] = "; ".join(problems)
    except Exception as e:  # noqa: BLE001 - the bench reports every crash
        res["outcome"] = "FAIL"
        res["message"] = f"{type(e).__name__}: {e}"[:300]
        res["traceback"] = traceback.format_exc()[-2000:]
    return res


def child(path):
    with tempfile.TemporaryDirectory(prefix="qtool-backend-") as work:
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, __file__, "--one", path, "--work", work], capture_output=True,
                               text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"model": name_of(path), "outcome": "FAIL", "message": f"timeout after {TIMEOUT_S} s"}
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{\"model\"")]
        if p.returncode or not lines:
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or [""]
            return {"model": name_of(path), "outcome": "FAIL", "message": f"exit {p.returncode}: {tail[0][:300]}"}
        r = json.loads(lines[-1])
        r["wall_s"] = round(time.time() - t0, 1)
        return r


def verdict(r):
    if r["outcome"] == "refused" and not r.get("ort_loads_fp32", True):
        return "refused (expected: ORT cannot load the fp32 model)"
    return r["outcome"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out/backend")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--match", help="only models whose name contains this")
    ap.add_argument("--dir", help="test folders (model.onnx + test_data_set_0/input_*.pb) to run instead")
    ap.add_argument("--write-node-tests", metavar="DIR", help="write onnx's node test cases into DIR and stop")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        import warnings
        warnings.simplefilter("ignore")
        print(json.dumps(run_one(a.one, a.work), default=str))
        return 0
    if a.write_node_tests:
        import warnings
        warnings.simplefilter("ignore")
        print(f"{write_node_tests(a.write_node_tests)} node tests written to {a.write_node_tests}")
        return 0
    models = backend_models(a.match, a.dir)
    if not models:
        print("no backend-test models found in the installed onnx package", file=sys.stderr)
        return 1
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    with ThreadPoolExecutor(a.jobs) as ex:
        results = list(ex.map(child, models))
    rows = ["| model | outcome | int8/fp32 ops | ORT SQNR dB | note |", "|---|---|---|---|---|"]
    for r in results:
        s = r.get("summary") or {}
        rows.append(f"| {r['model']} | {verdict(r)} | {s.get('int8', 0)}/{s.get('fp32', 0)} | "
                    f"{', '.join(map(str, r.get('ort_sqnr_db', [])))} | {r.get('message', '')[:160]} |")
    counts = {}
    for r in results:
        counts[verdict(r)] = counts.get(verdict(r), 0) + 1
    line = f"{len(results)} models in {time.time() - t0:.0f} s: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    with open(os.path.join(a.out, "backend.json"), "w") as f:
        json.dump({"results": results, "counts": counts}, f, indent=1, default=str)
    with open(os.path.join(a.out, "backend.md"), "w") as f:
        f.write("\n".join(rows) + "\n\n" + line + "\n")
    for r in results:
        if r["outcome"] != "ok":
            print(f"{r['model']:45s} {verdict(r)}: {r.get('message', '')[:150]}")
    print(line)
    return 1 if any(r["outcome"] == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
