"""The `qtool` command: help, the calibrate -> quantize -> eval flow in a working directory, exit codes,
one-line errors, JSON reports, and no partial output when a run is interrupted."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import warnings

import numpy as np
import pytest

from helpers import save, small_convnet, write_config, write_images
from qtool import cli


def qtool(*args):
    """Run `qtool ARGS` in-process: (exit code, stdout, stderr) via capsys is read by the caller."""
    with warnings.catch_warnings():
        try:
            cli.main([str(a) for a in args])
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


@pytest.fixture
def project(tmp_path, monkeypatch):
    """cwd = a fresh folder holding net.onnx, cfg.toml and an ImageFolder data/ (3 classes x 4 images)."""
    monkeypatch.chdir(tmp_path)
    save(small_convnet(), tmp_path / "net.onnx")
    write_config(tmp_path / "cfg.toml")
    for k, cls in enumerate(("class_a", "class_b", "class_c")):
        write_images(tmp_path / "data" / cls, 4, seed=10 + k)
    return tmp_path


def _listing(folder):
    return sorted(os.path.relpath(os.path.join(r, f), folder) for r, _, fs in os.walk(folder) for f in fs)


def _no_temp_files(folder):
    return [f for f in _listing(folder) if os.path.basename(f).startswith(".tmp")]


# --- help -------------------------------------------------------------------------------------------------

def _commands():
    return sorted(cli.cli.commands)


@pytest.mark.parametrize("cmd", [None] + _commands())
def test_help_exits_0_and_shows_example(cmd, capsys):
    args = ([cmd] if cmd else []) + ["--help"]
    assert qtool(*args) == 0
    out = capsys.readouterr().out
    assert "Usage:" in out and "Example" in out


def test_required_commands_exist():
    assert {"calibrate", "quantize", "eval"} <= set(_commands())


def _example_lines(text):
    lines = text.split("Example")[1].splitlines()[1:]
    return [ln.strip() for ln in lines if ln.strip().startswith("qtool ")]


@pytest.mark.parametrize("cmd", _commands())
def test_command_help_examples_use_real_options(cmd):
    cmd_obj = cli.cli.commands[cmd]
    opts = {o for p in cmd_obj.params for o in p.opts + p.secondary_opts}
    for line in _example_lines(cmd_obj.help):
        words = shlex.split(line)
        assert words[1] == cmd
        for w in words[2:]:
            if w.startswith("-"):
                assert w.split("=")[0] in opts, f"`{line}`: {cmd} has no option {w}"


def test_top_level_help_examples_use_real_options():
    for line in _example_lines(cli.cli.help):
        words = shlex.split(line)
        opts = {o for p in cli.cli.commands[words[1]].params for o in p.opts + p.secondary_opts}
        for w in words[2:]:
            if w.startswith("-"):
                assert w.split("=")[0] in opts, f"`{line}`: {words[1]} has no option {w}"


# --- the three-step flow ----------------------------------------------------------------------------------

def test_calibrate_quantize_eval_flow_in_workdir(project, capsys):
    assert qtool("calibrate", "--model", "net.onnx", "--data", "data", "--config", "cfg.toml", "--every", "2",
                 "-q", "--json", "cal.json") == 0
    wd = project / "qtool_work"
    assert {"fused.onnx", "calibration.json", "manifest.json"} <= set(os.listdir(wd))
    cal = json.load(open("cal.json"))
    assert cal["n_samples"] == 6 and cal["skipped"] == [] and cal["method"] == "auto"
    assert cal["graph_cleanup"] == {"fold_batchnorm": 3, "pair_channels": 1} and cal["tensors"] >= 6

    assert qtool("quantize", "-q", "--json", "q.json") == 0  # no paths: everything from the workdir
    assert os.path.exists(wd / "model.int8.onnx") and os.path.exists(wd / "quantize.json")
    rep = json.load(open("q.json"))
    assert rep["summary"]["int8"] == 6 and rep["int8_model"] == str(wd / "model.int8.onnx")
    assert {"nodes", "notes", "layers", "size_bytes", "method", "excluded", "bias_correction"} <= set(rep)
    # the default target: pair-safe weights, and uint8 + 128 for the cheap layers pair-safety costs (a reason each)
    enc = rep["encodings"]
    assert rep["target"] == "portable" and enc.get("pair-safe", 0) + enc.get("u8", 0) >= 2
    assert len(rep["encoding_choice"]) == enc.get("u8", 0)
    import onnx
    meta = {p.key: p.value for p in onnx.load(wd / "model.int8.onnx").metadata_props}
    assert meta["qtool.target"] == "portable"

    capsys.readouterr()
    assert qtool("eval", "--json", "e.json") == 0  # no paths either
    out = capsys.readouterr().out
    assert "6 images" in out and "calibration images excluded" in out
    r = json.load(open("e.json"))
    assert r["n_images"] == 6  # the held-out half of the 12 images
    assert 0.0 <= r["top1_agreement"] <= 1.0
    for k in ("fp32", "int8"):
        assert set(r[k]) >= {"top1", "top5"} and 0.0 <= r[k]["top1"] <= r[k]["top5"] <= 1.0
    assert r["top1_delta_pt"] == pytest.approx(100 * (r["int8"]["top1"] - r["fp32"]["top1"]))
    assert r["output_sqnr_db"] > 20
    m = json.load(open(wd / "manifest.json"))
    assert set(m) == {"calibrate", "quantize", "eval"} and m["eval"]["n_images"] == 6


def test_eval_without_labels_has_no_accuracy_keys(project):
    flat = project / "flat"
    write_images(flat, 4, seed=3)
    assert qtool("calibrate", "-m", "net.onnx", "-d", "flat", "-c", "cfg.toml", "-q") == 0
    assert qtool("quantize", "-q") == 0
    assert qtool("eval", "-q", "--json", "e.json") == 0
    r = json.load(open("e.json"))
    assert r["n_images"] == 4 and "top1_agreement" in r
    assert "fp32" not in r and "top1_delta_pt" not in r


def test_eval_with_labels_file(project):
    d = project / "named"
    os.makedirs(d)
    for k, cls in enumerate(("n001", "n002")):
        for j, p in enumerate(write_images(project / "tmp_imgs", 2, seed=20 + k, prefix=cls)):
            os.replace(p, d / f"{cls}_{j}.png")
    (project / "synsets.txt").write_text("n001 first class\nn002 second class\n")
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert qtool("quantize", "-q") == 0
    assert qtool("eval", "-q", "-d", "named", "--labels", "synsets.txt", "--json", "e.json") == 0
    r = json.load(open("e.json"))
    assert r["n_images"] == 4 and r["n_labelled"] == 4 and "top1_delta_pt" in r


def test_alternative_workdir_and_method(project):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q", "-w", "other") == 0
    assert qtool("quantize", "-q", "-w", "other", "--method", "percentile", "-o", "out.int8.onnx") == 0
    assert os.path.exists("out.int8.onnx") and not os.path.exists("qtool_work")
    assert json.load(open("other/quantize.json"))["method"] == "percentile"


# --- errors and exit codes --------------------------------------------------------------------------------

def test_quantize_before_calibrate_says_what_to_run(project, capsys):
    assert qtool("quantize") == 1
    err = capsys.readouterr().err
    assert "qtool calibrate" in err and "first" in err
    assert len(err.strip().splitlines()) == 1


def test_eval_before_quantize_says_what_to_run(project, capsys):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    capsys.readouterr()
    assert qtool("eval") == 1
    assert "qtool quantize" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["calibrate", "--bogus"], ["calibrate", "--data", "data"],
                                  ["calibrate", "-m", "net.onnx", "-d", "data", "--method", "kl"],
                                  ["quantize", "--method", "best"], ["nosuchcommand"], ["eval", "--runtime", "gpu"]])
def test_bad_usage_exits_2(project, args, capsys):
    assert qtool(*args) == 2
    assert capsys.readouterr().err.strip()
    assert not os.path.exists("qtool_work")


def test_unknown_exclude_exits_1(project, capsys):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    capsys.readouterr()
    assert qtool("quantize", "--exclude", "no_such_node") == 1
    assert "no_such_node" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"", b"\x08\x07garbage\xff\xfe" * 20], ids=["empty", "garbage"])
def test_bad_model_one_line_error_no_traceback(project, content, capsys):
    (project / "bad.onnx").write_bytes(content)
    assert qtool("calibrate", "-m", "bad.onnx", "-d", "data", "-c", "cfg.toml") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.onnx" in err and err.startswith("qtool: error:")
    assert "Traceback" not in err


def test_bad_model_subprocess(project):
    """The installed console script: exit 1, one line naming the file, no traceback."""
    (project / "junk.onnx").write_bytes(os.urandom(200))
    exe = os.path.join(os.path.dirname(sys.executable), "qtool")
    p = subprocess.run([exe, "calibrate", "-m", "junk.onnx", "-d", "data", "-c", "cfg.toml"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "junk.onnx" in p.stderr


def test_missing_model_and_data(project, capsys):
    assert qtool("calibrate", "-m", "absent.onnx", "-d", "data") == 1
    assert "absent.onnx" in capsys.readouterr().err
    assert qtool("calibrate", "-m", "net.onnx", "-d", "nodata") == 1
    assert "nodata" in capsys.readouterr().err


def test_wrongly_typed_config_one_line_error(project, capsys):
    (project / "typed.toml").write_text("[input]\nsize = 224\n")
    try:
        code = qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "typed.toml")
    except Exception:
        code = None
    assert code == 1 and "typed.toml" in capsys.readouterr().err


def test_debug_shows_the_exception(project):
    from qtool.errors import QtoolError
    with pytest.raises(QtoolError):
        cli.main(["calibrate", "-m", "absent.onnx", "-d", "data", "--debug"])


# --- internal errors: one line naming the step and the model, a code of their own ---------------------------

def _inject_bug(monkeypatch, exc):
    import qtool.quantize.run as run_mod

    def bug(*a, **k):
        raise exc

    monkeypatch.setattr(run_mod, "load_inputs", bug)


def test_internal_error_is_one_line_naming_step_and_model(project, monkeypatch, capsys):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    # (not a RecursionError: that is the input's, issue 51, and test_hostile_tables_limits.py's)
    _inject_bug(monkeypatch, ZeroDivisionError("float division by zero"))
    capsys.readouterr()
    assert qtool("quantize", "--no-sensitivity") == 70
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("qtool: internal error in `qtool quantize` on ") and "net.onnx" in err
    assert "ZeroDivisionError: float division by zero" in err and "report it" in err and "--debug" in err


def test_internal_error_with_debug_raises_the_original(project, monkeypatch):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    _inject_bug(monkeypatch, RecursionError("deep"))
    with pytest.raises(RecursionError, match="deep"):
        cli.main(["quantize", "--no-sensitivity", "--debug"])


def test_internal_error_message_is_one_line_whatever_the_exception_says(project, monkeypatch, capsys):
    import qtool.inspect as inspect_mod  # (the command imports inspect_model when it runs)

    def bug(*a, **k):
        raise ValueError("first line\nsecond line\n" + "x" * 1000)

    monkeypatch.setattr(inspect_mod, "inspect_model", bug)
    assert qtool("inspect", "net.onnx") == 70
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and len(err) < 600
    assert "`qtool inspect` on net.onnx: ValueError: first line second line" in err


def test_interrupt_inside_a_step_is_one_line_130(project, monkeypatch, capsys):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    _inject_bug(monkeypatch, KeyboardInterrupt())
    capsys.readouterr()
    assert qtool("quantize", "--no-sensitivity") == 130
    assert [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()] == ["qtool: interrupted"]


def test_system_refusal_is_bad_input_not_a_bug(project, monkeypatch, capsys):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    _inject_bug(monkeypatch, PermissionError(13, "Permission denied", "qtool_work/model.int8.onnx"))
    capsys.readouterr()
    assert qtool("quantize", "--no-sensitivity") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Permission denied" in err and "model.int8.onnx" in err


def test_internal_error_subprocess_has_no_traceback(project):
    """The real entry point, a bug planted before it runs: exit 70, one line on stderr."""
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    code = ("import qtool.quantize.run as r\n"
            "def bug(*a, **k):\n    raise AssertionError('planted')\n"
            "r.load_inputs = bug\n"
            "from qtool.cli import main\nmain()\n")
    p = subprocess.run([sys.executable, "-c", code, "quantize", "--no-sensitivity"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 70
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "`qtool quantize`" in p.stderr and "net.onnx" in p.stderr and "AssertionError: planted" in p.stderr


def test_help_lists_the_exit_codes(capsys):
    assert qtool("--help") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "1 bad input" in out and "2 misuse" in out and "70 internal error" in out and "130 interrupted" in out


def test_corrupt_image_warning_names_file(project):
    """Subprocess: pytest records warnings in-process, the real command prints them on stderr."""
    (project / "data" / "class_a" / "img01.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    exe = os.path.join(os.path.dirname(sys.executable), "qtool")
    p = subprocess.run([exe, "calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "--json", "cal.json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert re.search(r"warning: .*img01\.png", p.stderr) and "1 unreadable skipped" in p.stdout
    cal = json.load(open("cal.json"))
    assert cal["n_samples"] == 11 and len(cal["skipped"]) == 1 and "img01.png" in cal["skipped"][0]


# --- interrupted runs leave no partial output ---------------------------------------------------------------

def test_keyboard_interrupt_during_calibration(project, monkeypatch, capsys):
    import qtool.calibrate.run as run_mod

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "collect", boom)
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml") == 130
    assert "interrupted" in capsys.readouterr().err
    assert not os.path.exists("qtool_work") or _listing("qtool_work") == []


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_calibrate_save_failure_leaves_no_half_files(project, monkeypatch, fail_at):
    """The k-th atomic rename fails (fused model, table, manifest): no temp file, no half-written file,
    and the manifest never points at something that was not written."""
    import qtool.modelio as mio
    real, calls = mio.os.replace, []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == fail_at:
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(mio.os, "replace", flaky)
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 130
    monkeypatch.setattr(mio.os, "replace", real)
    wd = project / "qtool_work"
    assert _no_temp_files(wd) == []
    for f in _listing(wd):  # whatever exists is complete
        if f.endswith(".json"):
            json.load(open(wd / f))
        if f.endswith(".onnx"):
            import onnx
            onnx.checker.check_model(onnx.load(str(wd / f)))
    if os.path.exists(wd / "manifest.json"):
        entry = json.load(open(wd / "manifest.json")).get("calibrate", {})
        assert all(os.path.exists(v) for k, v in entry.items() if k.endswith("path") and k != "model_path")


def test_quantize_write_failure_mid_file_keeps_previous_state(project, monkeypatch, capsys):
    """Serialization dies half-way through writing the int8 model: no partial model.int8.onnx, no
    temp file, and the manifest still says only calibrate ran."""
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    wd = project / "qtool_work"
    before = {f: open(wd / f, "rb").read() for f in _listing(wd)}
    import qtool.modelio as mio
    real_fdopen = mio.os.fdopen

    class HalfWriter:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(mio.os, "fdopen", lambda fd, mode="r", *a, **k: HalfWriter(real_fdopen(fd, mode, *a, **k)))
    capsys.readouterr()
    try:  # the exit code is test_quantize_disk_full_is_one_line_error's business
        qtool("quantize")
    except OSError:
        pass
    monkeypatch.setattr(mio.os, "fdopen", real_fdopen)
    assert _no_temp_files(wd) == []
    assert not os.path.exists(wd / "model.int8.onnx")
    assert {f: open(wd / f, "rb").read() for f in _listing(wd)} == before


def test_quantize_disk_full_is_one_line_error(project, monkeypatch, capsys):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    import qtool.modelio as mio

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mio.os, "replace", full)
    capsys.readouterr()
    try:
        code = qtool("quantize")
    except OSError:
        code = None
    assert code == 1 and "model.int8.onnx" in capsys.readouterr().err


def test_quantize_interrupted_at_rename_keeps_previous_int8(project, monkeypatch):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert qtool("quantize", "-q") == 0
    wd = project / "qtool_work"
    before = {f: open(wd / f, "rb").read() for f in _listing(wd)}
    import qtool.modelio as mio

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(mio.os, "replace", interrupted)
    assert qtool("quantize", "-q", "--method", "percentile") == 130
    monkeypatch.setattr(mio.os, "replace", os.replace)
    assert _no_temp_files(wd) == []
    assert {f: open(wd / f, "rb").read() for f in _listing(wd)} == before


def test_recorded_file_missing_says_which_step_to_rerun(project, capsys):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert qtool("quantize", "-q") == 0
    os.remove("qtool_work/model.int8.onnx")
    capsys.readouterr()
    assert qtool("eval") == 1
    err = capsys.readouterr().err
    assert "model.int8.onnx" in err and "qtool quantize" in err
    os.remove("qtool_work/calibration.json")
    assert qtool("quantize") == 1
    err = capsys.readouterr().err
    assert "calibration.json" in err and "qtool calibrate" in err


# --- labels -----------------------------------------------------------------------------------------------

def test_labels_from_folders_and_file(tmp_path):
    from qtool.errors import QtoolError
    from qtool.labels import labels_from_file, labels_from_folders
    root = str(tmp_path)
    files = [os.path.join(root, "dog", "1.png"), os.path.join(root, "cat", "2.png"),
             os.path.join(root, "cat", "x", "3.png")]
    assert labels_from_folders(root, files) == [1, 0, 0]  # classes sorted: cat=0, dog=1
    assert labels_from_folders(root, [os.path.join(root, "a.png"), os.path.join(root, "dog", "b.png")]) is None
    assert labels_from_folders(root, [os.path.join(root, "dog", "b.png")]) is None  # one class: no labels
    lf = tmp_path / "synsets.txt"
    lf.write_text("n01 tench\n\nn02 goldfish\ncat\n")
    got = labels_from_file(str(lf), ["/d/n02_fish.JPEG", "/d/n01_0001.png", "/d/cat.png", "/d/zebra_1.png"])
    assert got == [1, 0, 2, None]
    with pytest.raises(QtoolError, match="no image's name starts with a class"):
        labels_from_file(str(lf), ["/d/zebra.png"])
    with pytest.raises(QtoolError, match="no such labels file"):
        labels_from_file(str(tmp_path / "none.txt"), ["/d/a.png"])
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(QtoolError, match="labels file is empty"):
        labels_from_file(str(tmp_path / "empty.txt"), ["/d/a.png"])


def test_quantize_with_explicit_model_and_table(project):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q", "-w", "w1") == 0
    assert qtool("quantize", "-q", "-w", "w2", "-m", "net.onnx", "--table", "w1/calibration.json",
                 "--json", "q.json") == 0
    assert os.path.exists("w2/model.int8.onnx") and json.load(open("q.json"))["summary"]["int8"] == 6


def _pinned_batch(path, batch):
    """small_convnet with its batch dimension fixed, as many exporters write it."""
    import onnx
    m = small_convnet()
    for v in (m.graph.input[0], m.graph.output[0]):
        v.type.tensor_type.shape.dim[0].dim_value = batch
    onnx.checker.check_model(m)
    save(m, path)


def test_fixed_batch_one_model_flow(project):
    """Many exported models pin the batch to 1: calibrate and eval must feed one image at a time."""
    _pinned_batch(project / "b1.onnx", 1)
    assert qtool("calibrate", "-m", "b1.onnx", "-d", "data", "-c", "cfg.toml", "-q", "--batch", "8", "--every", "3",
                 "--json", "cal.json") == 0
    assert json.load(open("cal.json"))["n_samples"] == 4
    assert qtool("quantize", "-q") == 0
    assert qtool("eval", "-q", "--json", "e.json") == 0
    assert json.load(open("e.json"))["n_images"] == 8


def test_fixed_batch_three_model_flow(project):
    """A batch pinned to 3 with 8 calibration images: every step of quantize (method choice, rounding,
    range tuning, sensitivity, exclusion) runs on whole batches of 3 and says nothing breaks."""
    _pinned_batch(project / "b3.onnx", 3)
    assert qtool("calibrate", "-m", "b3.onnx", "-d", "data", "-c", "cfg.toml", "-q", "--batch", "3", "--every", "1",
                 "--limit", "8") == 0
    assert qtool("quantize", "-q", "--method", "auto", "--exclude-sensitive", "--max-excluded", "1",
                 "--sensitivity-samples", "6", "--tune-ranges", "--json", "q.json") == 0
    rep = json.load(open("q.json"))
    assert rep["rounding"] == "output-aware" and rep["tuned_ranges"] is not None
    sens = json.load(open(project / "qtool_work" / "sensitivity.json"))
    assert sens["meta"]["samples"] == 6 and len(sens["layers"]) == rep["summary"]["int8"]


def test_eval_with_every_path_explicit(project):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q", "-w", "w1") == 0
    assert qtool("quantize", "-q", "-w", "w1", "-o", "int8.onnx") == 0
    assert qtool("eval", "-q", "-w", "fresh", "-m", "net.onnx", "--int8", "int8.onnx", "-d", "data",
                 "-c", "cfg.toml", "--limit", "5", "--json", "e.json") == 0
    r = json.load(open("e.json"))
    assert r["n_images"] == 5 and r["int8_model"] == str(project / "int8.onnx")


def test_quantize_rounding_and_range_tuning_flags(project):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert qtool("quantize", "-q", "--rounding", "output", "--tune-ranges", "--no-sensitivity", "--json", "a.json") == 0
    a = json.load(open("a.json"))
    assert a["rounding"] == "output-aware" and a["rounded_layers"] and a["tuned_ranges"]["probes"] > 0
    assert qtool("quantize", "-q", "--no-sensitivity", "--json", "b.json") == 0
    b = json.load(open("b.json"))
    assert b["rounding"] == "output-aware" and b["rounded_layers"] and b["tuned_ranges"] is None  # the defaults
    assert qtool("quantize", "-q", "--rounding", "nearest", "--no-sensitivity", "--json", "c.json") == 0
    c = json.load(open("c.json"))
    assert c["rounding"] == "nearest" and c["rounded_layers"] == [] and c["tuned_ranges"] is None


def test_eval_says_when_ort_int8_is_not_the_exact_result(project, capsys, monkeypatch):
    """ONNX Runtime's int8 path as on x86 without VNNI (emulated, so this holds on any CPU): a model with
    plain int8 weights whose pairs saturate gets one warning line with the figures, and the JSON has them;
    the default portable model, exact there, gets no warning."""
    from onnx import numpy_helper

    from qtool.evaluate import images, tensors
    from qtool.runtime import NativeSession
    m = small_convnet()
    w = next(t for t in m.graph.initializer if t.name == "stem_w")
    w.CopyFrom(numpy_helper.from_array(np.abs(numpy_helper.to_array(w)) + 0.5, "stem_w"))  # same-sign pairs
    save(m, project / "net.onnx")
    real = images.session

    def ort_without_vnni(path, threads=0, *a, **kw):
        if str(path).endswith(".int8.onnx"):
            return NativeSession(path, threads=1, arithmetic="ort-x86-novnni")
        return real(path, threads, *a, **kw)

    for loop in (images, tensors):  # (either loop, whichever the data takes)
        monkeypatch.setattr(loop, "session", ort_without_vnni)
    # and ORT's probe says so too, whatever this CPU has (on a VNNI CPU it finds ORT exact: the hint differs)
    from qtool import ort_arithmetic
    from qtool.arithmetic import ORT_X86_NOVNNI
    monkeypatch.setattr(ort_arithmetic, "ort_int8_arithmetic", lambda: ORT_X86_NOVNNI)
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "--every", "2", "-q") == 0
    for target, warned in (("vnni", True), ("portable", False)):
        assert qtool("quantize", "-q", "--no-sensitivity", "--target", target) == 0
        capsys.readouterr()
        assert qtool("eval", "-q", "--json", f"e_{target}.json") == 0
        err = capsys.readouterr().err
        check = json.load(open(f"e_{target}.json"))["runtime_check"]
        assert check["checked"] == 6 and check["exact"] is (not warned), check
        if warned:
            lines = [l for l in err.splitlines() if l.startswith("warning:")]
            assert len(lines) == 1 and "not the exact int8 result" in lines[0] and "--target portable" in lines[0]
            assert check["sqnr_ort_vs_exact_db"] < 50
        else:
            assert "warning" not in err and check["sqnr_ort_vs_exact_db"] > 1e300  # (inf: identical)


def test_quantize_warns_where_the_int8_output_is_far_from_fp32():
    """PP-OCRv4's seal detector measured 1.6 dB on its calibration images and the quantize output said so only
    in passing; below 10 dB it is one warning line that asks for the judgement by meaning."""
    from qtool.commands.quantize import far_from_fp32
    report = {"target_cost": {"samples": 32, "output_sqnr_db": 1.57, "output_sqnr_plain_int8_db": 1.4}}
    w = far_from_fp32(report, excluded_sensitive=False)
    assert w.startswith("warning: ") and "1.6 dB" in w and "--exclude-sensitive" in w and "\n" not in w
    assert "--exclude-sensitive" not in far_from_fp32(report, excluded_sensitive=True)
    assert far_from_fp32({"target_cost": {"samples": 32, "output_sqnr_db": 24.0}}, False) is None
    assert far_from_fp32({"target_cost": None}, False) is None


def test_a_warning_during_a_progress_bar_gets_a_line_of_its_own():
    """Both sweeps' helpers missed warnings printed on a progress bar's line (a log filtered for the bars
    dropped them): in a log the warning starts a new line, on a terminal the bar is drawn again below it."""
    import io
    import warnings
    from tqdm import tqdm
    from qtool.commands.common import setup_output
    with warnings.catch_warnings():
        setup_output(False, 0)
        buf = io.StringIO()
        with tqdm(total=10, file=buf, desc="decode + fp32") as bar:
            bar.update(3)
            warnings.showwarning("the samples come in 5 input sizes", UserWarning, "x.py", 1, file=buf)
            bar.update(3)
    lines = buf.getvalue().split("\n")
    assert "qtool: warning: the samples come in 5 input sizes" in lines
    assert not any("%|" in ln and "warning" in ln for ln in lines)


def test_calibrate_verbose_says_where_the_time_went(project, capsys):
    """-v prints calibrate's seconds per phase (the fixed cost before the first sample, the pass) and
    --json carries them with the graph passes' own: a user sees what a slow calibration spends on."""
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-w", "w", "-v",
                 "--json", "cal.json") == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("time: "))
    for phase in ("read model", "fuse", "calibration pass", "ranges", "write"):
        assert re.search(rf"{phase} \d+\.\d\d s", line), (phase, line)
    summary = json.load(open("cal.json"))
    assert list(summary["phases"])[:2] == ["read model", "list data"] and summary["phases"]["fuse"] >= 0
    assert "pair_channels" in summary["fuse_seconds"] and "fold_batchnorm" in summary["fuse_seconds"]
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-w", "w") == 0
    assert "time: " not in capsys.readouterr().out  # (only with -v)
