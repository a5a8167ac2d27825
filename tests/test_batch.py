"""`qtool batch`: a catalogue of small models run to one table; a model that fails or is killed past its
memory limit is a row and the batch goes on; the int8 model is the one the three commands make by hand;
a wrong catalogue is one line and exit 2, before anything runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import save, small_convnet, write_samples
from test_cli import qtool  # (the in-process runner)

FIGURES = ("name", "status", "step", "size", "eval")  # a row's columns that do not depend on timing


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A folder with two small convnets, a corrupt model, calibration and evaluation samples."""
    root = tmp_path_factory.mktemp("batch")
    for seed in (0, 1):
        save(small_convnet(seed=seed), root / f"net{seed}.onnx")
    (root / "corrupt.onnx").write_bytes(b"\x08\x07 not a model")
    rng = np.random.default_rng(3)
    for split, n in (("calib", 8), ("eval", 4)):
        write_samples(root / split, [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(n)])
    return root


def catalogue(folder, text, name="models.toml"):
    path = folder / name
    path.write_text(text)
    return path


MODEL = '[[model]]\npath = "{path}"\ndata = "calib"\neval_data = "eval"\n{extra}\n'
DEFAULTS = "[defaults]\nmemory_mb = 2048\n[defaults.quantize]\nno-sensitivity = true\n\n"


def three(models):
    """net0, the corrupt model, then net1 with its own quantize option."""
    return catalogue(models, DEFAULTS + MODEL.format(path="net0.onnx", extra="")
                     + MODEL.format(path="corrupt.onnx", extra="")
                     + MODEL.format(path="net1.onnx", extra='[model.quantize]\nrounding = "nearest"'))


def table(out):
    with open(out / "batch.json", encoding="utf-8") as f:
        return json.load(f)


def test_catalogue_runs_every_model_and_a_corrupt_one_is_a_row(models, tmp_path, capsys):
    out = tmp_path / "out"
    assert qtool("batch", three(models), "--out", out, "-q") == 1  # one model failed: the table is still written
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 of 3 models failed (corrupt)" in err[0]
    rows = table(out)["rows"]
    assert [r["name"] for r in rows] == ["net0", "corrupt", "net1"]
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
    bad = rows[1]
    assert bad["step"] == "calibrate" and "corrupt.onnx" in bad["reason"] and "\n" not in bad["reason"]
    for r in (rows[0], rows[2]):
        assert set(r["steps"]) == {"calibrate", "quantize", "eval"}
        assert all(s["seconds"] > 0 and s["peak_mb"] > 10 for s in r["steps"].values())
        assert r["size"]["int8"] > 0 and r["size"]["fp32"] > 0
        assert r["eval"]["samples"] == 4 and r["eval"]["output_sqnr_db"] > 20
        assert os.path.isfile(r["int8"])
    assert "--rounding nearest" in rows[2]["steps"]["quantize"]["command"]
    md = (out / "batch.md").read_text()
    assert "2 of 3 models ok" in md and md.count("\n| ") == 4  # the head and three rows
    assert "| corrupt | failed |" in md
    assert not [f for f in os.listdir(out) if f.startswith(".")]  # no temporary file left


def test_int8_model_is_byte_identical_to_the_three_commands_run_by_hand(models, tmp_path):
    out = tmp_path / "out"
    cat = catalogue(models, MODEL.format(path="net1.onnx", extra='[model.quantize]\nrounding = "nearest"'),
                    name="one.toml")
    assert qtool("batch", cat, "--out", out, "-q") == 0
    work = tmp_path / "by-hand"
    for argv in (["calibrate", "--model", models / "net1.onnx", "--data", models / "calib", "-w", work, "-q"],
                 ["quantize", "--rounding", "nearest", "-w", work, "-q"]):
        subprocess.run([sys.executable, "-m", "qtool"] + [str(a) for a in argv], check=True)
    assert (out / "net1" / "model.int8.onnx").read_bytes() == (work / "model.int8.onnx").read_bytes()


