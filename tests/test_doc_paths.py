"""Every repository path cited in the repository's ``.py`` and ``.md`` files exists.

What counts as a cited path (the rules the test applies, in order):

1. **Repository paths.** A token ``TOP/rest`` in any ``.py`` or ``.md`` file, where ``TOP`` is
   a top-level folder of the repository (``k3serve``, ``router``, ``docs``, ``tests``, …),
   ``rest`` is made of path characters (letters, digits, ``_ . - /`` and the glob / brace
   characters ``* { } ,``), the token is not preceded by a path character, ``.``, ``/`` or
   ``:`` (so ``/tmp/x``, ``../x``, URLs and module paths ``a.b`` are not tokens), and the token
   ends in a file suffix (``.py``, ``.md``, ``.json``, ``.yaml``, …) or in ``/`` (a folder).
   ``{a,b}`` is expanded; a token with ``*`` must match at least one file. It must exist
   relative to the repository root — or, in a ``.md`` file, relative to that file's folder
   (``docs/results/simulate.md`` citing ``simulate/simulate_sweep.json`` beside it).
2. **Root files.** ``README.md``, ``Makefile``, ``pyproject.toml`` cited bare must exist at the
   root (they always do; the rule keeps them honest if one is renamed).
3. **Bare Markdown names.** A token ``NAME.md`` without a folder (``DESIGN.md``,
   ``STYLE.md``, ``INTERFACES.md``) must name a file at the root, in ``docs/`` or beside the
   citing file — except, in ``.py`` files, a whole string literal (``"table.md"``: a name the
   code writes).
4. **Markdown links.** In ``.md`` files, the target of ``[text](target)`` that is not a URL
   or an anchor must exist relative to the Markdown file (its ``#anchor`` dropped).

Tokens that hold a placeholder (``<…>``, ``…``, ``$``, ``%``, an f-string's ``{name}``) are not
citations. Files under ``.venv``, ``.git``, build outputs and ``tests/data`` (data, not prose)
are not scanned, nor this file (its examples).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".devcarry", ".ruff_cache",
             ".pytest_cache", "node_modules"}
SKIP_PREFIXES = ("tests/data/",)
SKIP_FILES = {"tests/test_doc_paths.py"}  # its own examples of the rules
SUFFIXES = (".py", ".md", ".json", ".jsonl", ".yaml", ".yml", ".toml", ".sh", ".txt", ".log",
            ".png", ".safetensors", ".jinja", ".cfg", ".ini")
ROOT_FILES = ("README.md", "Makefile", "pyproject.toml")
PATH_CHARS = r"[A-Za-z0-9_.\-/*{},]"


def top_folders() -> list[str]:
    return sorted(p.name for p in ROOT.iterdir()
                  if p.is_dir() and p.name not in SKIP_DIRS and not p.name.startswith(".")
                  and not p.name.endswith(".egg-info"))


def scanned_files() -> list[Path]:
    out = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if p.suffix not in (".py", ".md") or not p.is_file():
            continue
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if str(rel).startswith(SKIP_PREFIXES) or str(rel) in SKIP_FILES:
            continue
        out.append(p)
    return sorted(out)


def expand_braces(token: str) -> list[str]:
    """``a/{b,c}.json`` → ``a/b.json``, ``a/c.json`` (every brace group, left to right)."""
    parts = re.split(r"(\{[^{}]*\})", token)
    choices = [p[1:-1].split(",") if p.startswith("{") and p.endswith("}") else [p]
               for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def exists(rel: str, base: Path = ROOT) -> bool:
    rel = rel.rstrip(",")
    for alt in expand_braces(rel):
        if "*" in alt:
            if not any(base.glob(alt.rstrip("/"))):
                return False
        elif not (base / alt).exists():
            return False
    return True


def is_placeholder(token: str) -> bool:
    if any(c in token for c in "<>…$%"):
        return True
    # an f-string field or a format field: {name} with no comma inside
    return bool(re.search(r"\{[^{},]*\}", token))


def cited_paths(text: str, is_md: bool, tops: list[str]) -> list[tuple[str, str]]:
    """The citations in ``text``: ``(kind, token)`` with kind ``root`` or ``link``."""
    found: list[tuple[str, str]] = []
    top_alt = "|".join(re.escape(t) for t in tops)
    repo = re.compile(rf"(?<![A-Za-z0-9_.\-/:])((?:{top_alt})/{PATH_CHARS}*)")
    for m in repo.finditer(text):
        tok = m.group(1).rstrip(".,")
        if is_placeholder(tok):
            continue
        if tok.endswith("/") or tok.endswith(SUFFIXES):
            found.append(("root", tok))
    bare = re.compile(r"(?<![A-Za-z0-9_.\-/:])([A-Za-z0-9_\-]+\.md)\b")
    for m in bare.finditer(text):
        name = m.group(1)
        around = text[m.start() - 1 : m.end() + 1]
        if not is_md and around[:1] in "\"'" and around[-1:] == around[:1]:
            continue  # a Python string literal: a file name the code writes, not a citation
        found.append(("bare-md", name))
    for name in ROOT_FILES:
        if re.search(rf"(?<![A-Za-z0-9_.\-/]){re.escape(name)}\b", text):
            found.append(("root", name))
    if is_md:
        for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            found.append(("link", target.split("#", 1)[0]))
    return found


def broken_citations() -> list[str]:
    tops = top_folders()
    bad = []
    for f in scanned_files():
        rel_file = f.relative_to(ROOT)
        text = f.read_text(encoding="utf-8", errors="replace")
        for kind, tok in cited_paths(text, f.suffix == ".md", tops):
            if kind == "root":
                ok = exists(tok) or (f.suffix == ".md" and exists(tok, f.parent))
            elif kind == "bare-md":
                ok = (ROOT / tok).exists() or (ROOT / "docs" / tok).exists() or (
                    f.parent / tok).exists()
            else:  # link, relative to the Markdown file
                ok = not tok or exists(tok, f.parent)
            if not ok:
                bad.append(f"{rel_file}: {tok}")
    return sorted(set(bad))


def test_rules_on_examples():
    tops = ["docs", "k3serve"]
    text = ("see `k3serve/cache/specs.py`, /tmp/k3serve/x.py, ../docs/a.md, k3serve.cache.x, "
            "docs/{a,b}.md, k3serve/<name>.py, k3serve/{name}.py, docs/ and DESIGN.md "
            "[x](results/README.md#top) [y](https://e.org/a.md)")
    assert cited_paths('open("table.md")', False, tops) == []
    got = cited_paths(text, True, tops)
    assert ("root", "k3serve/cache/specs.py") in got
    assert ("root", "docs/{a,b}.md") in got
    assert ("root", "docs/") in got
    assert ("bare-md", "DESIGN.md") in got
    assert ("link", "results/README.md") in got
    assert not any("tmp" in t or t.startswith("..") or "<" in t for _, t in got)
    assert ("root", "k3serve/{name}.py") not in got
    assert not any(t.startswith("https") for _, t in got)
    assert expand_braces("a/{b,c}.json") == ["a/b.json", "a/c.json"]


def test_every_cited_path_exists():
    bad = broken_citations()
    assert not bad, f"{len(bad)} cited paths do not exist:\n" + "\n".join(bad)
