"""The store and transfer benchmarks: every flag has a help text, and the store benchmark
prints its clients' counters as words (not a dataclass repr)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import store, transfer
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
