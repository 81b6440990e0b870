"""The Python standard library's own ``.py`` files as training / held-out data for ``k3-tiny``.

Every machine has them (CI, this box, the H200 with Python 3.12), so the embedded checkpoint
is reproducible without downloads.

What counts as a stdlib file (:func:`list_stdlib_files`):

* every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (or ``--stdlib DIR``), found
  recursively, symbolic links not followed;
* except anything below a directory named ``site-packages`` or ``dist-packages`` (third-party
  code, not the stdlib), ``__pycache__``, or a test suite: a directory named ``test``,
  ``tests`` or ``idle_test`` (this covers ``test/``, ``idlelib/idle_test``,
  ``lib2to3/tests``, ``tkinter/test``, ``ctypes/test``, ``unittest/test``,
  ``distutils/tests`` in 3.11). Test suites are excluded because they are large, repetitive
  and, on Debian/Ubuntu, packaged separately (so machines differ in whether they have them).

Order is deterministic: relative POSIX paths sorted as strings.

The held-out list (``tests/data/heldout_files.txt``, committed) was chosen once by
:func:`choose_heldout` (``--make-heldout``) from files that exist **byte-identical** in two
stdlib copies (3.11 and 3.12 here), so the held-out figure means the same bytes on this box
and on the 3.12 GPU machine; modules that Debian ships in separate packages or that 3.12
removed (``tkinter``, ``turtle*``, ``idlelib``, ``lib2to3``, ``distutils``, ``ensurepip``,
``asyncore``, ``asynchat``, ``smtpd``, ``imp``) and the generated codec tables of
``encodings/`` are never held out (:data:`NEVER_HELD_OUT`). Selection: sort the
candidates by size, cut them into ``n`` bins of equal count, and in each bin take the file
whose ``sha256(relative path)`` is smallest — a deterministic spread of sizes.

The committed CI sample (``tests/data/heldout_sample/``) holds copies of a few small held-out
files (``--make-sample``), named by their relative path with ``/`` → ``__`` plus ``.txt`` (so
neither pytest nor ruff treats them as code).

Usage::

    python scripts/stdlib_data.py                      # summary of this machine's split
    python scripts/stdlib_data.py --make-heldout --other-stdlib /path/to/python3.12
    python scripts/stdlib_data.py --make-sample
    python scripts/stdlib_data.py --export-heldout .heldout/stdlib   # for scripts/device_train.sh
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HELDOUT_LIST = REPO / "tests" / "data" / "heldout_files.txt"
HELDOUT_SAMPLE = REPO / "tests" / "data" / "heldout_sample"

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                           "idle_test"})
"""Directory names whose contents are never stdlib data (see the module docstring)."""

NEVER_HELD_OUT = ("tkinter/", "turtle", "idlelib/", "lib2to3/", "distutils/", "ensurepip/",
                  "asyncore.py", "asynchat.py", "smtpd.py", "imp.py", "encodings/")
"""Path prefixes never chosen for the held-out list: modules that can be missing on some
machines, and ``encodings/`` (generated codec tables, a sixth of the stdlib's files but nearly
half of those unchanged between 3.11 and 3.12: they would make the held-out set a table
benchmark rather than a code benchmark). They all stay in the training data."""


def stdlib_root() -> Path:
    """This interpreter's stdlib folder (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: str | os.PathLike[str] | None = None) -> list[str]:
    """Relative POSIX paths of the stdlib ``.py`` files under ``root``, sorted.

    Args:
        root: the stdlib folder; default :func:`stdlib_root`.

    Raises:
        FileNotFoundError: ``root`` is not a directory.
    """
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise FileNotFoundError(f"stdlib folder {str(base)!r} does not exist")
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for fn in filenames:
            if fn.endswith(".py"):
                p = Path(dirpath, fn)
                if p.is_file():
                    out.append(p.relative_to(base).as_posix())
    return sorted(out)


def load_heldout_list(path: str | os.PathLike[str] = HELDOUT_LIST) -> list[str]:
    """The committed held-out relative paths (``#`` comments and blank lines ignored)."""
    with open(path, encoding="utf-8") as f:
        lines = [ln.strip() for ln in f]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def training_files(root: str | os.PathLike[str] | None = None,
                   heldout: list[str] | None = None) -> list[str]:
    """Every stdlib file under ``root`` except the held-out ones, sorted."""
    held = set(load_heldout_list() if heldout is None else heldout)
    return [p for p in list_stdlib_files(root) if p not in held]


def read_files(root: str | os.PathLike[str] | None, rel_paths: list[str]) -> list[bytes]:
    """Raw bytes of each relative path under ``root`` (default: this stdlib)."""
    base = Path(root) if root is not None else stdlib_root()
    return [(base / p).read_bytes() for p in rel_paths]


