"""Decode channels (issue 19): the token streams of many requests on one connection per decode
worker (``POST /internal/channel`` + ``/internal/attach``; router.channel.DecodeChannel,
decode/stream.py). The client streams keep their text, tokens, usage and finish reasons; a
channel that fails ends its streams visibly; a worker without channels gets one stream per
request."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from deploy.fake_stack import Stack
from deploy.fake_workers import MODEL, toy_generate
from k3serve.sampling import SamplingParams
from k3serve.tokenizer import get_tokenizer
from router.channel import DecodeChannel
from router.workers import WorkerError


# ----------------------------------------------------------------------------- dispatch
class _W:
    url = "http://d0"


def _sub(log: list, name: str, stop_at: int | None = None):
    """``deliver`` / ``end`` recording into ``log``; ``deliver`` returns True (the consumer
    stopped) once it has seen ``stop_at`` tokens."""
    seen = [0]

    def deliver(batch) -> bool:
        log.append((name, "batch", [t for ev in batch for t in ev.token_ids],
                    batch[-1].finish_reason))
        seen[0] += sum(len(ev.token_ids) for ev in batch)
        return stop_at is not None and seen[0] >= stop_at

    def end(err) -> None:
        log.append((name, "end", None if err is None else str(err)))

    return deliver, end


def _ev(**kw) -> bytes:
    return json.dumps({"token_ids": [], "text": "", "logprobs": [], **kw}).encode()


def test_one_read_gives_each_request_its_events_as_one_batch_and_ends_streams_as_alone():
    ch = DecodeChannel(client=None, w=_W())  # type: ignore[arg-type]
    log: list = []
    subs = {rid: _sub(log, rid.decode(), stop_at=2 if rid == b"s" else None)
            for rid in (b"a", b"b", b"c", b"d", b"e", b"s")}
    ch._dispatch([
        (b"a", _ev(token_ids=[1])), (b"b", _ev(token_ids=[10])), (b"a", _ev(token_ids=[2])),
        (b"x", _ev(token_ids=[99])),  # not attached here (another router's, or detached)
        (b"b", _ev(token_ids=[11], finish_reason="stop")),  # ends b after its batch
        (b"b", b"[DONE]"),  # b is gone: ignored
        (b"c", _ev(token_ids=[20])), (b"c", b"[DONE]"),  # ended without a finish
        (b"d", _ev(token_ids=[30])), (b"d", _ev(error="engine died")),  # an error event
        (b"e", b"{not json"),  # malformed
        (b"s", _ev(token_ids=[40, 41])),  # the consumer stops at 2 tokens
    ], subs)
    assert set(subs) == {b"a"}  # only a is still streaming
    assert ("b", "batch", [10, 11], "stop") in log and ("b", "end", None) in log
    assert ("c", "batch", [20], None) in log and ("c", "end", None) in log
    d_end = [x for x in log if x[:2] == ("d", "end")]
    assert log.index(("d", "batch", [30], None)) < log.index(d_end[0])
    assert "engine died" in d_end[0][2]
    e = next(x for x in log if x[0] == "e")
    assert e[1] == "end" and "malformed" in e[2]
    assert ("s", "batch", [40, 41], None) in log and ("s", "end", None) in log
    assert ("a", "batch", [1, 2], None) in log and not [x for x in log if x[:2] == ("a", "end")]
    assert not [x for x in log if x[0] == "x"]


# ----------------------------------------------------------------------------- live stacks
@pytest.fixture(scope="module")
def stack():
    # busy_wait_s: a failed stream's migration (the fakes cannot resume) gives up in 2 s
    s = Stack(num_prefill=1, num_decode=2, api_key=None, busy_wait_s=2.0)
    yield s
    s.close()


def _stream(s: Stack, prompt: str, **kw) -> tuple[str, list, dict | None, str | None]:
    """A streamed completion: (text, chunks, usage, finish reason)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}, **kw}
    text, chunks, usage, finish = "", [], None, None
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])
            assert "error" not in c, c
            chunks.append(c)
            usage = c.get("usage") or usage
            for ch in c["choices"]:
                text += ch["text"]
                finish = ch.get("finish_reason") or finish
    return text, chunks, usage, finish


