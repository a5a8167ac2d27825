"""Results files: what a benchmark measured, written where `make results` reads it.

Each benchmark that feeds a table writes benchmarks/results/NAME.json:

    {"benchmark": "bench_zoo.py", "command": "make zoo",
     "commit": "<git HEAD>", "dirty": false, "date": "<ISO 8601>",
     "cpu": "<the cpu: line of qtool info>", "isa": "<its kernel ISA line>", "ort_int8": "<its onnxruntime int8 line>",
     "columns": [[key, header], ...],          # the table docs/results.md shows for this file
     "rows": [{...}, ...]}                      # one per model (or variant)

A row that belongs in the README's summary carries `family` (classifiers, detectors, ocr, text, audio) and the
summary keys: model, metric, fp32, int8, ort (the task's own figure for fp32, qtool's int8 and ONNX Runtime's
quantize_static), sqnr_db, ort_sqnr_db, size_pct (the int8 file as % of fp32's), speed (ORT int8 ms against fp32 ms).
A cell the benchmark did not measure is absent or null and prints empty. `benchmarks/results.py` (`make results`)
turns these files, and nothing else, into the tables.
"""
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.environ.get("QTOOL_RESULTS") or os.path.join(ROOT, "benchmarks", "results")


def run_out(cmd):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"


def info_lines(info_text):
    """The lines of `qtool info` a table names: the CPU, the kernel ISA, what this CPU's ORT int8 computes."""
    pick = {"cpu": "cpu:", "isa": "kernel ISA:", "ort_int8": "onnxruntime int8 on this CPU:"}
    got = {k: "" for k in pick}
    for line in info_text.splitlines():
        for k, prefix in pick.items():
            if line.startswith(prefix) and not got[k]:
                got[k] = line[len(prefix):].strip()
    return got


def provenance(qtool=None, info_text=None):
    """commit, date and the CPU lines of `qtool info` for a results file (`qtool`: the command, default this
    Python's `-m qtool`)."""
    if info_text is None:
        info_text = run_out((qtool if isinstance(qtool, list) else [qtool] if qtool else [sys.executable, "-m", "qtool"])
                         + ["info"])
    prov = {"commit": run_out(["git", "-C", ROOT, "rev-parse", "HEAD"]),
            "dirty": bool(run_out(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"])),
            "date": datetime.datetime.now().astimezone().isoformat("T", "seconds")}
    prov.update(info_lines(info_text))
    return prov


def scrub(text: str) -> str:
    """A results file names no path of the machine that wrote it (an error message in a note quotes one):
    the repository, $QTOOL_ZOO and the home folder are written as <repo>, $QTOOL_ZOO and ~."""
    for path, name in ((ROOT, "<repo>"), (os.environ.get("QTOOL_ZOO"), "$QTOOL_ZOO"), (os.path.expanduser("~"), "~")):
        if path and len(path) > 1:
            text = text.replace(path.rstrip("/"), name)
    return text


def write(name, benchmark, command, columns, rows, prov, directory=None, title=None, about=None):
    """Write benchmarks/results/NAME.json (atomically) and return its path; `title` and `about` head its
    table in docs/results.md."""
    directory = directory or RESULTS_DIR
    os.makedirs(directory, exist_ok=True)
    doc = {"benchmark": benchmark, "command": command, **prov,
           "columns": [list(c) for c in columns], "rows": rows}
    doc.update({k: v for k, v in (("title", title), ("about", about)) if v is not None})
    path = os.path.join(directory, f"{name}.json")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(scrub(json.dumps(doc, indent=1, ensure_ascii=False, allow_nan=False)) + "\n")
    os.replace(tmp, path)
    return path
