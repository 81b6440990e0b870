"""Must-show 4 of issue 15 in CI: ``schemathesis`` cases drawn from the router's own OpenAPI
schema (``/v1/*``, ``/health``; positive and negative; ``max_tokens`` capped small) against a
live router with fake workers (deploy.fake_workers): no answer ≥ 500, no dropped connection, and
most valid completion requests succeed (a router that rejected everything would fail). The
1 000-case run: ``benchmarks/fuzz_api.py``."""

from __future__ import annotations

from router_fuzz import fuzz

from deploy.fake_stack import Stack


def test_schemathesis_finds_no_server_error_and_valid_cases_succeed():
    # the fake workers report a 1 024-token context: a valid case with ``max_tokens: null``
    # (the default: up to the context) streams ~1 000 toy tokens instead of ~4 000 (8 s each)
    s = Stack(num_prefill=1, num_decode=1, api_key=None, worker={"max_model_len": 1024})
    try:
        stats = fuzz(s.url, s.app.openapi(), cases=300, seed=15)
        print(stats.table())
        assert stats.cases >= 300
        assert not stats.server_errors, "\n".join(stats.server_errors[:5])
        for prefix in ("/v1/completions", "/v1/chat/completions"):
            valid = stats.count("positive", prefix=prefix)
            ok = stats.count("positive", 200, prefix=prefix)
            assert valid >= 20 and ok >= valid // 2, (prefix, ok, valid, stats.table())
        assert stats.count("negative", 200, prefix="/v1/completions") < \
            stats.count("negative", prefix="/v1/completions")
        assert s.health()["num_workers_healthy"] == 2  # no worker crashed
    finally:
        s.close()
