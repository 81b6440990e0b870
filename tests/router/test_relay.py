"""The cheaper token relay (issue 19): coalesced events keep every client-visible figure.

Units: the raw SSE reader (framing), the decode stream's merge of ready events, the relay of
the decode worker's text as the router relays it (same text / tokens / finish as one
detokenizer fed token by token), the
direct chunk writer (the same JSON as the pydantic chunk). End to end with the fake workers:
streams whose decode events are coalesced (a slow writer) or not give the oracle's text, the
usage and the finish reason, for completions and chat, with stop strings, ``n = 2`` and
logprobs (the per-token ``text_offset`` of a stream equals the non-streaming response's).
"""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest

from decode.stream import events, merge, mergeable, take_ready, token_texts
from deploy.fake_workers import TOKENIZER, ServerThread, start_worker, toy_generate
from k3serve.messages import StreamEvent, TokenLogprob
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from k3serve.sampling import SamplingParams
from k3serve.tokenizer.detok import IncrementalDetokenizer
from router.app import RouterConfig, create_app
from router.config import ROUTER_HTTP, ROUTER_LOOP
from router.preprocess import parse_request
from router.render import Render
from router.schemas import ChatCompletionRequest, CompletionRequest
from router.sse import SSEReader
from router.sse_response import coalesce
from router.stream import Delta, relay_batch

TOKEN = "relay-secret"
MODEL = "k3-tiny"


# ----------------------------------------------------------------------------- SSE reader
def test_sse_reader_framing():
    r = SSEReader()
    assert r.feed(b"data: {\"a\"") == []
    assert r.feed(b": 1}\n\ndata: x\n\n: ping\n\nevent: e\ndata: y\ndata: z\n\nda") == [
        b"{\"a\": 1}", b"x", b"y\nz"]
    assert r.pending == b"da"
    assert r.feed(b"ta:[DONE]\r") == []  # the \r may be half of \r\n
    assert r.feed(b"\n\r\ndata: w\r\r") == [b"[DONE]"]  # the last \r: still unknown
    assert r.feed(b"data: v\n\n") == [b"w", b"v"]
    assert r.feed(b"id: 3\n\n") == []  # no data: not dispatched


# ----------------------------------------------------------------------------- decode side
def _ev(tok: int, text: str, lp: bool = True, finish=None) -> StreamEvent:
    return StreamEvent(token_ids=[tok], text=text,
                       logprobs=[TokenLogprob(logprob=-0.5)] if lp else [],
                       finish_reason=finish)


def test_merge_keeps_tokens_text_logprobs_and_finish():
    a, b = _ev(97, "a"), _ev(98, "b", finish="stop")
    m = merge(a, b)
    assert (m.token_ids, m.text, len(m.logprobs), m.finish_reason) == ([97, 98], "ab", 2, "stop")
    assert not mergeable(m, a)  # nothing after a final event
    assert not mergeable(_ev(97, "a"), _ev(98, "b", lp=False))  # logprobs would misalign
    assert mergeable(_ev(97, "a", lp=False), _ev(98, "b", lp=False))
    assert not mergeable(a, None)


def test_decode_stream_coalesces_ready_events():
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        for i in range(5):
            q.put_nowait(_ev(97 + i, chr(97 + i)))
        q.put_nowait(_ev(102, "f", lp=False))  # does not merge: sent on its own
        q.put_nowait(_ev(103, "g", lp=False, finish="length"))
        closed = []
        out = [e.data async for e in events(q, 5.0, closed.append)]
        return out, closed

    out, closed = asyncio.run(run())
    assert closed == [True]
    evs = [StreamEvent.model_validate_json(d) for d in out[:-1]]
    assert out[-1] == "[DONE]"
    assert [e.token_ids for e in evs] == [[97, 98, 99, 100, 101], [102, 103]]
    assert "".join(e.text for e in evs) == "abcdefg" and evs[-1].finish_reason == "length"


def test_take_ready_returns_what_does_not_merge():
    q: asyncio.Queue = asyncio.Queue()
    q.put_nowait(_ev(98, "b"))
    q.put_nowait(_ev(99, "c", lp=False))
    ev, left = take_ready(q, _ev(97, "a"))
    assert ev.token_ids == [97, 98] and left.token_ids == [99] and q.empty()


