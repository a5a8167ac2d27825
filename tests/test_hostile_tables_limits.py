"""Hostile input, issue 51: tables validated like models (case 4) and resource exhaustion or pathological
input told as the user's error (case 7). Expected, as in test_hostile.py: one `qtool: error:` line naming
the file and what is wrong, exit 1; never a traceback, "internal error" (exit 70), a death inside ONNX
Runtime, or a model written that ONNX Runtime cannot run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest

from helpers import save, small_convnet
from test_hostile import TESTS, one_line_error, project, qtool  # noqa: F401 - (project: the fixture)


@pytest.fixture
def calibrated(project, capsys):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    capsys.readouterr()
    return project


def _edited_table(edit, path="edited.json"):
    t = json.load(open("qtool_work/calibration.json"))
    edit(t)
    open(path, "w").write(json.dumps(t))
    return path


def _all_ranges(t, value):
    for ranges in t["ranges"].values():
        for k in ranges:
            ranges[k] = list(value)


# --- case 4: tables validated like models ----------------------------------------------------------------

@pytest.mark.parametrize("edit,needle", [
    (lambda t: _all_ranges(t, [-1e30, 1e30]), "outside the"),  # (finite, within float32: beyond what was seen)
    (lambda t: _all_ranges(t, [-1e39, 1e39]), "beyond float32"),
    (lambda t: _all_ranges(t, [0.5, 0.5]), "of no width"),
])
def test_implausible_ranges_are_refused_naming_the_tensor(calibrated, capsys, edit, needle):
    path = _edited_table(edit)
    assert qtool("quantize", "--table", path, "-o", "e.onnx", "--no-sensitivity") == 1
    line = one_line_error(capsys.readouterr().err, "edited.json", needle, "range of '")
    assert "internal error" not in line
    assert not os.path.exists("e.onnx")


def test_channel_means_cut_short_is_one_error(calibrated, capsys):
    def cut(t):
        x = next(iter(t["channel_means"]))
        t["channel_means"][x] = t["channel_means"][x][:1]
    path = _edited_table(cut)
    assert qtool("quantize", "--table", path, "-o", "e.onnx", "--no-sensitivity") == 1
    one_line_error(capsys.readouterr().err, "edited.json", "channel means of '", "reads")
    assert not os.path.exists("e.onnx")


def test_method_the_table_lacks_is_one_error(calibrated, capsys):
    path = _edited_table(lambda t: t["ranges"].pop("entropy"))
    assert qtool("quantize", "--table", path, "-o", "e.onnx", "--no-sensitivity", "--method", "entropy") == 1
    one_line_error(capsys.readouterr().err, "edited.json", "no 'entropy' ranges")


def test_a_model_onnx_runtime_cannot_run_is_never_written(calibrated, capsys, monkeypatch):
    """Whatever quantize built, the model is run once by ONNX Runtime before it is renamed into place: here
    a build that writes a model ORT refuses (a MaxPool of an impossible kernel) leaves the old file as it was."""
    from qtool.quantize import run as run_mod
    from onnx import helper
    real = run_mod.QuantizeContext.build

    def broken(self, *a, **k):
        out = real(self, *a, **k)
        if not k.get("scoring"):
            n = out.model.graph.node
            last = n[len(n) - 1]
            n.append(helper.make_node("MaxPool", [last.output[0]], ["pooled"], kernel_shape=[99, 99]))
            out.model.graph.output[0].name = "pooled"
        return out
    monkeypatch.setattr(run_mod.QuantizeContext, "build", broken)
    open("e.onnx", "w").write("the user's old file")
    assert qtool("quantize", "-o", "e.onnx", "--no-sensitivity") == 1
    one_line_error(capsys.readouterr().err, "does not run in ONNX Runtime", "not written")
    assert open("e.onnx").read() == "the user's old file"
    assert not [f for f in os.listdir(".") if f.startswith((".tmp-", ".qtool-tmp"))]


def test_quantize_without_samples_runs_the_model_and_says_nothing_was_measured(calibrated, capsys):
    """No calibration images left to run (the data folder is gone): the model is still run once, on zeros,
    and one warning says its accuracy was never measured."""
    os.rename("data", "data_gone")
    assert qtool("quantize", "-o", "e.onnx", "--no-sensitivity") == 0
    err = capsys.readouterr().err
    assert err.count("nothing was measured") == 1, err
    import onnxruntime as ort
    ort.InferenceSession("e.onnx", providers=["CPUExecutionProvider"])


def test_zero_feed_takes_sizes_the_graph_computes():
    from onnx import TensorProto, helper
    from qtool.ortcheck import zero_feed
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = onnx.numpy_helper.from_array(np.zeros((4, 3, 5, 5), np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"])], "g", [x], [y], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    assert zero_feed(m)["x"].shape == (1, 3, 8, 8)  # (5x5 unpadded: 1, 2 and 4 give no output)
    assert zero_feed(m, {"x": [None, 3, 20, 30]})["x"].shape == (1, 3, 20, 30)


# --- case 7: resource exhaustion and pathological input are the user's errors ----------------------------

def _cli(args, cwd, prelude="", timeout=300):
    code = (f"import sys\nsys.path.insert(0, {TESTS!r})\n{textwrap.dedent(prelude)}\n"
            f"sys.argv = ['qtool'] + {[str(a) for a in args]!r}\nfrom qtool.__main__ import main\nmain()\n")
    return subprocess.run([sys.executable, "-c", code], cwd=str(cwd), capture_output=True, text=True, timeout=timeout)


def test_out_of_memory_during_calibrate_is_one_error(project):
    """MemoryError wherever it comes from (here: every histogram update, as under `ulimit -v`)."""
    prelude = """
        from qtool.calibrate import histogram
        def no_memory(*a, **k):
            raise MemoryError()
        histogram.Histogram.observe = no_memory
    """
    p = _cli(["calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q"], project, prelude)
    assert p.returncode == 1, p.stderr
    line = one_line_error(p.stderr, "out of memory", "`qtool calibrate`", "net.onnx")
    assert "internal error" not in line


def test_out_of_memory_under_ulimit_is_one_error(project):
    p = _cli(["calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q"], project,
             "import numpy, resource\nresource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
             "from qtool.calibrate import histogram\nreal = histogram.Histogram.observe\n"
             "def big(self, *a, **k):\n    numpy.ones(1 << 31, numpy.uint8)\n"
             "histogram.Histogram.observe = big\n")
    assert p.returncode == 1, p.stderr
    one_line_error(p.stderr, "out of memory")


def test_data_folder_nested_1200_deep(project, capsys):
    made = ["deep"]
    for _ in range(1200):  # (os.makedirs recurses too)
        made.append(os.path.join(made[-1], "d"))
    try:
        for d in made:
            os.mkdir(d)
        code = qtool("calibrate", "-m", "net.onnx", "-d", "deep", "-c", "cfg.toml", "-q")
        assert code == 1
        one_line_error(capsys.readouterr().err, "deep", "nested deeper than")
    finally:  # (bottom up: pytest's clean-up of tmp_path, shutil.rmtree, recurses)
        for d in reversed(made):
            if os.path.isdir(d):
                os.rmdir(d)


def test_a_deep_folder_within_the_bound_is_walked(tmp_path):
    from qtool.limits import walk
    d = tmp_path / "a"
    for _ in range(200):
        d = d / "b"
    d.mkdir(parents=True)
    (d / "x.npy").write_bytes(b"")
    files = [os.path.join(r, n) for r, _, names in walk(str(tmp_path / "a")) for n in names]
    assert files == [str(d / "x.npy")]


def test_metadata_toml_nested_50000_deep(project, capsys):
    m = small_convnet()
    p = m.metadata_props.add()
    p.key, p.value = "qtool.config", "x = " + "[" * 50000 + "]" * 50000
    save(m, "meta.onnx")
    assert qtool("calibrate", "-m", "meta.onnx", "-d", "data", "-q") == 1
    one_line_error(capsys.readouterr().err, "meta.onnx metadata qtool.config", "nested deeper than")


def test_toml_depth_bound_reads_strings_and_comments_as_text():
    from qtool.errors import QtoolError
    from qtool.limits import MAX_TOML_DEPTH, toml_depth_ok
    toml_depth_ok('a = "' + "[" * 100 + '"\n# ' + "{" * 100 + "\n[input]\nsize = [[1, 2]]\n", "t")
    with pytest.raises(QtoolError, match="t: arrays or tables nested deeper"):
        toml_depth_ok("a = " + "[" * (MAX_TOML_DEPTH + 1), "t")


def test_standard_output_full_says_so(calibrated):
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "qtool", "quantize", "--no-sensitivity"], cwd=str(calibrated),
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 1
    one_line_error(p.stderr, "cannot write to standard output", "No space left on device")
