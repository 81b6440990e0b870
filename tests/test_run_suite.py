"""``make test``'s runner (tests/run_suite.py): which extra arguments it refuses, what each
phase's pytest command is, and how the phases' exit statuses combine."""

from __future__ import annotations

import sys

import pytest

from tests import run_suite
from tests.run_suite import _pytest, _selects_markers, _status, main


@pytest.mark.parametrize("arg", ["-m", "-mslow", "-qm", "-qmslow", "-vxm", "-xqm slow"])
def test_marker_selection_is_refused_in_any_spelling(arg, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--sequential", "--", arg])
    assert e.value.code == 2
    assert "-m: each phase selects its tests by marker" in capsys.readouterr().err


@pytest.mark.parametrize("arg", ["-k", "-kmodel", "-qkmodel", "-pno:cacheprovider", "--maxfail=1",
                                 "-x", "model", "-n", "-rfm"])
def test_other_options_are_not_taken_for_marker_selection(arg):
    """An ``m`` inside the value of a short option (``-kmodel``: ``-k model``) or a long
    option is not ``-m``."""
    assert not _selects_markers(arg)


def test_each_phase_runs_the_tests_folder_unless_files_are_named():
    base = [sys.executable, "-m", "pytest", *run_suite.COMMON, "-m", "stacks"]
    assert _pytest(["-m", "stacks"], []) == [*base, "tests"]
    assert _pytest(["-m", "stacks"], ["-k", "drain"]) == [*base, "-k", "drain", "tests"]
    assert _pytest(["-m", "stacks"], ["tests/test_doc_paths.py"]) == [
        *base, "tests/test_doc_paths.py"]
    assert _pytest(["-m", "stacks"], ["-x", "tests/test_doc_paths.py::test_x"]) == [
        *base, "-x", "tests/test_doc_paths.py::test_x"]
    # a name that is no path here (a -k value, say) leaves the folder in
    assert _pytest(["-m", "stacks"], ["-k", "no_such_file.py"])[-1] == "tests"


def test_the_first_failing_phase_decides_and_an_empty_phase_passes_only_a_narrowed_run():
    order = ("in-process", "serial", "stacks")
    assert _status({"in-process": 0, "serial": 0, "stacks": 0}, order, False) == 0
    assert _status({"in-process": 0, "serial": 1, "stacks": 2}, order, False) == 1
    assert _status({"in-process": 5, "serial": 0, "stacks": 0}, order, False) == 5
    assert _status({"in-process": 5, "serial": 0, "stacks": 5}, order, True) == 0
    assert _status({"in-process": 0, "serial": 0}, order, False) == 1  # a phase that never ran
