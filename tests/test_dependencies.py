"""Every dependency pyproject.toml declares is used by the repository.

A declared distribution (``[project] dependencies`` and every extra of
``[project.optional-dependencies]``) counts as used when some ``.py`` file of the repository
(the packages, tests, benchmarks, scripts; not ``.venv``) imports its import name —
``import X``, ``import X.y``, ``from X import …`` or ``from X.y import …``, at any
indentation (lazy imports count). ``IMPORT_NAMES`` maps distribution names to import names
where they differ. Distributions that are used without being imported are listed in
``USED_WITHOUT_IMPORT`` with the file and the text that shows the use; the test checks that
text is there, so an exemption cannot outlive its reason.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".devcarry"}

#: distribution name (normalised: lower case, ``_`` → ``-``) → import name
IMPORT_NAMES = {
    "pyyaml": "yaml",
    "pydantic-settings": "pydantic_settings",
    "prometheus-client": "prometheus_client",
    "sse-starlette": "sse_starlette",
    "fla-core": "fla",
    "compressed-tensors": "compressed_tensors",
    "mooncake-transfer-engine": "mooncake",
    "mooncake-transfer-engine-non-cuda": "mooncake",
    "mooncake-transfer-engine-cuda13": "mooncake",
    "opentelemetry-sdk": "opentelemetry",
    "opentelemetry-exporter-otlp-proto-http": "opentelemetry",
    "opentelemetry-api": "opentelemetry",
    "python-dotenv": "dotenv",
    "rpds-py": "rpds",
}

#: distribution → (why it is not imported, file that shows the use, text in that file)
USED_WITHOUT_IMPORT = {
    # uvicorn loads its C HTTP parser by name: the router passes http="httptools"
    "httptools": ("uvicorn's HTTP parser, chosen by name", "router/config.py",
                  'ROUTER_HTTP = "httptools"'),
    # a pytest plugin: it reads the ``timeout`` option of [tool.pytest.ini_options]
    "pytest-timeout": ("pytest plugin for the suite's timeout", "pyproject.toml",
                       "timeout = "),
    # a pytest plugin: ``make test`` (tests/run_suite.py) runs its phases with ``-n 2``
    "pytest-xdist": ("pytest plugin for the suite's two workers", "tests/run_suite.py",
                     '"-n", "2"'),
    # the linter, run on the command line; its settings live in pyproject.toml
    "ruff": ("the linter, a command-line tool", "pyproject.toml", "[tool.ruff]"),
}


def normalise(dist: str) -> str:
    return re.split(r"[<>=!~;\[ ]", dist.strip(), maxsplit=1)[0].lower().replace("_", "-")


def declared() -> dict[str, str]:
    """Every declared distribution → where it is declared (``main`` or the extra's name)."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {normalise(d): "main" for d in meta.get("dependencies", [])}
    for extra, deps in meta.get("optional-dependencies", {}).items():
        for d in deps:
            out.setdefault(normalise(d), extra)
    return out


def imported_names(root: Path = ROOT) -> set[str]:
    """Top-level module names imported by any ``.py`` file of the repository."""
    names: set[str] = set()
    # a whole import statement on its line (prose such as "import the pools" does not match)
    pat = re.compile(
        r"^\s*(?:from\s+([A-Za-z_]\w*)[\w.]*\s+import\s+[\w(*]"
        r"|import\s+([\w.]+(?:\s+as\s+\w+)?(?:\s*,\s*[\w.]+(?:\s+as\s+\w+)?)*)\s*(?:#.*)?$)",
        re.MULTILINE,
    )
    for p in root.rglob("*.py"):
        parts = p.relative_to(root).parts
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in parts):
            continue
        for m in pat.finditer(p.read_text(encoding="utf-8", errors="replace")):
            if m.group(1):
                names.add(m.group(1))
            else:
                for item in m.group(2).split(","):
                    mod = item.strip().split(" ")[0].split(".")[0]
                    if mod.isidentifier():
                        names.add(mod)
    return names


def import_name(dist: str) -> str:
    return IMPORT_NAMES.get(dist, dist.replace("-", "_"))


def test_import_statements_recognised(tmp_path):
    (tmp_path / "m.py").write_text(
        "import a.b as c, d\n    from e.f import (g)\nimport the pools here\n")
    assert imported_names(tmp_path) == {"a", "d", "e"}


def test_mapping_rules():
    assert normalise("pydantic-settings>=2.2") == "pydantic-settings"
    assert normalise("ray[default]>=2.9") == "ray"
    assert normalise("uvloop>=0.19; sys_platform != 'win32'") == "uvloop"
    assert normalise("Jinja2>=3.1") == "jinja2"
    assert import_name("pyyaml") == "yaml"
    assert import_name("jinja2") == "jinja2"


def test_exemptions_still_hold():
    for dist, (why, path, text) in USED_WITHOUT_IMPORT.items():
        assert text in (ROOT / path).read_text(), f"{dist} ({why}): {text!r} not in {path}"


def test_every_declared_dependency_is_imported():
    names = imported_names()
    missing = [f"{dist} (declared in {where}; import name {import_name(dist)})"
               for dist, where in sorted(declared().items())
               if dist not in USED_WITHOUT_IMPORT and import_name(dist) not in names]
    assert not missing, "declared but never imported:\n" + "\n".join(missing)
