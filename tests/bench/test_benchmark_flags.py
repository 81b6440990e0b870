"""The store and transfer benchmarks: every flag has a help text, and the store benchmark
prints its clients' counters as words (not a dataclass repr). Every CPU benchmark refuses a
bad flag (a count below 1, a duration that is no positive number, an input file that cannot be
read, an output file in a missing folder) while it parses its flags: exit status 2 and an
error line naming the flag and the value."""

from __future__ import annotations

import argparse
import importlib
import sys

import pytest

from benchmarks import store, transfer
from k3serve.process import (
    input_file,
    nonnegative_float,
    nonnegative_int,
    output_file,
    positive_float,
    positive_int,
)
from kvstore.store.client import StoreStats


@pytest.mark.parametrize("module", [store, transfer], ids=["store", "transfer"])
def test_every_benchmark_flag_has_a_help_text(module):
    parser = module.build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]
    assert [a.option_strings[0] for a in flags if not (a.help or "").strip()] == []
    assert parser.description


def test_store_stats_are_printed_as_words():
    s = StoreStats(puts=650, put_bytes=12_345_678, put_skipped=3, put_dropped=1, gets=640,
                   get_bytes=12_000_000, failures=2, gone=0)
    assert store.stats_line("writer", s) == (
        "writer: 650 puts (12.35 MB), 3 skipped (key present), 1 dropped, 640 gets "
        "(12.00 MB), 2 failures, 0 gone")


NO_FILE = "(No such file or directory)"
REFUSED = [  # (benchmark, its arguments, the start of the error line after "NAME.py: error: ")
    ("model_cpu", ["--repeats", "-1"], "argument --repeats: must be an integer ≥ 1, got '-1'"),
    ("model_cpu", ["--model", "nope"], "--model: 'nope' is neither a preset"),
    ("model_cpu", ["--json", "/nonexistent_dir_zz/b.json", "--repeats", "1"],
     f"argument --json: cannot write /nonexistent_dir_zz/b.json {NO_FILE}"),
    ("model_cpu", ["--threads", "-2"], "argument --threads: must be an integer ≥ 0, got '-2'"),
    ("engine_cpu", ["--trace", "/nonexistent"], f"argument --trace: cannot read /nonexistent {NO_FILE}"),
    ("engine_cpu", ["--model", "nope"], "--model: 'nope' is neither a preset"),
    ("engine_cpu", ["--block-size", "0"], "argument --block-size: must be an integer ≥ 1, got '0'"),
    ("transfer", ["--reps", "0"], "argument --reps: must be an integer ≥ 1, got '0'"),
    ("transfer", ["--presets", "nope"], "--presets: nope not among"),
    ("transfer", ["--device", "gpu"], "argument --device: must be cpu, cuda or cuda:N"),
    ("store", ["--reps", "-1"], "argument --reps: must be an integer ≥ 1, got '-1'"),
    ("router_placement", ["--blocks", "-1"], "argument --blocks: must be an integer ≥ 1, got '-1'"),
    ("router_placement", ["--workers", "0"], "argument --workers: must be an integer ≥ 1, got '0'"),
    ("router_placement", ["--workers", "1"], "--workers: must be ≥ 2"),
    ("router_placement", ["--iters", "0"], "argument --iters: must be an integer ≥ 1, got '0'"),
    ("grammar_mask", ["--batch", "0"], "argument --batch: must be an integer ≥ 1, got '0'"),
    ("grammar_mask", ["--steps", "-3"], "argument --steps: must be an integer ≥ 1, got '-3'"),
    ("expert_placement", ["--counts", "/nonexistent"],
     f"argument --counts: cannot read /nonexistent {NO_FILE}"),
    ("expert_placement", ["--ranks", "0"], "argument --ranks: must be an integer ≥ 1, got '0'"),
    ("simulate_sweep", ["/nonexistent"], f"argument trace: cannot read /nonexistent {NO_FILE}"),
    ("simulate_sweep", ["traces/mooncake_ci_slice_3940_3963.jsonl", "--fraction", "nan"],
     "argument --fraction: must be a finite number > 0, got 'nan'"),
    ("simulate_sweep", ["traces/mooncake_ci_slice_3940_3963.jsonl", "--set", "nope=1"],
     "--set: expected HomeParams field=number pairs"),
    ("simulate_grid", ["--traces", "/nonexistent"],
     f"argument --traces: cannot read /nonexistent {NO_FILE}"),
    ("simulate_grid", ["--traces", "traces/mooncake_ci_slice_3940_3963.jsonl", "--jobs", "0"],
     "argument --jobs: must be an integer ≥ 1, got '0'"),
    ("simulate_snapshots", ["traces/mooncake_ci_slice_3940_3963.jsonl", "--intervals", "x"],
     "argument --intervals: must be an integer ≥ 0, got 'x'"),
    ("overload", ["--seconds", "0"], "argument --seconds: must be a finite number > 0, got '0'"),
    ("overload", ["--token-delay", "inf"],
     "argument --token-delay: must be a finite number > 0, got 'inf'"),
    ("fuzz_api", ["--cases", "0"], "argument --cases: must be an integer ≥ 1, got '0'"),
    ("migration", ["--streams", "0"], "argument --streams: must be an integer ≥ 1, got '0'"),
    ("soak", ["--duration", "-1"], "argument --duration: must be a finite number > 0, got '-1'"),
    ("soak", ["--tokens", "5", "2"], "--tokens: MIN must be ≤ MAX, got 5 2"),
    ("soak", ["--out", "/nonexistent_dir_zz/soak.json"],
     f"argument --out: cannot write /nonexistent_dir_zz/soak.json {NO_FILE}"),
    ("pd_vs_monolithic", ["--time-scale", "inf"],
     "argument --time-scale: must be a finite number > 0, got 'inf'"),
    ("pd_vs_monolithic", ["--trace", "/nonexistent"],
     f"argument --trace: cannot read /nonexistent {NO_FILE}"),
    ("calibrate_live", ["--lengths", "16"], "--lengths: give two different lengths at least"),
    ("calibrate_live", ["--reps", "0"], "argument --reps: must be an integer ≥ 1, got '0'"),
    ("relay_floor", ["--rounds", "0"], "argument --rounds: must be an integer ≥ 1, got '0'"),
]


