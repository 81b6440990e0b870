"""The real decode worker's decode channels (issue 19; decode/stream.py ``Channel``):
``POST /internal/channel`` carries the streams of the requests attached to it
(``POST /internal/attach``), each event tagged with its request id; the tokens equal those of
one stream per request; a channel that closes mid-stream aborts its requests on the worker."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from router.sse import SSEReader
from tests.worker_procs import HEADERS, _first, _request, _sampling

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(shared_pair):
    """The session's prefill + decode pair (tests/worker/conftest.py)."""
    return shared_pair


async def _read(ch: httpx.Response, want: set[str]) -> dict[str, list[int]]:
    """Tokens per request id from a channel body until every id in ``want`` sent [DONE]."""
    got: dict[str, list[int]] = {rid: [] for rid in want}
    done: set[str] = set()
    sse = SSEReader()
    async for chunk in ch.aiter_raw():
        for rid, data in sse.feed_tagged(chunk):
            rid = rid.decode()
            if data == b"[DONE]":
                done.add(rid)
                continue
            ev = json.loads(data)
            assert "error" not in ev, ev
            got[rid] += ev["token_ids"]
        if done >= want:
            return got
    raise AssertionError(f"the channel ended before {want - done} finished")


def test_a_channel_carries_each_request_s_own_stream(pair):
    P, D = pair
    prompts = {"chan-a": list(range(3, 40)), "chan-b": list(range(50, 71))}

    async def go() -> tuple[dict, dict]:
        async with httpx.AsyncClient(headers=HEADERS, timeout=60) as c:
            ref = {rid: (await _request(c, P, D, rid + "-ref", ids))[0]
                   for rid, ids in prompts.items()}
            r = await c.post(D.url + "/internal/attach", json={
                "request_id": "x", "token_id": 1, "channel": "nope"})
            assert r.status_code == 409 and r.json()["error"] == "unknown_channel"
            async with c.stream("POST", D.url + "/internal/channel",
                                json={"channel": "test-chan"}) as ch:
                assert ch.status_code == 200
                assert ch.headers["content-type"].startswith("text/event-stream")
                got = {}
                for rid, ids in prompts.items():
                    first = await _first(c, P, D, rid, ids)
                    got[rid] = [first["token_id"]]
                    a = await c.post(D.url + "/internal/attach", json={
                        "request_id": rid, "token_id": first["token_id"],
                        "logprob": first["logprob"], "channel": "test-chan"})
                    assert a.status_code == 200, a.text
                    assert a.json() == {"request_id": rid, "channel": "test-chan"}
                rest = await asyncio.wait_for(_read(ch, set(prompts)), 60)
                for rid in prompts:
                    got[rid] += rest[rid]
            return ref, got

    ref, got = asyncio.run(go())
    assert got == ref
    info = httpx.get(D.url + "/internal/info", headers=HEADERS).json()
    assert info["channels"] is True


def test_a_channel_that_closes_mid_stream_aborts_its_requests(pair):
    P, D = pair

    async def go() -> None:
        async with httpx.AsyncClient(headers=HEADERS, timeout=60) as c:
            sampling = {**_sampling(), "max_tokens": 2000, "ignore_eos": True}
            async with c.stream("POST", D.url + "/internal/channel",
                                json={"channel": "test-close"}) as ch:
                first = await _first(c, P, D, "chan-cut", list(range(5, 30)), sampling)
                a = await c.post(D.url + "/internal/attach", json={
                    "request_id": "chan-cut", "token_id": first["token_id"],
                    "channel": "test-close"})
                assert a.status_code == 200, a.text
                sse = SSEReader()
                async for chunk in ch.aiter_raw():
                    if sse.feed_tagged(chunk):
                        break  # a first event: the request is decoding; leave the channel

    asyncio.run(go())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        reqs = httpx.get(D.url + "/internal/requests", headers=HEADERS).json()["requests"]
        r = reqs.get("chan-cut")
        if r is None or r["phase"] == "done":
            break
        time.sleep(0.1)
    assert r is None or r["phase"] == "done", r
    assert r is None or r["tokens_sent"] < 2000  # aborted, not run to its end


def test_a_closed_channel_ends_every_stream_on_it_started_or_not():
    """``Channel.close`` ends each attached stream as a stream whose reader went away
    (``on_close(False)`` on the worker: an abort), also one whose forwarder had not started
    yet, and one forwarded after the close; the channel's body ends."""
    from decode.stream import Channel, events
    from k3serve.messages import StreamEvent

    async def go() -> tuple[list, list]:
        ch = Channel("c")
        closes: list[tuple[str, bool]] = []

        def stream(rid: str):
            q: asyncio.Queue = asyncio.Queue()
            q.put_nowait(StreamEvent(token_ids=[1]))
            def on_close(finished: bool, rid: str = rid) -> None:
                closes.append((rid, finished))

            return events(q, 60.0, on_close), on_close

        gen, on_close = stream("started")
        ch.forward("started", gen, abandoned=lambda: on_close(False))
        body = ch.body()
        first = await body.__anext__()  # the started stream's first event
        gen2, on_close2 = stream("not-started")
        ch.forward("not-started", gen2, abandoned=lambda: on_close2(False))
        ch.close()  # before the second forwarder ran
        rest = [chunk async for chunk in body]
        await asyncio.sleep(0)
        gen3, on_close3 = stream("after")
        ch.forward("after", gen3, abandoned=lambda: on_close3(False))
        await asyncio.sleep(0.01)
        return closes, [first, *rest]

    closes, chunks = asyncio.run(go())
    assert sorted(closes) == [("after", False), ("not-started", False), ("started", False)]
    assert chunks[0].startswith(b"event: started\ndata: ")
