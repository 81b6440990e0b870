"""Router app end to end over HTTP: the real ``openai`` client, fake workers (deploy.fake_workers).

Covers the OpenAI API end to end with the ``openai`` client (against fake workers; the live
``k3serve serve`` run is the launcher's test), bad input → 400/401/404/405 with an
OpenAI-style body, no worker → 503 (never a 500), cache hits (exact ``cached_tokens`` on a repeated prompt, predicted = actual),
metrics by scraping ``/metrics``, registration with the cluster token, resync after a worker
restart, retry on a failing prefill worker, and aborts when the client goes away.
"""

from __future__ import annotations

import dataclasses
import json
import time

import httpx
import openai
import pytest

from deploy.fake_stack import Stack
from deploy.fake_workers import API_KEY, MODEL, TOKEN, TOKENIZER, toy_generate
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from k3serve.sampling import SamplingParams
from router.retries import FIRST_TOKEN_ATTEMPTS

B = 16  # the fake workers' block size


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.close()


def _oracle(prompt_ids: list[int], max_tokens: int, seed: int = 0, temperature: float = 0.0,
            stop=()) -> tuple[list[int], str, str]:
    sp = SamplingParams(max_tokens=max_tokens, seed=seed, temperature=temperature,
                        stop=tuple(stop), stop_token_ids=TOKENIZER.stop_token_ids)
    return toy_generate(prompt_ids, sp)


def _repeat_prompt_len(ids: list[int]) -> int:
    return (len(ids) - 1) // B * B


# ----------------------------------------------------------------------------- openai client
def test_openai_completions_cached_tokens_exact_on_repeat(stack):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # 135 bytes + BOS
    ids = TOKENIZER.encode(prompt, add_bos=True)
    _, want_text, want_finish = _oracle(ids, 12)
    r1 = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                         temperature=0)
    assert r1.choices[0].text == want_text and r1.choices[0].finish_reason == want_finish
    assert r1.usage.prompt_tokens == len(ids) and r1.usage.completion_tokens == 12
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    stack.wait_indexed()
    r2 = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                         temperature=0)
    assert r2.choices[0].text == want_text
    assert r2.usage.prompt_tokens_details.cached_tokens == _repeat_prompt_len(ids) == 128
    # streamed, with usage at the end
    chunks = list(stack.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want_text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 128
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_chat_stream_and_not(stack):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours, please, in one line."}]
    ids = TOKENIZER.apply_chat_template(msgs)
    _, want_text, _ = _oracle(ids, 20, seed=7, temperature=0.8)
    r = stack.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20,
                                             temperature=0.8, seed=7)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want_text
    assert r.usage.prompt_tokens == len(ids)
    stream = stack.client.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=20, temperature=0.8, seed=7,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_text
    assert chunks[-1].usage.total_tokens == len(ids) + 20
    # raw SSE ends with [DONE]
    raw = stack.post("/v1/chat/completions", {"model": MODEL, "messages": msgs,
                                              "max_tokens": 3, "stream": True})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_n_choices_differ_seed_reproduces_and_share_the_prompt_cache(stack):
    prompt = "Once upon a time, in a land of many hashes, a router placed requests. "
    r = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, n=3,
                                        temperature=1.0, seed=123)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3
    ids = TOKENIZER.encode(prompt, add_bos=True)
    assert texts[0] == _oracle(ids, 10, seed=123, temperature=1.0)[1]  # choice 0 = n=1's
    again = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, n=3,
                                            temperature=1.0, seed=123)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    assert r.usage.completion_tokens == 30
    # choices 1..n-1 ran after choice 0's prefill was indexed: they reused the prompt
    pre = [p for st, _ in stack.prefill for p in st.prefills
           if p["prompt_token_ids"] == ids]
    assert len(pre) == 6
    assert sorted(p["_cached"] for p in pre) == [0] + [_repeat_prompt_len(ids)] * 5


