"""benchmarks/results.py: the results tables come from benchmarks/results/*.json alone, and name their commit and CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import results  # noqa: E402
import results_io  # noqa: E402

INFO = ("qtool 0.1.0 (python 3.11)\ncpu: Test CPU 9000\nonnxruntime 1.32.0\n"
        "onnxruntime int8 on this CPU: exact: int8 x int8 sums in int32\nkernel ISA: avx2 (best this CPU supports: avx2)\n")


def make(tmp_path):
    res = tmp_path / "results"
    prov = results_io.provenance(info_text=INFO)
    prov.update(commit="0123456789abcdef", date="2030-01-02T03:04:05+00:00", dirty=False)
    cols = [("model", "model"), ("sqnr_db", "qtool dB")]
    results_io.write("zoo", "bench_zoo.py", "make zoo", cols,
                     [{"model": "net-a", "family": "classifiers", "metric": "check", "fp32": "PASS", "int8": "PASS",
                       "ort": "FAIL", "sqnr_db": 31.25, "ort_sqnr_db": 12.0, "size_pct": 27.0},
                      {"model": "vad-b", "family": "audio", "sqnr_db": 20.0}], prov, str(res))
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- results:classifiers -->\nstale\n<!-- /results:classifiers -->\n\ntail\n"
                      "<!-- results:audio -->\n<!-- /results:audio -->\n")
    return res, readme, tmp_path / "docs" / "results.md"


def run(res, readme, doc, *extra):
    return results.main(["--results", str(res), "--readme", str(readme), "--doc", str(doc), *extra])


def test_tables_from_json_alone(tmp_path):
    res, readme, doc = make(tmp_path)
    assert run(res, readme, doc, "--check") == 1
    assert run(res, readme, doc) == 0
    text = readme.read_text()
    assert "stale" not in text and "tail" in text
    assert "| net-a | check | PASS | PASS | FAIL | 31.2 | 12.0 | 27.0 |" in text  # 31.25 rounds half to even
    assert "| vad-b |" in text.split("<!-- results:audio -->")[1]
    assert "commit 0123456" in text and "Test CPU 9000" in text and "kernel ISA avx2" in text
    d = doc.read_text()
    assert "commit 0123456" in d and "Test CPU 9000" in d and "| net-a | 31.2 |" in d
    assert run(res, readme, doc, "--check") == 0
    # a new run's figures change the tables and nothing else
    path = res / "zoo.json"
    j = json.loads(path.read_text())
    j["rows"][0]["sqnr_db"] = 33.0
    path.write_text(json.dumps(j))
    assert run(res, readme, doc, "--check") == 1
    run(res, readme, doc)
    assert "| 33.0 |" in readme.read_text()


def test_transcribed_figures_say_so(tmp_path):
    res, readme, doc = make(tmp_path)
    path = res / "zoo.json"
    j = json.loads(path.read_text())
    j["transcribed_from"] = "README.md at commit 3cb6b62 (a run)"
    path.write_text(json.dumps(j))
    run(res, readme, doc)
    assert "transcribed from README.md at commit 3cb6b62, replaced by the next run" in readme.read_text()


def test_repository_tables_are_up_to_date():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "results.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr + " (run `make results`)"


def test_every_results_file_names_commit_date_cpu():
    folder = os.path.join(ROOT, "benchmarks", "results")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                d = json.load(f)
            assert d.get("commit") and d.get("cpu") and "date" in d and d.get("rows"), name
            for r in d["rows"]:
                if "family" in r:
                    assert r["family"] in dict(results.FAMILIES), (name, r)


def test_zoo_and_ocr_rows():
    import bench_ocr
    import bench_zoo
    row = {"name": "m", "status": "ok", "misses": [], "notes": ["n1"],
           "steps": {"calibrate": {"seconds": 1.5, "peak_mb": 100.0}, "quantize": {"seconds": 2.0, "peak_mb": 200.0}},
           "quantize": {"size_ratio": 0.3, "int8_ops": 5, "fp32_ops": 2},
           "sqnr": {"qtool": {"min_db": 20.04}, "ort": {"min_db": float("-inf")}, "ort_exact": {"min_db": 9.0}},
           "check": {"fp32": {"verdict": "PASS"}, "qtool": {"verdict": "PASS"}, "ort": {"verdict": "FAIL"}}}
    r = bench_zoo.result_row(row, {"family": "ocr-rec", "what": "a reader: more"})
    assert r["family"] == "ocr" and r["sqnr_db"] == 20.0 and r["size_pct"] == 30.0 and r["int8"] == "PASS"
    assert r["quantize_s"] == 2.0 and r["notes"] == "n1" and r["what"] == "a reader"
    assert r["ort_sqnr_db"] == "-inf" and r["ort_exact_sqnr_db"] == 9.0
    json.dumps(r, allow_nan=False)
    v = lambda name, w, h: {"name": name, "e2e": {"word_acc": w}, "crops": {"word_acc": w},  # noqa: E731
                            "det": {"recall": h, "precision": h, "hmean": h}, "quantize_time": "1+2"}
    rows = [v("fp32", 0.9, 0.8), v("qtool int8 det+rec", 0.88, 0.81), v("qtool int8 det", 0.89, 0.81),
            v("qtool int8 rec", 0.88, 0.8), v("ORT int8 det+rec", 0.0, 0.4)]
    out = bench_ocr.result_rows(rows, [{"name": "rec2", "check": {"fp32": {"word_acc": 0.8}, "qtool": {"word_acc": 0.7}}}])
    assert out[0]["fp32"] == 90.0 and out[0]["int8"] == "88.0 (-2.0)" and out[0]["ort"] == "0.0 (-90.0)"
    assert out[1]["int8"] == "81.0 (+1.0)" and out[-1]["int8"] == 70.0 and out[-1]["ort"] is None


def test_a_results_file_names_no_path_of_the_machine_that_wrote_it(tmp_path):
    """An error quoted in a note names a file of the repository: the results file says <repo>, not the
    folder the benchmark ran in (the build-path test refused the zoo's first real run)."""
    note = f"ImportError: cannot import name 'X' ({os.path.join(results_io.ROOT, 'qtool', 'metrics.py')})"
    path = results_io.write("t", "b.py", "make t", [("model", "model"), ("notes", "notes")],
                            [{"model": "m", "notes": note}], {"commit": "c"}, str(tmp_path))
    text = open(path).read()
    assert results_io.ROOT not in text and "<repo>" in text and json.loads(text)["rows"][0]["model"] == "m"
