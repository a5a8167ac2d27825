"""Never destroy a user's file (issue 51, cases 1, 3, 5, 6), in test_hostile.py's style: each case of the
probe with the files made here. Expected: an output that is an input (or another output) is one line
naming both paths, exit 2, and nothing is written; a file qtool did not make is never deleted; a working
directory that cannot be written is refused before the work, and a write that fails after it still shows
the figures; what the manifest and the model record is what was read."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys

import onnx
import pytest

from helpers import save, small_convnet
from test_hostile import int8, one_line_error, project, qtool  # noqa: F401 (fixtures)

W = "qtool_work"


def _tree(root) -> dict:
    """relative path -> bytes of every file under `root` (what "nothing written" compares)."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            if not os.path.islink(p):
                out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


# --- case 1: an output path that is an input, or another output --------------------------------------------

COLLISIONS = [  # (command line, the two paths the error names)
    (["quantize", "-o", "net.onnx"], ["net.onnx", "fp32 model"]),
    (["quantize", "-o", "link.onnx"], ["link.onnx", "fp32 model"]),  # a symlink to the fp32 model
    (["quantize", "-o", "hard.onnx"], ["hard.onnx", "fp32 model"]),  # a hard link to it
    (["quantize", "-o", "data/../net.onnx"], ["data/../net.onnx", "fp32 model"]),
    (["calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "--json", "net.onnx"], ["net.onnx", "--json"]),
    (["calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "--json", "cfg.toml"], ["cfg.toml", "--config"]),
    (["calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "--json", "data/img0000.png"],
     ["data/img0000.png", "data folder"]),
    (["quantize", "--json", "net.onnx"], ["net.onnx", "--json"]),
    (["eval", "--json", "net.onnx"], ["net.onnx", "--json"]),
    (["eval", "--json", f"{W}/calibration.json"], ["calibration.json", "calibration table"]),
    (["eval", "--json", f"{W}/manifest.json"], ["manifest.json", "manifest"]),
    (["inspect", "net.onnx", "--json", "net.onnx"], ["net.onnx", "--json"]),
    (["bench", "--json", f"{W}/model.int8.onnx", "--rounds", "1"], ["model.int8.onnx", "int8 model"]),
    (["quantize", "-o", f"{W}/sensitivity.json"], ["sensitivity.json", "sensitivity report"]),
    (["quantize", "-o", f"{W}/calibration.json"], ["calibration.json", "calibration table"]),
    (["quantize", "-o", f"{W}/quantize.json"], ["quantize.json", "quantize report"]),
    (["quantize", "-o", "x.onnx", "--json", "x.onnx"], ["x.onnx", "--json", "int8 model (-o)"]),
]


@pytest.mark.parametrize("args,needles", COLLISIONS, ids=[" ".join(a) for a, _ in COLLISIONS])
def test_an_output_that_is_an_input_is_refused_and_nothing_written(int8, capsys, args, needles):  # noqa: F811
    os.symlink("net.onnx", "link.onnx")
    os.link("net.onnx", "hard.onnx")
    before = _tree(".")
    capsys.readouterr()
    assert qtool(*args) == 2
    one_line_error(capsys.readouterr().err, *needles)
    assert _tree(".") == before  # nothing written, nothing replaced
    assert not os.path.exists("x.onnx")


def test_a_new_output_beside_the_inputs_is_written(int8, capsys):  # noqa: F811
    """The rule refuses collisions only: outputs of their own, in the data folder's parent, go through."""
    assert qtool("quantize", "-q", "--no-sensitivity", "-o", "net.int8.onnx", "--json", "q.json") == 0
    assert onnx.load("net.int8.onnx").graph.node and json.load(open("q.json"))["int8_model"].endswith("net.int8.onnx")
    assert qtool("eval", "-q", "--json", "data/eval.json") == 0  # (not a file the data folder's reader takes)


# --- case 3: temporary files: only those qtool proves it made are removed ----------------------------------

def test_files_named_like_temporary_ones_are_never_deleted(int8):  # noqa: F811
    """`echo data > out/.tmp-99999-notes.txt; qtool eval --json out/eval.json` deleted the user's file
    (a sweep of `.tmp-<dead pid>-*`): neither there nor in the working directory is such a file touched."""
    os.makedirs("out")
    mine = ["out/.tmp-99999-notes.txt", f"{W}/.tmp-99999-notes.txt", f"{W}/.qtool-tmp-notes.txt", "out/.qtool-tmp-x"]
    for p in mine:
        open(p, "w").write("data")
    assert qtool("eval", "-q", "--json", "out/eval.json") == 0
    assert qtool("quantize", "-q", "--no-sensitivity", "-o", "out/m.int8.onnx") == 0
    for p in mine:
        assert open(p).read() == "data", p


def test_temporary_files_of_a_killed_run_are_removed_by_the_next(project):  # noqa: F811
    """A run killed (SIGKILL) while writing in its working directory leaves its temporary file; the next run
    removes it, as its registry lists it. One left elsewhere stays (qtool cannot prove it made it)."""
    code = f"""
import os, signal
from qtool import tempfiles
from qtool.workdir import Workdir
with Workdir({W!r}).lock(create=True):
    fd, tmp = tempfiles.make(os.path.join({W!r}, "calibration.json"))
    os.write(fd, b"half a file")
    fd, out = tempfiles.make(os.path.join("out", "eval.json"))
    print(tmp, out, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    tmp, out = r.stdout.split()
    assert os.path.exists(tmp) and os.path.exists(out)
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert not os.path.exists(tmp)
    assert os.path.exists(out)  # (outside the working directory: left alone)
    assert not [f for f in os.listdir(W) if f.startswith(".qtool")]  # registry gone with nothing left


@pytest.mark.parametrize("link", [os.symlink, os.link])
def test_a_registry_that_is_a_link_is_never_written_through(project, capsys, link):  # noqa: F811
    """The registry planted as a symlink or hard link to a user's file: qtool neither appends to that file
    nor removes the link; one line says so."""
    os.makedirs(W)
    open("victim.txt", "w").write("data")
    link(os.path.abspath("victim.txt"), f"{W}/.qtool-temp-files")
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 1
    one_line_error(capsys.readouterr().err, ".qtool-temp-files", "not a file of its own")
    assert open("victim.txt").read() == "data" and os.path.lexists(f"{W}/.qtool-temp-files")


# --- case 5: a working directory that cannot be written; a write that fails after the work ----------------

@pytest.fixture
def read_only_workdir(monkeypatch):
    """Creating a file in the working directory fails as on a read-only filesystem (root ignores mode bits):
    every temporary file qtool makes is created with os.open(O_CREAT | O_EXCL)."""
    real = os.open
    wd = os.path.realpath(W)

    def ro_open(path, flags, *a, **k):
        if flags & os.O_CREAT and os.path.realpath(os.fspath(path)).startswith(wd + os.sep):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real(path, flags, *a, **k)
    monkeypatch.setattr(os, "open", ro_open)


def test_eval_on_a_read_only_workdir_fails_before_evaluating(int8, capsys, monkeypatch, read_only_workdir):  # noqa: F811
    from qtool.evaluate import from_workdir

    def never(*a, **k):
        raise AssertionError("the evaluation ran before the manifest was checked writable")
    monkeypatch.setattr(from_workdir, "evaluate", never)
    monkeypatch.setattr(from_workdir, "evaluate_tensors", never)
    capsys.readouterr()
    assert qtool("eval", "--json", "eval.json") == 1
    one_line_error(capsys.readouterr().err, "manifest.json", "Read-only file system")


@pytest.mark.parametrize("command", [["eval"], ["quantize", "--no-sensitivity"],
                                     ["calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml"]])
def test_a_late_write_failure_prints_the_figures_first(int8, capsys, monkeypatch, command):  # noqa: F811
    """The manifest cannot be written after the work (the disk filled up meanwhile): the figures are printed
    and --json written first, then one error line, exit 1."""
    from qtool.errors import QtoolError
    from qtool.workdir import Workdir

    def full(self, drop=(), **entries):
        raise QtoolError(f"{self.file('manifest.json')}: cannot write (No space left on device)")
    monkeypatch.setattr(Workdir, "update", full)
    capsys.readouterr()
    assert qtool(*command, "--json", "figures.json") == 1
    out, err = capsys.readouterr()
    one_line_error(err, "manifest.json", "No space left")
    assert {"eval": "output SQNR", "quantize": "quantized in", "calibrate": "calibrated"}[command[0]] in out
    assert json.load(open("figures.json"))


# --- case 6: the bytes read are the bytes recorded ---------------------------------------------------------

def test_a_table_replaced_while_quantize_runs_is_not_recorded(project, monkeypatch):  # noqa: F811
    """calibration.json replaced during quantize (another table, of another calibration): the model is
    built from the table read, and the manifest and the model's metadata record that table's hash."""
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q", "-w", "other", "--limit", "3") == 0
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    table = f"{W}/calibration.json"
    read = hashlib.sha256(open(table, "rb").read()).hexdigest()
    other = open("other/calibration.json", "rb").read()
    assert hashlib.sha256(other).hexdigest() != read
    import qtool.quantize.run as run
    real = run.make_plan

    def replaced(*a, **k):  # (runs once the inputs are read: the plan of the fused graph)
        open(table, "wb").write(other)
        return real(*a, **k)
    monkeypatch.setattr(run, "make_plan", replaced)
    assert qtool("quantize", "-q", "--no-sensitivity") == 0
    m = json.load(open(f"{W}/manifest.json"))
    assert m["quantize"]["table_sha256"] == read
    meta = {p.key: p.value for p in onnx.load(f"{W}/model.int8.onnx").metadata_props}
    assert meta["qtool.table_sha256"] == read


def test_recorded_hashes_are_of_the_bytes_written(project):  # noqa: F811
    """What calibrate and quantize record for the files they wrote is those files' sha256."""
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert qtool("quantize", "-q", "--no-sensitivity") == 0
    m = json.load(open(f"{W}/manifest.json"))

    def sha(p):
        return hashlib.sha256(open(p, "rb").read()).hexdigest()
    assert m["calibrate"]["table_sha256"] == sha(f"{W}/calibration.json")
    assert m["calibrate"]["fused_sha256"] == sha(f"{W}/fused.onnx")
    assert m["calibrate"]["model_sha256"] == sha("net.onnx")
    assert m["quantize"]["int8_sha256"] == sha(f"{W}/model.int8.onnx")