# ----------------------------------------------------------------------------- router side
def _detok(**kw) -> IncrementalDetokenizer:
    sp = SamplingParams(max_tokens=kw.pop("max_tokens", 50), **kw)
    return IncrementalDetokenizer(TOKENIZER, sp, eos_token_id=TOKENIZER.eos_token_id)


def _decode_worker_events(ids: list[int], kw: dict, step: int) -> list[StreamEvent]:
    """What a decode worker writes for ``ids`` (decode/worker.py ``_emit``): its engine's
    detokenizer fed ``step`` tokens per engine step (speculative decoding: several), each
    step's event with the text released and the per-token texts from the detokenizer's
    record (:func:`decode.stream.token_texts`), up to the detokenizer's finish."""
    det, evs, sent, sent_len = _detok(**kw), [], 0, 0
    for i in range(0, len(ids), step):
        for t in ids[i:i + step]:
            if det.step(t).finished:
                break
        n = det.num_tokens
        evs.append(StreamEvent(token_ids=ids[sent:n], text=det.text[sent_len:],
                               texts=token_texts(det.text, det.text_ends[sent:n], sent_len),
                               finish_reason=det.finish_reason))
        sent, sent_len = n, len(det.text)
        if det.finished:
            break
    return evs


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("logprobs", [True, False])
@pytest.mark.parametrize("kw", [{}, {"stop": ("lo w",)}, {"max_tokens": 7}, {"max_tokens": 9}])
def test_relay_of_the_decode_worker_s_text_equals_token_by_token(kw, logprobs, step):
    """The text, tokens, finish and per-token text (completions' text_offset) the router
    relays from D's events, merged as D coalesces them, equal one detokenizer fed token by
    token: the one place that detokenizes is the worker."""
    ids = list("hello world, héllo".encode())
    one = _detok(**kw)
    texts = []
    for t in ids:
        o = one.step(t)
        texts.append(o.new_text)
        if o.finished:
            break
    evs = _decode_worker_events(ids, kw, step)
    merged = [evs[0]]
    for ev in evs[1:]:  # as take_ready coalesces the events that are ready together
        if mergeable(merged[-1], ev) and len(merged) % 2:
            merged[-1] = merge(merged[-1], ev)
        else:
            merged.append(ev)
    d = relay_batch(0, merged[:2], logprobs)
    if merged[2:]:
        d.absorb(relay_batch(0, merged[2:], logprobs))
    assert d.text == "".join(texts) == one.text
    assert d.token_ids == ids[:len(texts)] and d.finish_reason == one.finish_reason
    if logprobs:  # the text each token completed (completions' text_offset)
        assert d.texts == texts
    else:
        assert d.logprobs == []


@pytest.mark.parametrize("logprobs", [True, False])
def test_relay_batch_relays_the_text_decode_released(logprobs):
    """The router decodes nothing: D's text, per-token texts and finish, as sent."""
    d = relay_batch(0, [StreamEvent(token_ids=[97, 120], text="a", texts=["a", ""]),
                        StreamEvent(token_ids=[], text="x", finish_reason="abort")], logprobs)
    assert d.text == "ax" and d.finish_reason == "abort" and d.token_ids == [97, 120]
    if logprobs:
        assert d.texts == ["a", "x"] and len(d.logprobs) == 2  # a tokenless text: the last's
        d.absorb(Delta(0, "y", [121]))  # a delta without per-token text: its last token's
        assert d.texts == ["a", "x", "y"]


@pytest.mark.parametrize("logprobs", [True, False])
def test_relay_batch_ignores_tokens_after_decodes_finish(logprobs):
    """Tokens after an event that carries D's finish are not D's news (not relayed)."""
    d = relay_batch(0, [StreamEvent(token_ids=[97, 0xC3], text="a\ufffd", finish_reason="abort"),
                        StreamEvent(token_ids=[98], text="b")], logprobs)
    assert d.token_ids == [97, 0xC3] and d.finish_reason == "abort"
    assert d.text == "a\ufffd"


