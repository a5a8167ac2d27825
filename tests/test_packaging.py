"""What a plain `pip install` gets: the wheel carries the preprocessing presets, and an installed
qtool finds them by name without the source tree (or the current folder) around."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def test_wheel_carries_the_presets_and_finds_them_by_name(tmp_path):
    env = dict(os.environ, QTOOL_NO_EXTENSIONS="1")  # the packaging, not the C build, is under test here
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w",
                            str(tmp_path), REPO], check=True, env=env, cwd=tmp_path, capture_output=True, text=True)
    said = build.stdout + build.stderr
    assert "project.license" not in said and "License classifiers are deprecated" not in said, said[-2000:]
    (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    presets = sorted(f for f in os.listdir(os.path.join(REPO, "configs")) if f.endswith(".toml"))
    with zipfile.ZipFile(tmp_path / wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    assert presets and {f"qtool/data/presets/{p}" for p in presets} <= names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    # the unpacked package alone, run from an empty folder: the preset comes from inside it
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    code = ("import qtool.data.config as c; p = c.find_config('efficientnet-lite'); "
            "print(p); print(c.load_config('efficientnet-lite').size)")
    out = subprocess.run([sys.executable, "-c", code], cwd=empty, capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path / "site"))).stdout.split("\n")
    assert out[0].startswith(str(tmp_path / "site" / "qtool" / "data" / "presets")), out
    assert out[1] == "(224, 224)"


def test_a_configs_folder_in_the_current_directory_is_not_a_preset(tmp_path, monkeypatch):
    from qtool.data.config import load_config
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "efficientnet-lite.toml").write_text('[input]\nsize = [99, 99]\n')
    monkeypatch.chdir(tmp_path)
    assert load_config("efficientnet-lite").size == (224, 224)