def test_batch_prompts_and_token_id_prompts(stack):
    r = stack.post("/v1/completions", {"model": MODEL, "prompt": [[1, 2, 3, 4], [5, 6, 7]],
                                       "max_tokens": 4, "n": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]
    by = {c["index"]: c["text"] for c in body["choices"]}
    assert by[0] == by[1] == _oracle([1, 2, 3, 4], 4)[1]
    assert by[2] == by[3] == _oracle([5, 6, 7], 4)[1]
    assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["completion_tokens"] == 16


def test_stop_string_and_logprobs(stack):
    ids = TOKENIZER.encode("abc", add_bos=True)
    _, full, _ = _oracle(ids, 30)
    stop = full[5:7]
    _, want, reason = _oracle(ids, 30, stop=[stop])
    assert reason == "stop" and want == full[: full.index(stop)]
    r = stack.client.completions.create(model=MODEL, prompt="abc", max_tokens=30,
                                        temperature=0, stop=[stop], logprobs=2)
    c = r.choices[0]
    assert c.text == want and c.finish_reason == "stop"
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
    assert c.logprobs.token_logprobs[0] == -0.25 and len(c.logprobs.top_logprobs[0]) == 2
    assert "".join(c.logprobs.tokens)[: len(want)] == want
    ch = stack.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=3)
    lp = ch.choices[0].logprobs.content
    assert len(lp) == 5 and all(len(t.top_logprobs) == 3 for t in lp)
    assert "".join(t.token for t in lp) == ch.choices[0].message.content
    assert lp[0].bytes == list(lp[0].token.encode())


def test_models_health_metrics():
    """On its own stack (no earlier test's requests): a prompt, then the same prompt once the
    router has indexed it, so the counters hold a hit the router predicted."""
    stack = Stack()
    try:
        _models_health_metrics(stack)
    finally:
        stack.close()


def _models_health_metrics(stack: Stack) -> None:
    models = stack.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = stack.health()
    assert h["status"] == "ok" and h["num_workers_healthy"] == 3
    prompt = "metrics " * 10
    ids = TOKENIZER.encode(prompt, add_bos=True)
    r1 = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    stack.wait_indexed()
    r2 = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
    assert r2.usage.prompt_tokens_details.cached_tokens == _repeat_prompt_len(ids) > 0
    m = stack.metrics()
    names = {k.split("{")[0] for k in m}
    for n in ("k3serve:request_prompt_tokens_total", "k3serve:request_cached_tokens_total",
              "k3serve:router_predicted_cached_tokens_total", "k3serve:cache_hit_rate",
              "k3serve:time_to_first_token_seconds_count",
              "k3serve:inter_token_latency_seconds_count",
              "k3serve:e2e_request_latency_seconds_count", "k3serve:num_requests_running",
              "k3serve:num_requests_waiting"):
        assert n in names, n
    prompt = sum(v for k, v in m.items() if k.startswith("k3serve:request_prompt_tokens_total"))
    cached = sum(v for k, v in m.items() if k.startswith("k3serve:request_cached_tokens_total"))
    pred = sum(v for k, v in m.items()
               if k.startswith("k3serve:router_predicted_cached_tokens_total"))
    assert prompt == 2 * len(ids) and cached == _repeat_prompt_len(ids)
    assert m["k3serve:cache_hit_rate{}"] == pytest.approx(cached / prompt)
    # the router's predictions were exact on these sequential requests
    assert pred == cached
    assert sum(v for k, v in m.items() if k.startswith("k3serve:num_requests_running")) == 0
    assert sum(v for k, v in m.items() if k.startswith("k3serve:num_requests_waiting")) == 0


# ----------------------------------------------------------------------------- bad input
BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400,
     "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 9}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": [999999]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/completions", b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode(),
     400, None),
    ("/v1/completions", b'{"model": "%s", "prompt": "x", "top_p": Infinity}' % MODEL.encode(),
     400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 5000}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "bob", "content": "x"}]},
     400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 3}]},
     400, "messages"),
    # content is required (OpenAI rejects a message without it, or with null)
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": ""}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
     400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, None),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
     404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                            "content": "y" * 5000}]},
     400, "messages"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD,
                         ids=[f"{i}-{p.split('/')[-1]}" for i, (p, *_rest) in enumerate(BAD)])
