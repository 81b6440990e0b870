"""``k3serve bench``: the workload mapping (unit) and a replay against a live stack whose
JSON figures must equal the router's own counters exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3serve import traces
from k3serve.bench.client import parse_prometheus
from k3serve.bench.workload import random_load, trace_load

ROOT = Path(__file__).resolve().parents[2]
SLICE = ROOT / "tests" / "data" / "trace_3000_3399.jsonl"


def test_parse_prometheus_sums_labels():
    text = ('# HELP x y\nk3serve:a_total{w="p0"} 3.0\nk3serve:a_total{w="p1"} 4\n'
            'k3serve:b 1.5\n')
    assert parse_prometheus(text) == {"k3serve:a_total": 7.0, "k3serve:b": 1.5}


def test_trace_load_uses_the_shared_mapping_and_counts_skips():
    w = trace_load(SLICE, limit=40, length_scale=1 / 32, vocab_size=272, max_model_len=8192)
    reqs = traces.scale_rows(traces.read_rows(SLICE)[:40], 16)
    assert w.requests[0].prompt == reqs[0].tokens(272)
    assert w.oracle_hit_rate == pytest.approx(traces.token_oracle(reqs))
    short = trace_load(SLICE, limit=40, length_scale=1 / 32, vocab_size=272, max_model_len=600)
    n_long = sum(1 for r in reqs if r.num_tokens + max(1, r.output_tokens) > 600)
    assert n_long > 0 and short.num_skipped == n_long
    assert len(short.requests) == 40 - n_long
    with pytest.raises(ValueError, match="length_scale"):
        trace_load(SLICE, length_scale=0.001, vocab_size=272, max_model_len=8192)


def test_random_load_shape():
    w = random_load(rate=2.0, input_len=10, output_len=3, num=5, vocab_size=272)
    assert [len(r.prompt) for r in w.requests] == [10] * 5
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(w.requests, w.requests[1:]))
    with pytest.raises(ValueError, match="rate"):
        random_load(rate=0, input_len=1, output_len=1, num=1, vocab_size=272)


@pytest.mark.parametrize("monolithic", [0, 3], ids=["pd-2p1d", "mono-3"])
def test_bench_against_a_live_stack_matches_the_router_counters(tmp_path, monolithic):
    from deploy.launcher import start_stack
    from k3serve.cli import main

    st = start_stack(model="k3-tiny", num_prefill=2, num_decode=1, block_size=16,
                     monolithic=monolithic, log_dir=str(tmp_path / "logs"), ready_timeout=180)
    try:
        out = tmp_path / "bench.json"
        rc = main(["bench", "--url", st.url, "--trace", str(SLICE), "--limit", "12",
                   "--time-scale", "0.02", "--length-scale", "0.03125", "--max-model-len",
                   "1200", "--json", str(out), "--plots", str(tmp_path / "png"),
                   "--no-progress"])
    finally:
        st.stop()
    d = json.loads(out.read_text())
    assert rc == 0 and d["num_failed"] == 0
    assert d["num_requests"] + d["num_skipped"] == 12 and d["num_skipped"] > 0
    assert d["server_ttft_count"] == d["num_requests"] == d["server_e2e_count"]
    assert d["server_prompt_tokens"] == d["prompt_tokens"]
    assert d["server_cached_tokens"] == d["cached_tokens"]
    assert d["server_itl_count"] == d["output_tokens"] - d["num_requests"]
    for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s",
              "output_tokens_per_s", "goodput", "hit_rate", "predicted_hit_rate",
              "oracle_hit_rate"):
        assert d[k] is not None, k
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == [
        "hit_rate.png", "itl_cdf.png", "queue_depth.png", "ttft_cdf.png"]
