"""The device carry (``scripts/gpu_carry.sh``) holds what the serving path imports.

The GPU machine has its own image (PyTorch, Triton, the Hugging Face stack) and reaches no
registry: every other third-party module that the router, the workers, the kvstore and the core
import at module level must be among the script's ``WHEELS`` (carried as wheels) or its
``ON_IMAGE`` list. A module imported only inside a function or under ``try`` (optional
features: Ray, matplotlib, OpenTelemetry's SDK) is not required. Mooncake travels separately
(``mc.tar.xz``).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from tests.test_dependencies import import_name

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_carry.sh"
#: the packages a served stack runs (``deploy/launcher.py`` and ``deploy/serve.py`` start it)
RUNTIME = ("router", "worker", "prefill", "decode", "kvstore", "k3serve")
RUNTIME_FILES = ("deploy/launcher.py", "deploy/serve.py", "deploy/supervisor.py")
LOCAL = {"router", "worker", "prefill", "decode", "kvstore", "k3serve", "deploy", "cli",
         "simulate", "benchmarks", "tests", "kernels", "scripts"}
def bash_array(name: str) -> list[str]:
    """The words of ``NAME=(…)`` in the script (versions dropped)."""
    m = re.search(rf"^{name}=\((.*?)\)", SCRIPT.read_text(), re.DOTALL | re.MULTILINE)
    assert m, f"{SCRIPT.name} has no {name}=(…) list"
    return [re.split(r"[=<>]", w)[0] for w in m.group(1).split()]


def top_level_imports(path: Path) -> set[str]:
    """Modules imported at module level of ``path`` (not in a function, class or ``try``)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_the_carry_and_the_image_cover_every_import_of_the_serving_path():
    available = {import_name(d.lower()) for d in
                 bash_array("WHEELS") + bash_array("ON_IMAGE")} | {"mooncake"}
    files = [f for pkg in RUNTIME for f in (ROOT / pkg).rglob("*.py")]
    files += [ROOT / f for f in RUNTIME_FILES]
    missing: dict[str, list[str]] = {}
    for f in files:
        for mod in top_level_imports(f) - LOCAL - set(sys.stdlib_module_names) - available:
            missing.setdefault(mod, []).append(str(f.relative_to(ROOT)))
    assert not missing, (
        f"imported by the serving path but neither carried nor on the device image "
        f"(add them to WHEELS in {SCRIPT.relative_to(ROOT)}): {missing}")


#: declared dependencies a served stack does not load (``k3serve simulate --plot``)
NOT_SERVING = {"matplotlib"}


def test_every_declared_dependency_is_carried_or_on_the_image():
    """Modules loaded by name rather than imported (uvicorn's ``http="httptools"`` and
    ``loop="uvloop"``) are declared dependencies: each must travel too."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[\s=<>;\[]", d, maxsplit=1)[0].lower() for d in deps}
    listed = {w.lower() for w in bash_array("WHEELS") + bash_array("ON_IMAGE")}
    assert not names - NOT_SERVING - listed, (
        f"declared but neither carried nor on the device image: {names - NOT_SERVING - listed}")


def test_the_lists_are_read():
    assert "fastapi" in bash_array("WHEELS") and "torch" in bash_array("ON_IMAGE")
