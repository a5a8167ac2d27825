"""The README's commands run as written, and no tracked file names a path of a build machine.

Every fenced ```sh block of README.md runs in a temporary directory holding the bundled `calib_data/`
(its `models/efficientnet-lite0.onnx`, which `make demo` writes, taken from $SHARED/models when there, else
the block is skipped); a block of `make` lines only is the set-up, checked against the Makefile's targets.
Every ```python block runs after a prelude that makes `model.onnx`, `calib_batches` and `val_batches` from a
small network. The CLI table's flags must be in each command's --help. A README that drifts from the CLI fails.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
SHARED = os.environ.get("SHARED") or os.path.join(ROOT, "..", "shared")
DEMO_MODEL = "models/efficientnet-lite0.onnx"


def readme_text():
    with open(README, encoding="utf-8") as f:
        return f.read()


def blocks(lang, text=None):
    return [b.strip("\n") for b in re.findall(r"^```" + lang + r"\n(.*?)^```", text or readme_text(), re.S | re.M)]


def commands(block):
    """The block's command lines (comments stripped; a trailing backslash joins lines)."""
    out, cur = [], ""
    for line in block.splitlines():
        line = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip():
            out.append(cur.strip())
        cur = ""
    return out


def qtool_argv(cmd):
    argv = shlex.split(cmd)
    assert argv[0] == "qtool", f"README command does not start with qtool: {cmd}"
    return [sys.executable, "-m", "qtool"] + argv[1:]


def test_readme_has_the_blocks_it_promises():
    sh = blocks("sh")
    assert any(commands(b) == ["make demo", "make test"] for b in sh), "the two set-up commands, exactly"
    steps = [b for b in sh if any(c.startswith("qtool calibrate") for c in commands(b))]
    assert steps, "no ```sh block with the three steps"
    assert blocks("python"), "no ```python block (the API example)"


def test_setup_block_names_makefile_targets():
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        targets = set(re.findall(r"^([a-z][a-z0-9-]*):", f.read(), re.M))
    for b in blocks("sh"):
        cmds = commands(b)
        if cmds and all(c.startswith("make ") for c in cmds):
            for c in cmds:
                assert c.split()[1] in targets, f"README says `{c}`, the Makefile has no such target"


@pytest.mark.parametrize("index", range(len([b for b in blocks("sh") if not all(
    c.startswith("make ") for c in commands(b))])))
def test_readme_sh_block_runs(index, tmp_path):
    block = [b for b in blocks("sh") if not all(c.startswith("make ") for c in commands(b))][index]
    shutil.copytree(os.path.join(ROOT, "calib_data"), tmp_path / "calib_data")
    if DEMO_MODEL in block:
        shared_model = os.path.join(SHARED, "models", "efficientnet-lite0.onnx")
        if not os.path.isfile(shared_model):
            pytest.skip(f"{DEMO_MODEL} comes from `make demo`; $SHARED/models/efficientnet-lite0.onnx "
                        f"({shared_model}) is not here to stand in for it")
        os.makedirs(tmp_path / "models")
        os.symlink(os.path.abspath(shared_model), tmp_path / DEMO_MODEL)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for cmd in commands(block):
        r = subprocess.run(qtool_argv(cmd), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"README command failed (exit {r.returncode}): {cmd}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


PRELUDE = """
import numpy as np
_rng = np.random.default_rng(0)
calib_batches = [_rng.normal(size=(2, 3, 16, 16)).astype(np.float32) for _ in range(4)]
val_batches = [_rng.normal(size=(2, 3, 16, 16)).astype(np.float32) for _ in range(2)]
"""


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python_block_runs(index, tmp_path):
    helpers.save(helpers.small_convnet(), tmp_path / "model.onnx")
    src = PRELUDE + blocks("python")[index]
    r = subprocess.run([sys.executable, "-c", src], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 0, f"README python block {index} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


def cli_table_rows(text=None):
    """(command, [flags]) for each row of the README's CLI table."""
    rows = []
    for line in (text or readme_text()).splitlines():
        m = re.match(r"\| `qtool (\w+)([^`]*)`", line)
        if m:
            rows.append((m.group(1), re.findall(r"--[a-z][a-z0-9-]*", m.group(2))))
    return rows


def test_cli_table_flags_exist():
    rows = cli_table_rows()
    assert {c for c, _ in rows} >= {"calibrate", "quantize", "eval", "inspect", "bench", "info"}
    for cmd, flags in rows:
        out = subprocess.run([sys.executable, "-m", "qtool", cmd, "--help"], capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, COLUMNS="200")).stdout
        missing = [f for f in flags if not re.search(re.escape(f) + r"\b(?!-)", out)]
        assert not missing, f"README's CLI table: `qtool {cmd}` has no {', '.join(missing)} (see its --help)"


# --- no build machine's paths in the repository
# (spelled in pieces so that this file does not name them)
BUILD_DIRS = ["work", "root", "home", "tmp"]
BUILD_PATH = re.compile(r"(?<![\w.~$/-])/(?:" + "|".join(BUILD_DIRS) + r")/[\w.-]")


def tracked_files():
    try:
        r = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True, timeout=60)
    except OSError:
        return None
    if r.returncode != 0:
        return None
    return [f for f in r.stdout.decode().split("\0") if f]


def test_no_build_machine_paths_in_tracked_files():
    files = tracked_files()
    if files is None:
        pytest.skip("not a git checkout: no list of tracked files")
    hits = []
    for f in files:
        path = os.path.join(ROOT, f)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as fh:
            data = fh.read()
        if b"\0" in data[:8192]:
            continue  # binary
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if BUILD_PATH.search(line):
                hits.append(f"{f}:{n}: {line.strip()[:120]}")
    assert not hits, ("absolute paths of a build machine (take paths as arguments or from SHARED / QTOOL_ZOO):\n"
                      + "\n".join(hits))


def test_build_path_pattern():
    bad = ["see /" + "work/zoo-cache", "--out /" + "tmp/x", "/" + "home/me/m.onnx", "cd /" + "root/q"]
    good = ["~/.cache/qtool-zoo", "$HOME/x", "../shared/models", "docs/work/x", "a/tmp/b", "s3://x/tmp/y"]
    assert all(BUILD_PATH.search(s) for s in bad)
    assert not any(BUILD_PATH.search(s) for s in good)


def test_renamed_flag_fails(tmp_path):
    """A README naming a flag the CLI does not have fails the table check and the block run."""
    text = readme_text().replace("--exclude-sensitive]", "--exclude-sensitiv]", 1)
    assert text != readme_text()
    rows = dict(cli_table_rows(text))
    out = subprocess.run([sys.executable, "-m", "qtool", "quantize", "--help"], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, COLUMNS="200")).stdout
    assert not re.search(re.escape("--exclude-sensitiv") + r"\b(?!-)", out)
    assert "--exclude-sensitiv" in rows["quantize"]
    r = subprocess.run([sys.executable, "-m", "qtool", "info", "--no-such-flag"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2  # a renamed flag in a block: click's usage error, the block test fails on it