def _oracle(prompt: str, **kw) -> tuple[str, int, str]:
    tok = get_tokenizer(MODEL)
    ids = tok.encode(prompt, add_bos=True)
    sp = SamplingParams(max_tokens=kw.pop("max_tokens", 24), temperature=0.0,
                        stop=tuple(kw.pop("stop", ())), stop_token_ids=tok.stop_token_ids)
    out, text, finish = toy_generate(ids, sp)
    return text, len(out), finish


def test_streams_on_one_channel_per_decode_worker_keep_text_usage_and_finish(stack):
    cases = [("channel one", {}), ("channel two", {"stop": ["q"]}),
             ("channel three", {"max_tokens": 5}), ("channel four", {})]
    for prompt, kw in cases:
        text, _, usage, finish = _stream(stack, prompt, **kw)
        want_text, want_tokens, want_finish = _oracle(prompt, **kw)
        assert (text, finish) == (want_text, want_finish)
        assert usage["completion_tokens"] == want_tokens
    # every request went on its decode worker's one channel
    opened = [st.channels_opened for st, _ in stack.decode]
    assert all(n <= 1 for n in opened) and sum(opened) >= 1
    assert sum(len(st.streams) for st, _ in stack.decode) == len(cases)
    # concurrent streams share the channel and each gets its own text
    async def many() -> list:
        async with httpx.AsyncClient(timeout=30) as c:
            async def one(i: int) -> str:
                r = await c.post(stack.url + "/v1/completions", json={
                    "model": MODEL, "prompt": f"concurrent {i}", "max_tokens": 16,
                    "temperature": 0, "stream": True})
                return "".join(json.loads(ln[6:])["choices"][0]["text"]
                               for ln in r.text.splitlines()
                               if ln.startswith("data: {") and json.loads(ln[6:])["choices"])
            return await asyncio.gather(*(one(i) for i in range(12)))

    got = asyncio.run(many())
    assert got == [_oracle(f"concurrent {i}", max_tokens=16)[0] for i in range(12)]
    assert [st.channels_opened for st, _ in stack.decode] == [1, 1]  # both served some


def test_an_attach_to_a_channel_the_worker_lost_opens_it_again(stack):
    for st, _ in stack.decode:
        st.forget_channels = 1
    before = sum(st.channels_opened for st, _ in stack.decode)
    text, _, usage, finish = _stream(stack, "lost channel")
    assert (text, finish) == _oracle("lost channel")[::2]
    assert usage["completion_tokens"] == _oracle("lost channel")[1]
    assert sum(st.channels_opened for st, _ in stack.decode) == before + 1
    for st, _ in stack.decode:
        st.forget_channels = 0


def test_a_channel_that_drops_mid_stream_fails_its_streams_visibly_and_is_reopened(stack):
    """The fakes cannot resume a request elsewhere (real workers do: tests/worker), so the
    dropped stream's client gets the error; the next request opens a new channel."""
    for st, _ in stack.decode:
        st.hang_after = 3
    body = {"model": MODEL, "prompt": "dropped channel", "max_tokens": 40, "stream": True,
            "temperature": 0}
    lines: list[str] = []
    try:
        with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=30) as r:
            it = r.iter_lines()
            for line in it:
                lines.append(line)
                if len([x for x in lines if x.startswith("data: {")]) >= 2:
                    break
            for ch in list(stack.router.pool.streams.channels.by_url.values()):
                ch.close()  # the router's end of every channel drops
            lines += list(it)
    finally:
        for st, _ in stack.decode:
            st.hang_after = None
    payloads = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert any("error" in p for p in payloads), payloads  # visible, not a silent end
    assert lines[-1] == "data: [DONE]" or not lines[-1]
    before = sum(st.channels_opened for st, _ in stack.decode)
    text, _, _, finish = _stream(stack, "after the drop")
    assert (text, finish) == _oracle("after the drop")[::2]
    assert sum(st.channels_opened for st, _ in stack.decode) == before + 1
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and stack.router.admission.admitted:
        time.sleep(0.02)
    assert stack.router.admission.admitted == 0


