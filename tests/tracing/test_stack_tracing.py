"""One trace per request across a live stack: router → prefill → KV transfer → decode → stream.

A receiver process (otlp_receiver.py, opentelemetry-proto) takes the spans of a router, one
prefill and one decode worker (``deploy.launcher.start_stack`` with ``--otlp-traces-endpoint``
given to all three) for one disaggregated streaming chat completion whose client sent a
``traceparent``: every span carries the client's trace id, the workers' spans hang under the
router's call spans, and the spans carry worker ids, token counts and bytes moved.

Tracing off: the router's internal calls carry no ``traceparent`` (an in-process worker
records the headers it gets).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from aiohttp import web

from k3serve import tracing
from k3serve.messages import AbortRequest, Capacity, WorkerInfo
from router import trace
from router.client import WorkerClient
from router.workers import Worker
from tests.tracing.spans import read_spans

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
WANTED = {"router.request", "router.admission", "router.queue", "router.placement",
          "router.reserve", "router.prefill", "router.stream", "prefill", "kv.transfer",
          "decode.admission", "decode"}


def spans_until(path, names: set[str], timeout: float = 30.0) -> dict[str, dict]:
    """The received spans by name, once every name in ``names`` arrived."""
    deadline = time.monotonic() + timeout
    got: dict[str, dict] = {}
    while time.monotonic() < deadline:
        if path.exists():
            got = {}
            for line in path.read_text().splitlines():
                s = json.loads(line)
                got.setdefault(s["name"], s)
            if names <= set(got):
                return got
        time.sleep(0.1)
    raise AssertionError(f"spans missing after {timeout:.0f} s: {sorted(names - set(got))}")


def test_one_trace_across_router_prefill_transfer_decode(receiver, tmp_path):
    from deploy.launcher import start_stack

    url, out = receiver
    flag = ["--otlp-traces-endpoint", url]
    st = start_stack(model="k3-tiny", num_prefill=1, num_decode=1, block_size=16,
                     extra_worker_args=flag, extra_router_args=flag, log_dir=str(tmp_path),
                     ready_timeout=120)
    try:
        with httpx.stream("POST", st.url + "/v1/chat/completions", timeout=60, headers={
                "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}, json={
                "model": "k3-tiny", "max_tokens": 6, "stream": True,
                "messages": [{"role": "user", "content": "Where did the time go?"}]}) as r:
            assert r.status_code == 200
            body = "".join(r.iter_text())
        assert body.rstrip().endswith("data: [DONE]")
        spans = spans_until(out, WANTED)
    finally:
        st.stop()
    by_id = {s["span_id"]: s for s in spans.values()}
    assert {s["trace_id"] for s in spans.values()} == {TRACE_ID}
    assert {spans[n]["service"] for n in WANTED} == {
        "k3serve-router", "k3serve-prefill", "k3serve-decode"}
    for n in WANTED:
        want = {"prefill": "k3serve-prefill", "kv.transfer": "k3serve-prefill",
                "decode.admission": "k3serve-decode", "decode": "k3serve-decode"}
        assert spans[n]["service"] == want.get(n, "k3serve-router"), n

    root = spans["router.request"]
    assert root["parent_span_id"] == CLIENT_SPAN  # the client's traceparent continued
    for n in ("router.admission", "router.queue", "router.placement", "router.reserve",
              "router.prefill", "router.stream"):
        assert spans[n]["parent_span_id"] == root["span_id"], n
    # the workers' spans under the router's call spans, the transfer under the prefill
    assert spans["prefill"]["parent_span_id"] == spans["router.prefill"]["span_id"]
    assert spans["kv.transfer"]["parent_span_id"] == spans["prefill"]["span_id"]
    assert spans["decode.admission"]["parent_span_id"] == spans["router.reserve"]["span_id"]
    assert spans["decode"]["parent_span_id"] == spans["router.reserve"]["span_id"]
    assert all(s["parent_span_id"] in by_id or s is root for s in spans.values())

    a = {n: s["attributes"] for n, s in spans.items()}
    prompt = a["router.request"]["k3serve.prompt_tokens"]
    assert prompt > 0 and a["router.request"]["k3serve.completion_tokens"] == 6
    assert a["router.request"]["k3serve.request_id"].startswith("chatcmpl")
    assert a["router.stream"]["k3serve.completion_tokens"] == 6
    p_id, d_id = a["router.placement"]["k3serve.prefill_worker_id"], \
        a["router.placement"]["k3serve.decode_worker_id"]
    assert p_id.startswith("prefill") and d_id.startswith("decode")
    assert 0 <= a["router.placement"]["k3serve.cached_tokens"] <= prompt
    assert a["router.prefill"]["k3serve.worker_id"] == p_id
    assert a["router.reserve"]["k3serve.worker_id"] == d_id
    assert a["prefill"]["k3serve.prompt_tokens"] == prompt
    assert 0 <= a["prefill"]["k3serve.cached_tokens"] < prompt
    assert a["prefill"]["k3serve.worker_id"] == a["kv.transfer"]["k3serve.worker_id"]
    assert a["kv.transfer"]["k3serve.bytes"] > 0
    assert a["kv.transfer"]["k3serve.transfer_state"] == "SUCCESS"
    assert a["kv.transfer"]["k3serve.peer"]
    assert a["decode.admission"]["k3serve.prompt_tokens"] == prompt
    assert a["decode"]["k3serve.completion_tokens"] == 6
    assert a["decode"]["k3serve.worker_id"] == a["decode.admission"]["k3serve.worker_id"]
    # the decode span starts when admission ends
    assert spans["decode"]["start_ns"] >= spans["decode.admission"]["end_ns"]
    assert spans["kv.transfer"]["start_ns"] >= spans["prefill"]["start_ns"]


async def call_recording(traced: bool, endpoint: str | None) -> dict[str, str]:
    """The headers an in-process worker got from one ``WorkerClient.call`` made under a
    request span (``traced``) or none."""
    got: dict[str, str] = {}

    async def handle(request: web.Request) -> web.Response:
        got.update(request.headers)
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/internal/abort", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = WorkerClient(None)
    tracing.configure("k3serve-router", endpoint)
    root = tracing.start_span("router.request") if traced else None
    token = trace.REQUEST.set(root)
    try:
        w = Worker(f"http://127.0.0.1:{port}", WorkerInfo(
            role="decode", model="k3-tiny", fingerprint="f", block_size=16,
            capacity=Capacity(num_pages=8)))
        status, _ = await client.call(w, "/internal/abort", AbortRequest(request_id="r"))
        assert status == 200
    finally:
        trace.REQUEST.reset(token)
        tracing.end_span(root)
        tracing.shutdown()
        await client.close()
        await runner.cleanup()
    return {k.lower(): v for k, v in got.items()}


def test_tracing_off_sends_no_traceparent(receiver):
    url, out = receiver
    assert "traceparent" not in asyncio.run(call_recording(False, None))
    assert not tracing.enabled()
    on = asyncio.run(call_recording(True, url))
    assert on["traceparent"].startswith("00-")
    spans = {s["name"]: s for s in read_spans(out, 2)}
    assert spans["router.call"]["parent_span_id"] == spans["router.request"]["span_id"]


@pytest.fixture(autouse=True)
def _tracing_off_after():
    yield
    tracing.shutdown()
