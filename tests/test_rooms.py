"""Room sizes and module boundaries of the project's own code, read from the source (AST).

The files checked are every tracked ``.py`` file outside ``tests/``, ``benchmarks/``,
``scripts/`` and any ``kernels/`` folder (kernels keep one stage per file and are sized by their
launch code, not by these limits). For those files:

* a file has at most ``MAX_FILE_LINES`` lines, a class at most ``MAX_CLASS_LINES``, a function or
  method at most ``MAX_FUNCTION_LINES`` (``end_lineno - lineno + 1``, decorators excluded);
* the file-level import graph, lazy (function-level) imports included and ``kernels/``
  included, has no cycle;
* no file uses another module's private name: no ``from m import _name``, no ``x._name`` where
  ``x`` is anything but ``self`` / ``cls`` / ``super()`` (module attributes included), no
  ``getattr(x, "_name")`` / ``setattr`` / ``hasattr`` with a private literal on anything but
  ``self`` / ``cls``. Dunder names (``__init__``, ``__dict__``) and the documented namedtuple
  methods (``_replace``, ``_asdict``, …) are public protocol; everything else private is used
  through ``self`` / ``cls`` alone, which keeps the rule mechanical.

``python tests/test_rooms.py`` prints the measured numbers (the over-size rooms, the cycles,
the private uses) instead of asserting them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 500
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 120
EXCLUDED_TOP = ("tests/", "benchmarks/", "scripts/")


def project_files(root: Path = ROOT, kernels: bool = False) -> list[Path]:
    """Tracked ``.py`` files under the size and boundary rules (see the module docstring);
    ``kernels=True`` keeps the ``kernels/`` folders (for the import graph, which spans them)."""
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=root, capture_output=True, text=True,
                         check=True).stdout.split()
    keep = [p for p in out if not p.startswith(EXCLUDED_TOP)
            and (kernels or "/kernels/" not in f"/{p}")]
    return [root / p for p in sorted(keep) if (root / p).exists()]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def oversized(files: list[Path], root: Path = ROOT) -> dict[str, list[str]]:
    """``{"files": [...], "classes": [...], "functions": [...]}``, each item ``"path:line name
    (N lines)"`` over its limit."""
    out: dict[str, list[str]] = {"files": [], "classes": [], "functions": []}
    for f in files:
        rel = f.relative_to(root)
        text = f.read_text()
        n = len(text.splitlines())
        if n > MAX_FILE_LINES:
            out["files"].append(f"{rel} ({n} lines)")
        for node in ast.walk(ast.parse(text, filename=str(f))):
            size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(
                node, "lineno") else 0
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS_LINES:
                out["classes"].append(f"{rel}:{node.lineno} {node.name} ({size} lines)")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    size > MAX_FUNCTION_LINES):
                out["functions"].append(f"{rel}:{node.lineno} {node.name} ({size} lines)")
    return out


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of dotted ``name`` that is a project module."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in modules:
            return cand
    return None


def import_graph(files: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """File-level import edges between project modules, lazy imports included.

    ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``; a
    plain ``import a.b.c`` at the longest existing module prefix. Implicit parent-package
    imports are not edges (they would make every package a cycle with its children)."""
    mods = {module_name(f, root): f for f in files}
    names = set(mods)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, f in mods.items():
        is_pkg = f.name == "__init__.py"
        parts = mod.split(".")
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = parts if is_pkg else parts[:-1]
                    base = base[:len(base) - node.level + 1]
                    pkg = ".".join([*base, node.module] if node.module else base)
                else:
                    pkg = node.module or ""
                targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in names else pkg
                           for a in node.names]
            for t in targets:
                r = _resolve(t, names)
                if r and r != mod:
                    graph[mod].add(r)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


_SELFISH = ("self", "cls")
# collections.namedtuple / typing.NamedTuple's documented methods: public despite the underscore
# (the underscore only keeps them from clashing with field names).
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults",
                            "_exit"})  # and os._exit, documented public


def _private(name: str) -> bool:
    return (name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
            and name not in NAMEDTUPLE_API)


def private_uses(files: list[Path], root: Path = ROOT) -> list[str]:
    """Every use of another object's or module's private name (see the module docstring)."""
    out: list[str] = []
    for f in files:
        rel = f.relative_to(root)
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.ImportFrom):
                out += [f"{rel}:{node.lineno} from {node.module} import {a.name}"
                        for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                v = node.value
                if isinstance(v, ast.Name) and v.id in _SELFISH:
                    continue
                if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and (
                        v.func.id == "super"):
                    continue
                out.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
                obj = node.args[0]
                if isinstance(obj, ast.Name) and obj.id in _SELFISH:
                    continue
                out.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return out


# --- the rules, as tests ------------------------------------------------------------------


def test_rooms_fit_their_limits():
    over = oversized(project_files())
    assert over == {"files": [], "classes": [], "functions": []}, over


def test_no_file_level_import_cycle():
    assert cycles(import_graph(project_files(kernels=True))) == []


def test_no_private_name_used_across_objects():
    assert private_uses(project_files()) == []


def test_checks_see_what_they_are_meant_to(tmp_path):
    """The three checks on a small tree with one defect of each kind."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p.b import g\n\ndef f():\n    from p import b\n"
                              "    return b._hidden + getattr(b, '_x') + b.pub\n")
    (pkg / "b.py").write_text("def g():\n    from p.a import f\n    return f\n"
                              "class C:\n    def m(self):\n        return self._y\n"
                              + "x = 1\n" * 3)
    (pkg / "c.py").write_text("from p.b import _hidden\n" + "def h():\n" + "    y = 1\n" * 130)
    files = sorted(pkg.glob("*.py"))
    assert cycles(import_graph(files, tmp_path)) == [["p.a", "p.b"]]
    uses = private_uses(files, tmp_path)
    assert [u.split(" ", 1)[1] for u in uses] == [
        "b._hidden", "getattr(b, '_x')", "from p.b import _hidden"]
    assert oversized(files, tmp_path)["functions"] == ["p/c.py:2 h (131 lines)"]


if __name__ == "__main__":
    fs = project_files()
    over = oversized(fs)
    cyc = cycles(import_graph(project_files(kernels=True)))
    priv = private_uses(fs)
    for k, v in over.items():
        print(f"{k} over the limit: {len(v)}")
        for x in v:
            print("   ", x)
    print(f"file-level import cycles: {len(cyc)}")
    for c in cyc:
        print("   ", " ↔ ".join(c))
    print(f"private names used across objects: {len(priv)}")
    for x in priv:
        print("   ", x)