def test_bad_input_is_openai_style_4xx(stack, path, body, status, param):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(stack.url + path, content=raw, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


def test_auth_routes_and_openai_errors(stack):
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert stack.post("/v1/completions", ok, key=None).status_code == 401
    r = stack.post("/v1/completions", ok, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(stack.url + "/v1/models").status_code == 401
    assert httpx.get(stack.url + "/v1/nothing").status_code == 404
    r = httpx.get(stack.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 405 and "error" in r.json()
    with pytest.raises(openai.BadRequestError):
        stack.client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.url + "/v1", api_key="bad", max_retries=0
                      ).models.list()
    # internal endpoints need the cluster token
    r = httpx.post(stack.url + "/internal/register", json={"url": stack.prefill[0][0].url})
    assert r.status_code == 403
    r = httpx.post(stack.url + "/internal/register", json={"url": "ftp://x"},
                   headers={CLUSTER_TOKEN_HEADER: TOKEN})
    assert r.status_code == 400
    r = httpx.post(stack.url + "/internal/register", json={"url": "http://127.0.0.1:9"},
                   headers={CLUSTER_TOKEN_HEADER: TOKEN})
    assert r.status_code == 503
    # workers saw the token on every call the router made
    assert all(st.unauthorized == 0 for st, _ in stack.prefill + stack.decode)


def test_token_1_is_passed_when_the_decode_stream_opens(stack):
    """The decode worker's fallback after a failed transfer continues from the prefill
    worker's token #1: the router passes it (and its logprob) when it opens the stream."""
    dec = stack.decode[0][0]
    n = len(dec.streams)
    r = stack.post("/v1/completions", {"model": MODEL, "prompt": "token one", "max_tokens": 3,
                                       "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = dec.streams[n]
    first = dec.reservations[body["request_id"]]["first"]
    assert body["token_id"] == first and body["logprob"] == -0.25  # toy_logprobs


def test_decode_stream_ending_without_a_finish_ends_the_choice(stack):
    """The decode worker detokenizes and holds back text that may start a stop string; the
    router relays what it released. A stream that ends early keeps every token and ends with
    D's reason, or "abort" (an error finish) with no reason at all (a stream without any
    finish_reason was once a 503), or "length" when the tokens reach D's model length. D's
    own finish ("length") releases its held-back text; an abort or a cut body does not (the
    router decodes nothing, so text D still held is not sent)."""
    dec = stack.decode[0][0]
    ids = TOKENIZER.encode("held back at the end", add_bos=True)
    toks, _, _ = _oracle(ids, 10)
    got = TOKENIZER.decode(toks[:4])  # token #1 + 3 from the decode worker
    stop = [got[-1] + "#"]  # the last character may start a stop string: held back
    body = {"model": MODEL, "prompt": ids, "max_tokens": 10, "temperature": 0, "stop": stop}
    try:
        for cut, want, text in (((3, None), "abort", got[:-1]),
                                 ((3, "length"), "length", got),
                                 ((3, "abort"), "abort", got[:-1])):
            dec.cut_stream = cut
            r = stack.post("/v1/completions", body)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            assert (c["text"], c["finish_reason"]) == (text, want), cut
            assert r.json()["usage"]["completion_tokens"] == 4
            chunks = list(stack.client.completions.create(**body, stream=True))
            assert "".join(x.choices[0].text for x in chunks) == text
            assert chunks[-1].choices[0].finish_reason == want
        # no finish, but the tokens reach the decode worker's model length (4096, below the
        # router's configured one): that is a length end
        old = stack.router.config
        stack.router.config = dataclasses.replace(old, max_model_len=8192)
        try:
            long_ids = [97 + i % 26 for i in range(4096 - 4)]
            dec.cut_stream = (3, None)
            r = stack.post("/v1/completions", {**body, "prompt": long_ids, "stop": None})
        finally:
            stack.router.config = old
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        dec.cut_stream = None


# ----------------------------------------------------------------------------- failures
def test_no_worker_is_503_never_500():
    s = Stack(num_prefill=0, num_decode=0, api_key=None)
    try:
        r = s.post("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2},
                   key=None)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        r = s.post("/v1/chat/completions", {"model": MODEL, "stream": True,
                                            "messages": [{"role": "user", "content": "x"}]},
                   key=None)
        assert r.status_code == 503
        assert httpx.get(s.url + "/health").status_code == 503
        with pytest.raises(openai.APIStatusError) as e:
            s.client.completions.create(model=MODEL, prompt="x")
        assert e.value.status_code == 503
    finally:
        s.close()


def test_dead_worker_skipped_and_failed_prefill_retried_elsewhere():
    s = Stack(num_prefill=2, num_decode=1, api_key=None)
    try:
        (a, _), (b, srv_b) = s.prefill
        a.fail_prefill = 1  # a answers 503 once: the router places the request on b
        # cold prompts go to either worker (load near-ties break by a hash of the prompt and
        # the workers' URLs, new ports every run): send until one was placed on a
        for i in range(16):
            r = s.post("/v1/completions", {"model": MODEL, "prompt": f"p{i} " * 9,
                                           "max_tokens": 3, "temperature": 0}, key=None)
            assert r.status_code == 200, r.text  # the failed prefill was retried on b
            if a.fail_prefill == 0:
                break
        assert a.fail_prefill == 0 and b.prefills
        srv_b.stop()  # b dies: its poller fails, it leaves placement
        deadline = time.monotonic() + 10
        while s.health()["num_prefill_healthy"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.health()["num_prefill_healthy"] == 1
        for i in range(3):
            r = s.post("/v1/completions", {"model": MODEL, "prompt": f"q{i} " * 9,
                                           "max_tokens": 2}, key=None)
            assert r.status_code == 200, r.text
    finally:
        s.close()


def test_worker_restart_resyncs_index_and_hits_again():
    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    try:
        body = {"model": MODEL, "prompt": "restart me " * 8, "max_tokens": 2, "temperature": 0}
        assert s.post("/v1/completions", body, key=None).json()["usage"][
            "prompt_tokens_details"]["cached_tokens"] == 0
        s.wait_indexed()
        r = s.post("/v1/completions", body, key=None).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        st = s.prefill[0][0]
        st.restart()  # empty cache, new epoch
        deadline = time.monotonic() + 10
        while s.health()["workers"][0]["snapshots"] and time.monotonic() < deadline:
            time.sleep(0.02)
        w = s.health()["workers"][0]
        assert w["snapshots"] == 0 and w["blocks"] == 0 and w["resyncs"] >= 1
        r = s.post("/v1/completions", body, key=None).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        m = s.metrics()
        pred = sum(v for k, v in m.items()
                   if k.startswith("k3serve:router_predicted_cached_tokens_total"))
        cached = sum(v for k, v in m.items()
                     if k.startswith("k3serve:request_cached_tokens_total"))
        assert pred == cached  # the resync kept predictions exact
    finally:
        s.close()


def test_client_disconnect_aborts_on_the_decode_worker():
    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    try:
        dec = s.decode[0][0]
        dec.hang_after = 1  # the stream stalls after one token until the router aborts it
        body = {"model": MODEL, "prompt": "slow", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:") and '"text"' in line:
                    break
        deadline = time.monotonic() + 10
        while not dec.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert dec.aborted, "the router did not abort the decode stream"
        deadline = time.monotonic() + 5
        while s.metrics().get("k3serve:num_requests_running{worker=" +
                              s.health()["workers"][1]["name"] + "}", 0) and \
                time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.router.pool.workers[dec.url].running == 0
    finally:
        s.close()


def test_busy_decode_is_waited_for_then_503_and_load_counters_return_to_zero():
    """A decode worker answering ``busy`` stays healthy: the reservation is retried (tenacity
    policy) until it gets room; past ``busy_wait_s`` the request is a 503. Whatever happens,
    the router's load account of every worker ends at zero (Worker.load owns it)."""
    s = Stack(num_prefill=1, num_decode=1, api_key=None, busy_wait_s=1.0)
    try:
        dec = s.decode[0][0]
        body = {"model": MODEL, "prompt": "room please " * 3, "max_tokens": 3,
                "temperature": 0}
        dec.busy_reserves = 3
        r = s.post("/v1/completions", body, key=None)
        assert r.status_code == 200, r.text
        assert dec.busy_reserves == 0 and s.health()["num_decode_healthy"] == 1
        dec.busy_reserves = 1 << 30  # never room
        r = s.post("/v1/completions", body, key=None)
        assert r.status_code == 503, r.text
        assert "room" in r.json()["error"]["message"]
        assert s.health()["num_decode_healthy"] == 1
        dec.busy_reserves = 0
        (pre, _), = s.prefill
        # a failed prefill is placed again (and aborted on D); with the only P failing every
        # attempt (whether or not a poll puts it back in placement in between) it is a 503
        pre.fail_prefill = FIRST_TOKEN_ATTEMPTS
        assert s.post("/v1/completions", body, key=None).status_code == 503  # only one P
        assert pre.fail_prefill < FIRST_TOKEN_ATTEMPTS  # P was tried
        pre.fail_prefill = 0
        deadline = time.monotonic() + 10  # P's next successful poll makes it healthy again
        while s.health()["num_prefill_healthy"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = s.post("/v1/completions", {**body, "stream": True}, key=None)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        for w in s.router.pool.workers.values():
            assert (w.running, w.reserved_tokens, w.queued_tokens) == (0, 0, 0), w
    finally:
        s.close()


def test_body_must_be_json_by_content_type(stack):
    """A non-JSON ``Content-Type`` is a 400 naming it (FastAPI / vLLM refuse it too); no
    type, a charset parameter or a ``+json`` type are read as JSON."""
    ok = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for media in ("text/plain", "application/x-www-form-urlencoded"):
        r = httpx.post(stack.url + "/v1/completions", content=ok,
                       headers={**auth, "Content-Type": media})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "unsupported_media_type"
        assert media in r.json()["error"]["message"]
    for media in (None, "application/json; charset=utf-8", "application/vnd.x+json"):
        r = httpx.post(stack.url + "/v1/completions", content=ok,
                       headers={**auth, **({"Content-Type": media} if media else {})})
        assert r.status_code == 200, (media, r.text)
