"""``k3serve bench --trace``: one warning line when the trace's hashing block (512 trace
tokens × ``--length-scale``) is not the served model's cache block, which the router reports
on ``/v1/models/{model}`` (``block_size``). Fake workers (16-token blocks) behind a live
router."""

from __future__ import annotations

import pytest

from cli.bench.command import block_size_warning, served_block_size
from cli.main import main
from deploy.fake_stack import Stack
from deploy.fake_workers import MODEL

TRACE = "traces/mooncake_synthetic_trace.jsonl"
WARNING = ("k3serve bench: warning: the trace's blocks are 64 tokens (512 x --length-scale "
           "0.125) but the served model's cache blocks are 16 tokens: the hit rates will not "
           "compare with the oracle (use --length-scale 0.03125, or serve with --block-size 64)")


@pytest.fixture(scope="module")
def stack():
    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    try:
        yield s
    finally:
        s.close()


def test_the_router_reports_the_workers_block_size(stack):
    assert served_block_size(stack.url, MODEL, None) == 16
    assert served_block_size("http://127.0.0.1:9", MODEL, None) is None  # nothing there


def test_the_warning_names_both_sizes_and_the_fix():
    assert f"k3serve bench: warning: {block_size_warning(0.125, 16)}" == WARNING
    assert block_size_warning(0.03125, 16) is None
    assert block_size_warning(0.125, None) is None


@pytest.mark.parametrize("scale,warned", [("0.125", True), ("0.03125", False)])
def test_bench_on_a_trace_warns_once_when_the_blocks_differ(stack, scale, warned, monkeypatch,
                                                            capsys):
    from cli.bench import client

    seen = {}

    def run_load(url, requests, **kw):  # the load itself is not what is tested here
        seen["n"] = len(requests)
        raise SystemExit(0)

    monkeypatch.setattr(client, "run_load", run_load)
    with pytest.raises(SystemExit):
        main(["bench", "--url", stack.url, "--model", MODEL, "--trace", TRACE, "--limit", "2",
              "--length-scale", scale, "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert seen["n"] >= 1
    assert err == ([WARNING] if warned else []), err
