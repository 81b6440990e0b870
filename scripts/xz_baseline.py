"""``xz -9e`` bits per byte on the held-out stdlib files: the baseline ``k3-tiny`` must beat.

Each file is compressed on its own, from a fresh start (no dictionary shared between files),
exactly as ``xz -9e -c FILE | wc -c`` does: Python's :mod:`lzma` with
``format=FORMAT_XZ, preset=9 | PRESET_EXTREME`` and the default CRC64 check runs the same
liblzma encoder with the same settings and produces an output of the same size (the
container's headers, index and check included — ``--check-cli`` compares against the ``xz``
program where one is installed).

Bits per byte of a file = ``8 × compressed bytes / raw bytes``; the figure over a set of files
is size-weighted: ``8 × Σ compressed / Σ raw``.

Usage::

    python scripts/xz_baseline.py                   # held-out files of this Python's stdlib
    python scripts/xz_baseline.py --dir tests/data/heldout_sample
    python scripts/xz_baseline.py --check-cli       # also run the xz program and compare
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stdlib_data

XZ_PRESET = 9 | lzma.PRESET_EXTREME


def xz_size(data: bytes) -> int:
    """Bytes of ``xz -9e`` output for ``data`` (fresh encoder, ``.xz`` container, CRC64)."""
    return len(lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET))


def xz_cli_size(path: str | Path) -> int:
    """Bytes of ``xz -9e -c PATH`` from the ``xz`` program.

    Raises:
        FileNotFoundError: no ``xz`` on ``PATH``.
    """
    exe = shutil.which("xz")
    if exe is None:
        raise FileNotFoundError("xz program not found on PATH")
    return len(subprocess.run([exe, "-9e", "-c", str(path)], check=True, capture_output=True).stdout)


def xz_bits_per_byte(files: dict[str, bytes]) -> tuple[dict[str, float], float]:
    """Per-file ``xz -9e`` bits per byte and the size-weighted mean over ``files``.

    Args:
        files: name → raw bytes (each non-empty).

    Returns:
        ``({name: bits_per_byte}, size_weighted_bits_per_byte)``.
    """
    per, total_raw, total_xz = {}, 0, 0
    for name, data in files.items():
        if not data:
            raise ValueError(f"{name}: empty file has no bits per byte")
        n = xz_size(data)
        per[name] = 8.0 * n / len(data)
        total_raw += len(data)
        total_xz += n
    return per, 8.0 * total_xz / total_raw


def load_eval_files(directory: str | Path | None = None,
                    stdlib: str | Path | None = None) -> dict[str, bytes]:
    """The files to score: every file in ``directory`` (sorted), or else the committed held-out
    list read from ``stdlib`` (default: this Python's stdlib).
    """
    if directory is not None:
        return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}
    rels = stdlib_data.load_heldout_list()
    return dict(zip(rels, stdlib_data.read_files(stdlib, rels)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="score every file in this folder")
    ap.add_argument("--stdlib", type=Path, default=None, help="stdlib folder (default: this Python's)")
    ap.add_argument("--check-cli", action="store_true", help="compare sizes with the xz program")
    args = ap.parse_args(argv)
    files = load_eval_files(args.dir, args.stdlib)
    per, mean = xz_bits_per_byte(files)
    base = args.dir or args.stdlib or stdlib_data.stdlib_root()
    print(f"{'file':<40} {'bytes':>8} {'xz bytes':>9} {'xz bits/B':>9}")
    ok = True
    for name, data in files.items():
        n = xz_size(data)
        line = f"{name:<40} {len(data):>8} {n:>9} {per[name]:>9.3f}"
        if args.check_cli:
            path = Path(base) / name
            cli = xz_cli_size(path)
            ok &= cli == n
            line += f"  cli {cli}{'' if cli == n else '  MISMATCH'}"
        print(line)
    total = sum(len(d) for d in files.values())
    print(f"{len(files)} files, {total:,} bytes: xz -9e size-weighted {mean:.3f} bits/byte")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