def test_coalesce_merges_one_choice_only():
    async def run():
        out: asyncio.Queue = asyncio.Queue()
        for item in (Delta(0, "b", [98], texts=["b"]), Delta(0, "c", [99], texts=["c"]),
                     Delta(1, "z", [122])):
            out.put_nowait(item)
        d = Delta(0, "a", [97], texts=["a"])
        nxt = coalesce(d, out)
        return d, nxt, out.qsize()

    d, nxt, left = asyncio.run(run())
    assert (d.text, d.token_ids, d.texts) == ("abc", [97, 98, 99], ["a", "b", "c"])
    assert nxt.index == 1 and left == 0


def _render(body: dict, chat: bool) -> Render:
    cls = ChatCompletionRequest if chat else CompletionRequest
    req = parse_request(json.dumps({"model": MODEL, **body}).encode(), cls, MODEL)
    return Render(TOKENIZER, MODEL, req, "cmpl-x")


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("first,text,finish", [(True, "é \"q\"\n", None), (False, "", "stop"),
                                               (False, "ab", "length"), (True, "", None)])
def test_frame_is_the_pydantic_chunk(chat, first, text, finish):
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    r = _render({**body, "stream": True}, chat)
    d = Delta(0, text, [97], finish_reason=finish)
    frame = r.frame(d, first)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[6:]) == r.chunk(d, first)
    assert frame[6:-2].decode() == json.dumps(r.chunk(d, first), separators=(",", ":"))


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def stack():
    app = create_app(RouterConfig(model=MODEL, cluster_token=TOKEN, poll_interval_s=0.02))
    srv = ServerThread(app, http=ROUTER_HTTP, loop=ROUTER_LOOP).start()  # the router's server, as served
    workers = [start_worker("prefill", TOKEN), start_worker("decode", TOKEN)]
    for st, _ in workers:
        r = httpx.post(srv.url + "/internal/register", json={"url": st.url},
                       headers={CLUSTER_TOKEN_HEADER: TOKEN})
        assert r.status_code == 200, r.text
    yield srv.url, workers[1][0]
    for _, w in workers:
        w.stop()
    srv.stop()


def _stream(url: str, path: str, body: dict) -> tuple[list[dict], bytes]:
    with httpx.stream("POST", url + path, json={"model": MODEL, "stream": True, **body},
                      timeout=30) as r:
        assert r.status_code == 200
        raw = r.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    chunks = [json.loads(p) for p in SSEReader().feed(raw) if p != b"[DONE]"]
    return chunks, raw