def _sha(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def choose_heldout(roots: list[Path], n: int = 40, min_bytes: int = 1000,
                   max_bytes: int = 150_000) -> list[str]:
    """Deterministic held-out choice (module docstring): identical in every root, size-binned.

    Args:
        roots: stdlib folders that must all hold each chosen file with the same bytes.
        n: number of files (bins).
        min_bytes, max_bytes: size range of the candidates.
    """
    common = set(list_stdlib_files(roots[0]))
    for r in roots[1:]:
        common &= set(list_stdlib_files(r))
    cands: list[tuple[int, str]] = []
    for rel in sorted(common):
        if rel.startswith(NEVER_HELD_OUT):
            continue
        data = [(r / rel).read_bytes() for r in roots]
        if any(d != data[0] for d in data[1:]) or not (min_bytes <= len(data[0]) <= max_bytes):
            continue
        cands.append((len(data[0]), rel))
    if len(cands) < n:
        raise ValueError(f"only {len(cands)} candidate files for {n} held-out bins")
    cands.sort()
    chosen = []
    for b in range(n):
        lo, hi = b * len(cands) // n, (b + 1) * len(cands) // n
        chosen.append(min(cands[lo:hi], key=lambda c: _sha(c[1]))[1])
    return sorted(chosen)


def sample_name(rel: str) -> str:
    """File name of a held-out file's copy in ``tests/data/heldout_sample/``."""
    return rel.replace("/", "__") + ".txt"


def choose_sample(heldout: list[str], root: Path, k: int = 3, max_file: int = 3000) -> list[str]:
    """The ``k`` held-out files of at most ``max_file`` bytes with the smallest path hash."""
    small = [p for p in heldout if (root / p).stat().st_size <= max_file]
    return sorted(sorted(small, key=_sha)[:k])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stdlib", type=Path, default=None, help="stdlib folder (default: this Python's)")
    ap.add_argument("--make-heldout", action="store_true", help="(re)write tests/data/heldout_files.txt")
    ap.add_argument("--other-stdlib", type=Path, action="append", default=[],
                    help="another stdlib folder the held-out files must be identical in")
    ap.add_argument("-n", type=int, default=40, help="held-out files (with --make-heldout)")
    ap.add_argument("--make-sample", action="store_true", help="(re)write tests/data/heldout_sample/")
    ap.add_argument("--export-heldout", type=Path, default=None, metavar="DIR",
                    help="copy the held-out files to DIR/<relative path> (to score exactly these "
                         "bytes on a machine whose stdlib differs, e.g. with eval_bpb --stdlib DIR)")
    args = ap.parse_args(argv)
    root = args.stdlib or stdlib_root()

    if args.make_heldout:
        roots = [root, *args.other_stdlib]
        chosen = choose_heldout(roots, n=args.n)
        HELDOUT_LIST.parent.mkdir(parents=True, exist_ok=True)
        header = [
            "# Held-out stdlib files for k3-tiny (relative to sysconfig stdlib), one per line.",
            "# Chosen by scripts/stdlib_data.py --make-heldout: byte-identical in "
            + ", ".join(f"Python {_version_of(r)}" for r in roots) + ";",
            "# size-binned, smallest sha256(path) per bin. Never trained on. Do not edit by hand.",
        ]
        HELDOUT_LIST.write_text("\n".join(header + chosen) + "\n", encoding="utf-8")
        print(f"wrote {len(chosen)} paths to {HELDOUT_LIST}")
    if args.make_sample:
        held = load_heldout_list()
        sample = choose_sample(held, root)
        if HELDOUT_SAMPLE.exists():
            shutil.rmtree(HELDOUT_SAMPLE)
        HELDOUT_SAMPLE.mkdir(parents=True)
        for rel in sample:
            (HELDOUT_SAMPLE / sample_name(rel)).write_bytes((root / rel).read_bytes())
        total = sum(f.stat().st_size for f in HELDOUT_SAMPLE.iterdir())
        print(f"wrote {len(sample)} files ({total} bytes) to {HELDOUT_SAMPLE}")

    if args.export_heldout:
        for rel in load_heldout_list():
            dst = args.export_heldout / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel, dst)
        print(f"copied the held-out files to {args.export_heldout}")

    files = list_stdlib_files(root)
    held = set(load_heldout_list()) if HELDOUT_LIST.exists() else set()
    missing = sorted(held - set(files))
    train = [p for p in files if p not in held]
    tb = sum((root / p).stat().st_size for p in train)
    hb = sum((root / p).stat().st_size for p in held if p not in missing)
    print(f"stdlib {root} (Python {sys.version.split()[0]})")
    print(f"  training: {len(train)} files, {tb:,} bytes")
    print(f"  held out: {len(held) - len(missing)} files, {hb:,} bytes")
    if missing:
        print(f"  held-out files missing here: {missing}")
        return 1
    return 0


def _version_of(root: Path) -> str:
    name = root.name  # e.g. python3.12
    return name[len("python"):] if name.startswith("python") else str(root)


if __name__ == "__main__":
    sys.exit(main())