@pytest.mark.parametrize(("name", "args", "message"), REFUSED,
                         ids=[f"{n}{' '.join(['', *a])}" for n, a, _ in REFUSED])
def test_a_bad_argument_is_refused_before_the_run(name, args, message, monkeypatch, capsys):
    """The benchmark exits with status 2 while it parses its flags, its last stderr line
    naming the flag and the value (no traceback, nothing measured)."""
    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *args])
    with pytest.raises(SystemExit) as e:
        module.main()
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"{name}.py: error: {message}"), last


def test_the_shared_flag_types(tmp_path):
    """The argparse types the benchmarks and the commands share: what each accepts, and the
    message of what it refuses."""
    assert (positive_int("3"), nonnegative_int("0")) == (3, 0)
    assert (positive_float("0.5"), nonnegative_float("0")) == (0.5, 0.0)
    for fn, bad in ((positive_int, "0"), (positive_int, "1.5"), (nonnegative_int, "-1"),
                    (positive_float, "nan"), (positive_float, "-inf"), (positive_float, "0"),
                    (nonnegative_float, "inf"), (nonnegative_float, "x")):
        with pytest.raises(argparse.ArgumentTypeError, match=f"got '{bad}'"):
            fn(bad)
    f = tmp_path / "in.json"
    f.write_text("{}")
    assert input_file(str(f)) == str(f)
    with pytest.raises(argparse.ArgumentTypeError, match=r"cannot read .* \(Is a directory\)"):
        input_file(str(tmp_path))
    assert output_file(str(tmp_path / "out.json")) == str(tmp_path / "out.json")
    with pytest.raises(argparse.ArgumentTypeError, match=r"cannot write .* \(Is a directory\)"):
        output_file(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match=r"\(Not a directory\)"):
        output_file(str(f / "out.json"))
