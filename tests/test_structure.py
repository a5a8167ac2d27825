"""The shape of the code that issue 46 asked for, kept by a test so that it cannot drift back.

- No import circle among qtool's modules (read statically from their import statements, the way a reader
  follows them; imports inside functions count too, since a circle through a lazy import is still a circle
  for whoever reads the code).
- No function longer than 80 lines in the stages most edited (quantize, evaluate, runtime).
- No function with more than 8 parameters anywhere in qtool, but the CLI's click commands, which take
  one parameter per option by click's design.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "qtool"
LONG_FUNCTIONS_CHECKED = ("quantize", "evaluate", "runtime")
MAX_LINES = 80
MAX_PARAMETERS = 8


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The qtool modules NAME imports (a `from pkg import x` counts as pkg.x when x is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [(base, a.name) for a in node.names]
        else:
            continue
        for module, member in targets:
            if member and f"{module}.{member}" in modules:
                out.add(f"{module}.{member}")
            elif module in modules:
                out.add(module)
    out.discard(name)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the list of modules around it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def _is_package_face(name: str, child: str) -> bool:
    # a package's __init__ importing its own submodules to hand their names on is how a package shows its
    # face; a submodule importing that face back is not a circle of meaning
    return child.startswith(name + ".")


def test_no_import_circle():
    modules = _modules()
    graph = {name: {m for m in _imports(name, path, modules) if not _is_package_face(name, m)}
             for name, path in modules.items()}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def test_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield rel, node


def _parameters(fn: ast.FunctionDef) -> int:
    a = fn.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    if a.args and a.args[0].arg in ("self", "cls"):
        n -= 1
    return n


def test_no_long_function_in_the_busiest_stages():
    long = [f"{rel}:{fn.name} ({fn.end_lineno - fn.lineno + 1} lines)" for rel, fn in _functions()
            if rel.parts[0].removesuffix(".py") in LONG_FUNCTIONS_CHECKED
            and fn.end_lineno - fn.lineno + 1 > MAX_LINES]
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_no_function_with_more_than_eight_parameters():
    many = [f"{rel}:{fn.name} ({_parameters(fn)})" for rel, fn in _functions()
            if _parameters(fn) > MAX_PARAMETERS and not (rel.parts[0] == "commands" and fn.name == "command")]
    assert not many, f"over {MAX_PARAMETERS} parameters: {many}"


@pytest.mark.parametrize("source, expected", [
    ("def f(a, b, *c, d, **e): pass", 5),
    ("class K:\n def m(self, a, b): pass", 2),
])
def test_parameter_count(source, expected):
    fn = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef))
    assert _parameters(fn) == expected
