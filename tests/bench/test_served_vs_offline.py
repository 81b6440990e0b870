"""benchmarks/served_vs_offline.py without a stack: the run list, the offline driver on a
real engine, and the JSON it writes (the keys the results page needs)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import served_vs_offline as svo


def test_run_list_and_shapes() -> None:
    runs = svo.run_list([(1024, 128), (128, 1024)], [1, 16, 64], 8.0, 64)
    assert [(r["input_len"], r["concurrency"], r["num"]) for r in runs[:4]] == [
        (1024, 1, 1), (1024, 16, 16), (1024, 64, 64), (1024, None, 64)]
    assert len(runs) == 8 and len({r["seed"] for r in runs}) == 8  # no prompt reused
    assert runs[3]["rate"] == 8.0 and runs[0]["rate"] == math.inf
    a = svo.parse_args(["--input-len", "256", "--output-len", "32"])
    assert svo.shapes_of(a) == [(256, 32)]
    assert svo.shapes_of(svo.parse_args([])) == [(1024, 128), (128, 1024)]
    with pytest.raises(SystemExit, match="together"):
        svo.shapes_of(svo.parse_args(["--input-len", "5"]))


def test_offline_driver_counts_every_token() -> None:
    from k3serve import LLM, SamplingParams

    llm = LLM("k3-tiny", num_pages=64, num_slots=4, max_num_batched_tokens=128)
    reqs = svo.workload(40, 6, 3, math.inf, 272, 7)
    res = svo.offline_run(llm.engine, reqs, lambda q: SamplingParams(
        temperature=0.0, max_tokens=q.max_tokens, ignore_eos=True))
    assert res["output_tokens"] == 18 and res["tok_s"] > 0
    assert 0 < res["ttft_p50_s"] <= res["ttft_p99_s"] <= res["last_first_token_s"]
    assert res["itl_p50_s"] > 0


def test_json_has_the_top_level_keys(tmp_path) -> None:
    runs = svo.run_list([(256, 32)], [1, 8], 1.0, 8)
    off = {"device": "cpu", "card": "cpu", "engine": {},
           "runs": [{**r, "tok_s": 10.0 * (i + 1), "last_first_token_s": 1.0,
                     "ttft_p50_s": 0.5} for i, r in enumerate(runs)]}
    served = {m: {"first_ttft_s": 1.0, "tenth_ttft_s": 0.9, "startup_s": 5.0,
                  "runs": [{**r, "tok_s": 5.0 * (i + 1), "ttft_p99_s": 1.0,
                            **({"transfer_gb_s": 0.5} if m == "pd" else {})}
                           for i, r in enumerate(runs)]} for m in ("mono", "pd")}
    te = {"256": {"raw_te_gb_s": 1.0, "payload_bytes": 123}}
    out = tmp_path / "r.json"
    svo.write(out, svo.parse_args([]), off, served, te)
    doc = json.loads(out.read_text())
    for k in ("device", "date", "flags", "concurrency", "input_len", "output_len",
              "offline_tok_s", "monolithic_tok_s", "pd_tok_s", "ratio_monolithic", "ratio_pd",
              "transfer_gb_s", "raw_te_gb_s"):
        assert k in doc, k
    assert doc["flags"] == "default" and doc["concurrency"] == 8  # the largest of the shape
    assert doc["ratio_monolithic"] == 0.5 and doc["raw_te_gb_s"] == 1.0
    assert doc["runs"][2]["rate"] == 1.0 and doc["runs"][0]["rate"] is None
    assert "| 256→32 | 8 at once |" in svo.table(doc)


def test_raw_te_reads_the_transfer_benchmark_row() -> None:
    """The raw-TE figures from ``benchmarks/transfer.py``'s row (Mooncake over tcp loopback,
    k3-tiny's layout, 64 tokens, one repetition)."""
    te = svo.raw_te("k3-tiny", 64, "cpu", 1)
    assert te["payload_bytes"] > 0 and te["runs_per_request"] > 0
    assert te["raw_te_gb_s"] > 0 and te["kvstore_gb_s"] > 0
