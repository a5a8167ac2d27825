"""Imports point one way: shared pieces below, the steps above them in pipeline order, the CLI on top.

Every `import qtool.X` or `from qtool.X import ...` anywhere in a module (also inside functions: a
late import is still a dependency) must name a package of a lower layer than the importer's, or
its own package. A package missing from LAYERS fails too, so a new one has to be placed."""
from __future__ import annotations

import ast
import os

QTOOL = os.path.join(os.path.dirname(__file__), "..", "qtool")

LAYERS = [
    # shared: plain services and data types every step may use, themselves layered
    {"errors", "qparams", "arithmetic", "metrics", "blas", "lattice", "windows", "timing", "kernel_params", "tasks"},
    {"graph", "labels", "ortsession", "ort_arithmetic", "report", "limits", "tempfiles", "distributed"},
    {"modelio", "data", "rules", "ortcheck", "encoders"},
    {"workdir", "plan", "outputs"},
    # the steps, in pipeline order
    {"kernels", "fuse"},  # the native kernels; graph cleanup (model -> fused graph)
    {"runtime", "calibrate"},  # the int8 executor; fused graph -> calibration table
    {"quantize"},  # table -> QDQ graph and its reports
    {"evaluate", "inspect", "zoo"},  # int8 against fp32; what qtool will do with a model; model builders
    {"batch"},  # a catalogue's jobs: the three commands' lines (made by commands.batch_steps) run as processes
    {"commands", "cli", "__init__", "api"},  # the CLI and the Python API on top
    {"__main__"},  # the entry point: imports the CLI late, so that a Ctrl-C while importing exits 130
]


def _package(path: str) -> str:
    rel = os.path.relpath(path, QTOOL).split(os.sep)
    return rel[0][:-3] if rel[0].endswith(".py") else rel[0]


def _imports(path: str):
    rel = os.path.relpath(path, QTOOL).split(os.sep)
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = ["qtool"] + rel[:-1][:len(rel) - node.level]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
                if node.module == "qtool":  # from qtool import graph as G
                    names = [f"qtool.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            parts = n.split(".")
            if parts[0] == "qtool" and len(parts) > 1:
                yield parts[1], node.lineno


def test_every_import_points_down():
    layer = {p: k for k, ps in enumerate(LAYERS) for p in ps}
    wrong = []
    for root, _, files in os.walk(QTOOL):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            src = _package(path)
            assert src in layer, f"qtool/{src} is in no layer of LAYERS: place it"
            for dst, line in _imports(path):
                assert dst in layer, f"{path}:{line} imports qtool.{dst}, which is in no layer of LAYERS"
                if dst != src and layer[dst] >= layer[src]:
                    wrong.append(f"{os.path.relpath(path, QTOOL)}:{line}: {src} (layer {layer[src]}) imports "
                                 f"{dst} (layer {layer[dst]})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_the_check_sees_late_and_relative_imports(tmp_path):
    """The walker is what the test relies on: it must see imports inside functions and relative ones."""
    pkg = tmp_path / "qtool" / "quantize"
    pkg.mkdir(parents=True)
    mod = pkg / "m.py"
    mod.write_text("def f():\n    from qtool.evaluate import x\n    from ..commands import y\nfrom . import z\n")
    global QTOOL
    old, QTOOL = QTOOL, str(tmp_path / "qtool")
    try:
        assert {d for d, _ in _imports(str(mod))} == {"evaluate", "commands", "quantize"}
    finally:
        QTOOL = old
