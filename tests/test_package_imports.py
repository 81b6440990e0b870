"""The import direction between the top-level packages (docs/CONTRIBUTING.md), read from the source.

Every ``import`` / ``from … import`` of every ``.py`` file of k3serve, router, worker, prefill,
decode, kvstore, deploy, simulate and cli counts — at module level or inside a function (a lazy import is a
dependency all the same). The package graph must have no cycle; router/ never imports torch,
k3serve.engine or k3serve.model; prefill/ and decode/ never import each other; the core
(k3serve/) imports none of kvstore, worker, router, the roles, deploy, simulate or cli; nothing
imports cli (the command line sits on top).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("k3serve", "router", "worker", "prefill", "decode", "kvstore", "deploy", "simulate",
            "cli")


def _imports(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute names of the modules ``path`` (under ``root``) imports, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    mod_parts = list(path.relative_to(root).with_suffix("").parts)
    if mod_parts[-1] == "__init__":
        mod_parts = mod_parts[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the file's package, up level-1 more
                base = mod_parts[:-node.level] if path.name != "__init__.py" else (
                    mod_parts[:len(mod_parts) - node.level + 1])
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)  # `from k3serve import engine`
    return out


@pytest.fixture(scope="module")
def imports() -> dict[str, dict[str, set[str]]]:
    """package → file (relative path) → imported module names."""
    out: dict[str, dict[str, set[str]]] = {}
    for pkg in PACKAGES:
        files = sorted((ROOT / pkg).rglob("*.py"))
        assert files, f"no python files in {pkg}/"
        out[pkg] = {str(f.relative_to(ROOT)): _imports(f) for f in files}
    return out


def _graph(imports: dict[str, dict[str, set[str]]]) -> dict[str, set[str]]:
    return {pkg: {n.split(".")[0] for names in files.values() for n in names
                  if n.split(".")[0] in PACKAGES and n.split(".")[0] != pkg}
            for pkg, files in imports.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_relative_imports_resolve(tmp_path):
    sub = tmp_path / "pkg" / "sub"
    sub.mkdir(parents=True)
    (sub / "mod.py").write_text("from . import x\nfrom ..y import z\n"
                                "def f():\n    import torch\n")
    (sub / "__init__.py").write_text("from .m import q\n")
    assert _imports(sub / "mod.py", tmp_path) == {"pkg.sub", "pkg.sub.x", "pkg.y", "pkg.y.z",
                                                  "torch"}
    assert _imports(sub / "__init__.py", tmp_path) == {"pkg.sub.m", "pkg.sub.m.q"}


def test_no_import_cycle_between_packages(imports):
    graph = _graph(imports)
    assert _cycle(graph) is None, f"import cycle: {' → '.join(_cycle(graph) or [])}"
    # the direction the cycle used to break: kvstore may use the core, never the reverse
    assert "kvstore" not in graph["k3serve"], graph["k3serve"]


def test_the_core_imports_no_outer_package(imports):
    bad = {f: sorted(n for n in names if n.split(".")[0] in PACKAGES
                     and n.split(".")[0] != "k3serve")
           for f, names in imports["k3serve"].items()}
    assert not {f: b for f, b in bad.items() if b}


def test_router_never_imports_torch_or_model_code(imports):
    banned = ("torch", "k3serve.engine", "k3serve.model", "k3serve.kernels", "triton")
    bad = {f: sorted(n for n in names if n == "torch" or n.startswith(tuple(
        b + "." for b in banned)) or n in banned)
           for f, names in imports["router"].items()}
    assert not {f: b for f, b in bad.items() if b}


@pytest.mark.parametrize("pkg,other", [("prefill", "decode"), ("decode", "prefill")])
def test_roles_never_import_each_other(imports, pkg, other):
    bad = {f: sorted(n for n in names if n.split(".")[0] == other)
           for f, names in imports[pkg].items()}
    assert not {f: b for f, b in bad.items() if b}


def test_the_graph_is_the_documented_one(imports):
    """The edges that exist (so a test of an empty graph cannot pass silently)."""
    graph = _graph(imports)
    assert {"k3serve", "kvstore"} <= graph["worker"]
    assert {"k3serve", "kvstore", "worker"} <= graph["prefill"]
    assert {"k3serve", "kvstore", "worker"} <= graph["decode"]
    assert "k3serve" in graph["router"] and "k3serve" in graph["deploy"]
    assert {"k3serve", "deploy", "simulate"} <= graph["cli"]


def test_nothing_imports_the_command_line(imports):
    graph = _graph(imports)
    assert not {pkg for pkg, deps in graph.items() if "cli" in deps}