@pytest.mark.parametrize("where", ["worker", "router"])
def test_without_channels_each_request_has_its_own_stream(where):
    """A decode worker that does not serve channels (``WorkerInfo.channels`` False), or a
    router started with ``--no-decode-channels``: one stream per request, same output."""
    kw = {"worker": {"channels": False}} if where == "worker" else {"decode_channels": False}
    s = Stack(num_prefill=1, num_decode=1, api_key=None, **kw)
    try:
        for prompt in ("own stream one", "own stream two"):
            text, _, usage, finish = _stream(s, prompt)
            want_text, want_tokens, want_finish = _oracle(prompt)
            assert (text, finish, usage["completion_tokens"]) == (want_text, want_finish,
                                                                   want_tokens)
        assert s.decode[0][0].channels_opened == 0
        assert not s.router.pool.streams.channels.by_url
    finally:
        s.close()


def test_channel_open_failure_is_a_worker_error():
    """A worker that refuses the channel (404 here): the stream fails as a worker failure,
    retryable, and nothing is left attached."""
    async def go() -> WorkerError:
        from k3serve.messages import StreamRequest
        from router.pool import WorkerPool

        s = Stack(num_prefill=1, num_decode=1, api_key=None)
        try:
            st = s.decode[0][0]
            st.channels = False  # refuses POST /internal/channel from now on (404)
            pool = WorkerPool(MODEL, "cluster-secret")
            try:
                w = await pool.registry.register(st.url)
                w.info = w.info.model_copy(update={"channels": True})  # as it said before
                with pytest.raises(WorkerError) as e:
                    await pool.streams.relay(w, StreamRequest(request_id="r-1", token_id=97),
                                            lambda b: False)
                assert not pool.streams.channels.by_url[w.url].attached
                return e.value
            finally:
                await pool.close()
        finally:
            s.close()

    err = asyncio.run(go())
    assert err.status == 404 and "/internal/channel" in str(err)


def test_a_stream_the_router_gives_up_on_is_aborted_on_the_worker():
    """A stream on a channel that the router stops waiting for while the worker still runs
    it (here: no event within ``timeout_s``): the worker gets ``/internal/abort``, as the
    close of a stream of its own told it before; the client sees the failure."""
    s = Stack(num_prefill=1, num_decode=1, api_key=None, timeout_s=1.0, busy_wait_s=1.0)
    try:
        dec = s.decode[0][0]
        dec.hang_after = 2
        body = {"model": MODEL, "prompt": "given up", "max_tokens": 40, "stream": True,
                "temperature": 0}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            lines = list(r.iter_lines())
        assert any('"error"' in x for x in lines if x.startswith("data: {")), lines
        rid = dec.streams[-1]["request_id"]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and rid not in dec.aborted:
            time.sleep(0.02)
        assert rid in dec.aborted
        assert dec.channels_opened == 1
    finally:
        s.close()


def test_a_stale_channel_id_neither_attaches_nor_closes_the_open_channel():
    """``attach`` / ``close`` name the channel ``open`` returned: a caller holding the id of
    a channel that has been replaced gets ``unknown_channel`` and cannot end the new one."""
    async def go() -> None:
        from router.pool import WorkerPool

        s = Stack(num_prefill=1, num_decode=1, api_key=None)
        try:
            pool = WorkerPool(MODEL, "cluster-secret")
            try:
                w = await pool.registry.register(s.decode[0][0].url)
                ch = DecodeChannel(pool.client, w)
                old = await ch.open()
                ch.close(old)
                new = await ch.open()
                assert new != old
                with pytest.raises(WorkerError) as e:
                    ch.attach(old, b"r", lambda b: False, lambda err: None)
                assert e.value.code == "unknown_channel"
                ch.close(old)  # a no-op: not the open one
                ch.attach(new, b"r", lambda b: False, lambda err: None)
                assert ch.task is not None and not ch.task.done()
                assert ch.detach(new, b"r") and not ch.detach(new, b"r")
                ch.close()
            finally:
                await pool.close()
        finally:
            t0 = time.monotonic()
            s.close()
            assert time.monotonic() - t0 < 5  # the fakes end their channels when they stop

    asyncio.run(go())
