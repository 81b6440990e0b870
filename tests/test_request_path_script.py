"""``scripts/request_path_coverage.function_lines``: the lines of the innermost functions that
ran, whole, plus the executed lines outside every function."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SRC = '''import os

X = 1


def a():
    y = 1

    def inner():
        return 2

    return inner()


def b():
    return 3
'''


def load_script():
    spec = importlib.util.spec_from_file_location(
        "request_path_coverage", ROOT / "scripts" / "request_path_coverage.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_function_lines_counts_innermost_functions_whole_and_module_lines(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(SRC)
    fl = load_script().function_lines
    assert fl(f, set()) == 0
    assert fl(f, {1, 3}) == 2  # two module-level lines, no function
    assert fl(f, {7}) == 7  # a line of a(): a() whole, lines 6-12
    assert fl(f, {10}) == 2  # a line of inner(): inner() only, lines 9-10
    assert fl(f, {7, 10, 12}) == 7  # inner() lies inside a(): counted once
    assert fl(f, {7, 16}) == 7 + 2  # a() and b()