@pytest.mark.parametrize("slow_writer", [False, True])
def test_streams_keep_text_usage_and_finish(stack, slow_writer):
    url, dec = stack
    dec.send_delay_s = 0.01 if slow_writer else 0.0  # a slow writer: ready tokens coalesce
    sent0 = dec.events_sent
    try:
        prompt = "Coalesced or not, the text is the same."
        ids = TOKENIZER.encode(prompt, add_bos=True)
        # n = 1: the choice's deltas go straight to the response's queue; n = 2: through
        # run_prompt's relay of choice 0 (the last chunk, usage and [DONE] are one write)
        for n, (stop, max_tokens) in itertools.product((1, 2), (((), 40), (("q",), 60))):
            sp = SamplingParams(max_tokens=max_tokens, temperature=0, stop=stop,
                                stop_token_ids=TOKENIZER.stop_token_ids)
            want_ids, want, reason = toy_generate(ids, sp)
            chunks, _ = _stream(url, "/v1/completions", {
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "n": n,
                "stop": list(stop), "stream_options": {"include_usage": True}})
            for i in range(n):
                mine = [c["choices"][0] for c in chunks if c["choices"]
                        and c["choices"][0]["index"] == i]
                assert "".join(c["text"] for c in mine) == want
                assert [c.get("finish_reason") for c in mine][-1] == reason
                assert all(c.get("finish_reason") is None for c in mine[:-1])
            usage = chunks[-1]["usage"]
            assert chunks[-1]["choices"] == []
            assert usage["completion_tokens"] == n * len(want_ids)
            assert usage["prompt_tokens"] == len(ids)  # one prompt, n choices
        chat, _ = _stream(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 30,
            "temperature": 0})
        full = httpx.post(url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 30, "temperature": 0}, timeout=30).json()
        assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chat) == \
            full["choices"][0]["message"]["content"]
        assert chat[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
        if slow_writer:  # the decode worker really sent fewer events than tokens
            assert dec.events_sent - sent0 < (40 + 60) * 2 // 2
    finally:
        dec.send_delay_s = 0.0


def test_streamed_logprobs_offsets_match_the_full_response(stack):
    url, dec = stack
    dec.send_delay_s = 0.01
    try:
        body = {"prompt": "logprobs, coalesced", "max_tokens": 24, "temperature": 0,
                "logprobs": 2}
        chunks, _ = _stream(url, "/v1/completions", body)
        full = httpx.post(url + "/v1/completions", json={"model": MODEL, **body},
                          timeout=30).json()["choices"][0]["logprobs"]
    finally:
        dec.send_delay_s = 0.0
    got = {"tokens": [], "text_offset": [], "token_logprobs": []}
    for c in chunks:
        for k in got:
            got[k] += c["choices"][0]["logprobs"][k]
    assert got == {k: full[k] for k in got}


# ----------------------------------------------------------------------------- relay
def _wire(*ids: int, finish: str | None = None, error: str | None = None) -> bytes:
    body = {"token_ids": list(ids), "text": "", "finish_reason": finish}
    if error is not None:
        body["error"] = error
    return b"data: " + json.dumps(body).encode() + b"\n\n"


#: Scripted decode stream bodies, one list of network writes each (a pause between two).
STREAMS = {
    "finish": [_wire(1) + _wire(2), _wire(3), _wire(4) + _wire(5, finish="stop") + b"data: [DONE]\n\n"],
    "done_no_finish": [_wire(1), _wire(2) + b"data: [DONE]\n\n"],
    "cut": [_wire(1), _wire(2) + b"data: {\"token_ids\": [3"],
    "malformed": [_wire(1), _wire(2) + b"data: {\"token_ids\": \"x\"}\n\n" + _wire(4)],
    "error_event": [_wire(1), _wire(2) + _wire(finish="abort", error="engine died")],
    "crlf": [_wire(1).replace(b"\n", b"\r\n"), _wire(2, finish="length").replace(b"\n", b"\r")],
}


#: Streams that pause 1.5 s between two writes (longer than the pool's ``timeout_s`` below).
STALLS = {"stall": [_wire(1), _wire(2, finish="stop")]}


@pytest.fixture(scope="module")
def scripted():
    """A decode 'worker' that answers ``/internal/stream`` with ``STREAMS[request_id]``
    (a raw ASGI app: each part one write, a pause between two)."""

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        name = json.loads(body)["request_id"]
        for k, part in enumerate(STREAMS.get(name) or STALLS[name]):
            if k:
                await asyncio.sleep(0.03 if name in STREAMS else 1.5)
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    srv = ServerThread(app).start()
    yield srv.url
    srv.stop()


def _pool_and_worker(url: str, **kw):
    from k3serve.messages import Capacity, WorkerInfo
    from router.pool import WorkerPool
    from router.workers import Worker

    info = WorkerInfo(role="decode", model=MODEL, fingerprint="f", block_size=4,
                      capacity=Capacity(num_pages=8, num_slots=8, num_snapshots=0),
                      max_model_len=256)
    return WorkerPool(MODEL, None, **kw), Worker(url, info)


async def _relayed(url: str, name: str, stop_after: int | None, **kw):
    """(events, error) through ``DecodeStreams.relay`` (the callback in the reader's task)
    for the scripted body ``name``; ``stop_after``: the consumer stops after that many
    batches; ``kw``: pool arguments."""
    from k3serve.messages import StreamRequest

    pool, w = _pool_and_worker(url, **kw)
    body = StreamRequest(request_id=name, token_id=0)
    got, n = [], 0

    def handle(batch) -> bool:
        nonlocal n
        got.extend((ev.token_ids, ev.finish_reason, ev.error) for ev in batch)
        n += 1
        return stop_after is not None and n >= stop_after

    err = None
    try:
        await pool.streams.relay(w, body, handle)
    except Exception as e:  # noqa: BLE001 - compared
        err = str(e)
    finally:
        await pool.close()
    return got, err


#: What the relay delivers of each of ``STREAMS`` (token ids, finish, error per event) and
#: the end of the error it raises (``None``: none).
RELAYED = {
    "crlf": ([([1], None, None)], None),
    "cut": ([([1], None, None), ([2], None, None)], None),
    "done_no_finish": ([([1], None, None), ([2], None, None)], None),
    "error_event": ([([1], None, None), ([2], None, None)], "stream: engine died"),
    "finish": ([([1], None, None), ([2], None, None), ([3], None, None), ([4], None, None),
                ([5], "stop", None)], None),
    "malformed": ([([1], None, None), ([2], None, None)],
                  ("stream: malformed StreamEvent: Expected `array`, got `str` - at "
                   "`$.token_ids`")),
}


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_relay_delivers_each_scripted_stream(scripted, name):
    plain, plain_err = asyncio.run(_relayed(scripted, name, None))
    want, want_err = RELAYED[name]
    assert plain == want
    assert (plain_err is None) == (want_err is None)
    if want_err is not None:
        assert plain_err.endswith(want_err), plain_err
    assert plain, (name, plain_err)  # the events before an error are delivered
    if name in ("cut", "done_no_finish"):
        assert plain_err is None and not plain[-1][1]  # ended without a finish
    if name in ("malformed", "error_event"):
        assert plain_err is not None and [e[0] for e in plain] == [[1], [2]]


def test_stream_without_an_event_for_timeout_s_fails_as_hung(scripted):
    """The wait between two events is bounded by ``timeout_s`` (the stream's own watcher,
    not aiohttp's read timeout); the event before the pause is delivered."""
    plain, plain_err = asyncio.run(_relayed(scripted, "stall", None, timeout_s=0.3))
    assert plain == [([1], None, None)]
    assert plain_err is not None and "no event within 0.3 s" in plain_err


def test_relay_stream_stops_when_the_consumer_does(scripted):
    plain, plain_err = asyncio.run(_relayed(scripted, "finish", 1))
    assert plain == [([1], None, None), ([2], None, None)]
    assert plain_err is None


def test_relay_stream_raises_what_handle_raised(scripted):
    from k3serve.messages import StreamRequest

    async def run():
        pool, w = _pool_and_worker(scripted)

        def handle(batch):
            raise KeyError("relay bug")

        try:
            await pool.streams.relay(w, StreamRequest(request_id="finish", token_id=0), handle)
        finally:
            await pool.close()

    with pytest.raises(KeyError, match="relay bug"):
        asyncio.run(run())


def test_decode_events_run_across_a_migration():
    """``DecodeEvents.run`` (the relay's callback path) sees the batches, resumes after the
    tokens and ends across a failed decode worker."""
    from router.migrate import DecodeEvents
    from router.workers import WorkerError

    class W:
        def __init__(self, url):
            self.url = url

    d0, d1 = W("d0"), W("d1")
    scripts = {"d0": [[StreamEvent(token_ids=[11], logprobs=[TokenLogprob(logprob=-1.0)])],
                      [StreamEvent(token_ids=[12, 13])], WorkerError("d0", "stream: gone")],
               "d1": [[StreamEvent(token_ids=[14])],
                      [StreamEvent(token_ids=[15], finish_reason="length")]]}

    class Streams:
        def __init__(self):
            self.bodies = []

        async def relay(self, w, body, handle):
            self.bodies.append((w.url, body.request_id, body.token_id))
            for item in scripts[w.url]:
                if isinstance(item, BaseException):
                    raise item
                if handle(item):
                    return

    async def resume(failed, tokens, lps, k):
        return d1, f"sub-m{k}"

    async def run():
        streams, got = Streams(), []
        src = DecodeEvents(streams, d0, "sub", (10, -0.5), resume)

        def handle(b) -> bool:
            got.append([t for ev in b for t in ev.token_ids])
            return False

        await src.run(handle)
        return got, src.tokens, src.logprobs, src.sub, src.migrations, streams.bodies

    plain = asyncio.run(run())
    assert plain[0] == [[11], [12, 13], [14], [15]] and plain[1] == [10, 11, 12, 13, 14, 15]
    assert plain[2] == [-0.5, -1.0, None, None, None, None]
    assert plain[3] == "sub-m1" and plain[4] == 1
    assert plain[5] == [("d0", "sub", 10), ("d1", "sub-m1", 13)]
