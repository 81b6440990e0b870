"""k3serve.tracing against a real OTLP/HTTP receiver process (tests/tracing/otlp_receiver.py)."""

from __future__ import annotations

import pytest

from k3serve import tracing
from tests.tracing.spans import read_spans


def test_off_by_default_costs_nothing():
    tracing.shutdown()
    assert not tracing.enabled()
    assert tracing.configure("x", None) is False and tracing.configure("x", "") is False
    assert tracing.start_span("a") is None
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    headers: dict[str, str] = {}
    assert tracing.inject(None, headers) == {}
    tracing.end_span(None, {"k": 1}, error="x")  # no-op


def test_bad_endpoint_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
        tracing.configure("x", "127.0.0.1:4318")


def test_spans_cross_a_process_boundary_by_traceparent(receiver):
    url, out = receiver
    try:
        assert tracing.configure("k3serve-test", url)
        root = tracing.start_span("router.request", attributes={"k3serve.request_id": "r1",
                                                                "skipped": None})
        headers = tracing.inject(root, {})
        assert headers["traceparent"].startswith("00-")
        remote = tracing.extract({"Traceparent": headers["traceparent"], "x-other": "1"})
        child = tracing.start_span("prefill", parent=remote,
                                   attributes={"k3serve.prompt_tokens": 12})
        grandchild = tracing.start_span("kv.transfer", parent=child)
        tracing.end_span(grandchild, {"k3serve.bytes": 4096})
        tracing.end_span(child, error="boom")
        tracing.end_span(root, {"k3serve.completion_tokens": 3})
    finally:
        tracing.shutdown()  # flushes
    spans = {s["name"]: s for s in read_spans(out, 3)}
    assert set(spans) == {"router.request", "prefill", "kv.transfer"}
    assert len({s["trace_id"] for s in spans.values()}) == 1
    assert spans["router.request"]["parent_span_id"] == ""
    assert spans["prefill"]["parent_span_id"] == spans["router.request"]["span_id"]
    assert spans["kv.transfer"]["parent_span_id"] == spans["prefill"]["span_id"]
    assert spans["router.request"]["attributes"] == {"k3serve.request_id": "r1",
                                                     "k3serve.completion_tokens": 3}
    assert spans["kv.transfer"]["attributes"] == {"k3serve.bytes": 4096}
    assert {s["service"] for s in spans.values()} == {"k3serve-test"}