def test_memory_limit_kills_the_job_and_the_batch_goes_on(models, tmp_path, capsys):
    cat = catalogue(models, DEFAULTS + MODEL.format(path="net0.onnx", extra="memory_mb = 20")
                    + MODEL.format(path="net1.onnx", extra=""))
    out = tmp_path / "out"
    assert qtool("batch", cat, "--out", out, "-q") == 1
    killed, ok = table(out)["rows"]
    assert killed["status"] == "killed" and killed["step"] == "calibrate"
    assert killed["reason"] == "killed: memory above 20 MB"
    assert killed["steps"]["calibrate"]["peak_mb"] > 20
    assert ok["status"] == "ok"
    assert "calibrate: killed: memory above 20 MB" in (out / "batch.md").read_text()


def test_parallel_jobs_give_the_same_table_in_the_same_order(models, tmp_path):
    figures = []
    for jobs in (1, 2):
        out = tmp_path / f"out{jobs}"
        qtool("batch", three(models), "--out", out, "--jobs", jobs, "-q")
        figures.append([{k: r[k] for k in FIGURES} for r in table(out)["rows"]])
    assert figures[0] == figures[1]
    assert [r["name"] for r in figures[1]] == ["net0", "corrupt", "net1"]


@pytest.mark.parametrize("text, words", [
    ("[[model]\npath = 'a.onnx'", "not valid TOML"),
    ("[[model]]\npath = 'net0.onnx'\ndata = 'calib'\nmemroy_mb = 5\n", "unknown key 'memroy_mb' in model 1"),
    ("[other]\n", "unknown key 'other' at the top"),
    ("[[model]]\npath = 'net0.onnx'\n", "model 1: no 'data'"),
    ("[defaults]\nmemory_mb = -1\n[[model]]\npath = 'net0.onnx'\ndata = 'calib'\n", "memory_mb must be a number above 0"),
    ("[[model]]\npath = 'net0.onnx'\ndata = 'calib'\n[model.quantize]\nexclude-sensitiv = true\n",
     "model 'net0': [quantize] 'exclude-sensitiv': no such option"),
    ("[[model]]\npath = 'net0.onnx'\ndata = 'calib'\n[model.quantize]\nworkdir = 'x'\n", "set by qtool batch"),
    ("[[model]]\npath = 'net0.onnx'\ndata = 'calib'\n[model.calibrate]\nray = 'auto'\n", "set by qtool batch"),
    ("[[model]]\npath = 'net0.onnx'\ndata = 'calib'\n[model.quantize]\ntarget = 'gpu'\n", "'gpu' is not one of"),
    ("[[model]]\npath = 'net0.onnx'\ndata = 'calib'\n[model.calibrate]\nbatch = 'four'\n", "'four' is not a valid integer"),
    ("[[model]]\npath = '${QTOOL_TEST_UNSET_DIR}/net0.onnx'\ndata = 'calib'\n", "$QTOOL_TEST_UNSET_DIR is not set"),
    ("[[model]]\npath = 'net0.onnx'\ndata = 'calib'\n[[model]]\npath = 'sub/net0.onnx'\ndata = 'calib'\n",
     "two models are named 'net0'"),
])
def test_a_wrong_catalogue_is_one_line_and_exit_2_before_anything_runs(models, tmp_path, capsys, text, words):
    out = tmp_path / "out"
    assert qtool("batch", catalogue(tmp_path, text), "--out", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and "models.toml" in err[0], err
    assert not out.exists()


def test_paths_come_from_the_environment_and_the_catalogue_folder(models, tmp_path, monkeypatch):
    monkeypatch.setenv("QTOOL_TEST_MODELS", str(models))
    cat = catalogue(tmp_path, '[[model]]\nname = "first"\npath = "${QTOOL_TEST_MODELS}/net0.onnx"\n'
                              'data = "$QTOOL_TEST_MODELS/calib"\n[model.quantize]\nno-sensitivity = true\n')
    monkeypatch.chdir(models)  # (not the catalogue's folder: its paths do not depend on where qtool runs)
    assert qtool("batch", cat, "--out", tmp_path / "out", "-q", "--only", "first") == 0
    assert table(tmp_path / "out")["rows"][0]["steps"]["calibrate"]["command"].startswith(
        f"qtool calibrate --model {models / 'net0.onnx'} --data {models / 'calib'}")


def test_the_table_never_replaces_an_input(models, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    cat = catalogue(out, MODEL.format(path=models / "net0.onnx", extra="").replace('"calib"', f'"{models / "calib"}"')
                    .replace('"eval"', f'"{models / "eval"}"'), name="batch.md")
    before = cat.read_bytes()
    assert qtool("batch", cat, "--out", out) == 2
    assert "the table (markdown) is the catalogue" in capsys.readouterr().err
    assert cat.read_bytes() == before


def test_the_zoo_catalogue_names_no_machine_path_and_qtool_batch_reads_it(tmp_path, monkeypatch):
    import argparse
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import bench_zoo
    from qtool.batch import catalogue as cat
    from qtool.commands import batch_steps
    a = argparse.Namespace(mem_limit_gb=8, step_timeout=900)
    text = bench_zoo.catalogue(a, ["mtcnn-pnet", "silero-vad"], strict=True)
    assert str(tmp_path) not in text and "${QTOOL_ZOO}/mtcnn-pnet.onnx" in text
    monkeypatch.setenv("QTOOL_ZOO", str(tmp_path / "models"))
    monkeypatch.setenv("ZOO_DATA", str(tmp_path / "data"))
    c = cat.load(str(catalogue(tmp_path, text, "zoo.toml")))
    assert [e.name for e in c.entries] == ["mtcnn-pnet", "silero-vad"]
    e = c.entries[1]
    assert e.path == str(tmp_path / "models" / "silero-vad.onnx")
    assert e.eval_data == str(tmp_path / "data" / "silero-vad" / "eval")
    assert e.limits == cat.Limits(8192, 900) and e.options["quantize"] == {"strict": True}
    argv = dict(batch_steps.lines(e, "W"))  # (parsed by each command)
    assert argv["quantize"] == ["quantize", "--strict", "-w", "W", "-q"]  # what bench_zoo ran before the batch


def test_a_folder_of_the_user_named_like_a_model_is_never_emptied(models, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "net0").mkdir(parents=True)
    (out / "net0" / "notes.txt").write_text("mine")
    cat = catalogue(tmp_path, MODEL.format(path=models / "net0.onnx", extra="").replace('"calib"', f'"{models / "calib"}"')
                    .replace('"eval"', f'"{models / "eval"}"'))
    assert qtool("batch", cat, "--out", out) == 2
    assert "not a qtool working folder" in capsys.readouterr().err
    assert (out / "net0" / "notes.txt").read_text() == "mine"


def test_a_working_folder_that_cannot_be_made_is_that_models_row(models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "net0").write_text("a file where the working folder goes")
    from qtool.batch.job import Job, run_job
    from qtool.batch.catalogue import Entry
    row = run_job(Job(Entry("net0", str(models / "net0.onnx"), str(models / "calib")), str(out / "net0"), ()))
    assert row["status"] == "failed" and "cannot make the working folder" in row["reason"] and not row["steps"]


def test_an_exact_model_reads_exact_in_the_table_not_a_huge_number():
    """eval.json holds an infinite SQNR (int8 equals fp32: no op in int8) as 1e308; the table says "exact"."""
    from qtool.batch.table import cells
    row = {"name": "m", "status": "ok", "steps": {}, "size": None, "step": "", "reason": "",
           "eval": {"output_sqnr_db": 1e308, "top1_agreement": None}}
    assert "exact" in cells(row) and not any("e+" in c or len(c) > 40 for c in cells(row))
    row["eval"]["output_sqnr_db"] = 21.37
    assert "21.4" in cells(row)
