"""The cheaper token relay (issue 19): coalesced events keep every client-visible figure.

Units: the raw SSE reader (framing), the decode stream's merge of ready events, the relay of
an event batch through the detokenizer (same text / tokens / finish as token by token), the
direct chunk writer (the same JSON as the pydantic chunk). End to end with the fake workers:
streams whose decode events are coalesced (a slow writer) or not give the oracle's text, the
usage and the finish reason, for completions and chat, with stop strings, ``n = 2`` and
logprobs (the per-token ``text_offset`` of a stream equals the non-streaming response's).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from router_fakes import TOKENIZER, ServerThread, start_worker, toy_generate

from decode.stream import events, merge, mergeable, take_ready
from k3serve.messages import StreamEvent, TokenLogprob
from k3serve.sampling import SamplingParams
from k3serve.tokenizer.detok import IncrementalDetokenizer
from router.app import RouterConfig, coalesce, create_app
from router.preprocess import parse_request
from router.render import Render
from router.schemas import ChatCompletionRequest, CompletionRequest
from router.sse import SSEReader
from router.stream import Delta, relay_batch
from router.workers import CLUSTER_TOKEN_HEADER

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


@pytest.mark.parametrize("kw", [{}, {"stop": ("lo w",)}, {"max_tokens": 7}])
def test_relay_batch_equals_token_by_token(kw):
    ids = list("hello world, héllo".encode())
    one = _detok(**kw)
    texts = []
    for t in ids:
        o = one.step(t)
        texts.append(o.new_text)
        if o.finished:
            break
    batched = _detok(**kw)
    evs = [StreamEvent(token_ids=ids[i:i + 3], text="") for i in range(0, len(ids), 3)]
    d = relay_batch(0, evs[:2], batched)
    d.absorb(relay_batch(0, evs[2:], batched) if not batched.finished else Delta(0))
    assert d.text == "".join(texts) == one.text
    assert d.texts == texts and d.token_ids == ids[:len(texts)]
    assert d.finish_reason == one.finish_reason


def test_relay_batch_releases_held_text_when_decode_ends_first():
    det = _detok(stop=("xyz",))
    d = relay_batch(0, [StreamEvent(token_ids=[97, 120], text=""),
                        StreamEvent(token_ids=[], finish_reason="abort")], det)
    assert d.text == "ax" and d.finish_reason == "abort" and d.texts == ["a", "x"]


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
    srv = ServerThread(app).start()
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
        for stop, max_tokens in (((), 40), (("q",), 60)):
            sp = SamplingParams(max_tokens=max_tokens, temperature=0, stop=stop,
                                stop_token_ids=TOKENIZER.stop_token_ids)
            want_ids, want, reason = toy_generate(ids, sp)
            chunks, _ = _stream(url, "/v1/completions", {
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "n": 2,
                "stop": list(stop), "stream_options": {"include_usage": True}})
            for i in range(2):
                mine = [c["choices"][0] for c in chunks if c["choices"]
                        and c["choices"][0]["index"] == i]
                assert "".join(c["text"] for c in mine) == want
                assert [c.get("finish_reason") for c in mine][-1] == reason
            usage = chunks[-1]["usage"]
            assert usage["completion_tokens"] == 2 * len(want_ids)
            assert usage["prompt_tokens"] == len(ids)  # one prompt, n = 2 choices
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
