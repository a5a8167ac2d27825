"""quantize's pipeline is a list of steps, one file each; docs/design.md shows the list as it is."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import qtool
from qtool.quantize import steps
from qtool.quantize.pipeline import FALLBACKS, PIPELINE, markdown
from qtool.quantize.step import first_line
from qtool.quantize.split import PARTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS_DIR = os.path.dirname(steps.__file__)


def test_design_md_shows_the_pipeline_as_the_list_is():
    text = open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8").read()
    block = re.search(r"<!-- pipeline: begin[^\n]*-->\n(.*?)<!-- pipeline: end -->", text, re.S)
    assert block, "docs/design.md lost its pipeline markers"
    assert block.group(1) == markdown(), "run `python -m qtool.quantize.pipeline --markdown` into docs/design.md"


def test_the_markdown_command_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "qtool.quantize.pipeline", "--markdown"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    assert out == markdown() and out.count("\n") == len(PIPELINE) + 2


def test_every_step_file_is_one_step_of_the_list():
    files = sorted(f[:-3] for f in os.listdir(STEPS_DIR) if f.endswith(".py") and f != "__init__.py")
    listed = sorted(s.run.__module__.rsplit(".", 1)[1] for s in PIPELINE)
    assert listed == files  # (each file holds the step it declares, and is in the list once)


def test_each_step_says_when_it_runs_what_it_reads_and_its_fallback():
    for s in PIPELINE:
        assert first_line(s.when) and first_line(s.samples), s.name
        assert s.fallback is None or s.fallback.strip(), s.name
        assert s.undo is None or s.fallback, s.name  # (only an optional step has a fallback to put back)
    assert set(FALLBACKS) >= {"method choice", "output-aware rounding", "sensitivity", "exclusion", "verification"}


def test_a_step_never_imports_another_step_nor_the_runner():
    for f in os.listdir(STEPS_DIR):
        if not f.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(STEPS_DIR, f), encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("qtool.quantize.steps"), (f, node.module)
                assert node.module not in ("qtool.quantize.run", "qtool.quantize.pipeline"), (f, node.module)


def test_quantize_has_no_import_circle():
    """The modules of qtool/quantize import one way (subgraphs.py is handed the quantize function)."""
    pkg = os.path.dirname(qtool.__file__)
    graph = {}
    for base, _, names in os.walk(os.path.join(pkg, "quantize")):
        for f in names:
            if f.endswith(".py"):
                path = os.path.join(base, f)
                mod = "qtool." + os.path.relpath(path, pkg)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                tree = ast.parse(open(path, encoding="utf-8").read())
                graph[mod] = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                              and n.module.startswith("qtool.quantize")}
    seen, done = set(), set()

    def visit(m, path):
        assert m not in seen or m in done, "import circle: " + " -> ".join(path + [m])
        if m in done:
            return
        seen.add(m)
        for d in graph.get(m, ()):
            visit(d, path + [m])
        done.add(m)
    for m in graph:
        visit(m, [])


def test_samples_are_declared_as_parts_of_the_split():
    from types import SimpleNamespace
    on = SimpleNamespace(auto=True, rounding=True, tune_ranges=True, sensitivity=True, exclusion=True,
                         branch_exclusion=True)
    run = SimpleNamespace(on=on, main_int8=False)
    for s in PIPELINE:
        assert set(s.samples(run)) <= set(PARTS), s.name
