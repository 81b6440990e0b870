"""A live supervised stack (router + 1 prefill + 1 decode worker process, k3-tiny, loopback,
``deploy.launcher.start_stack(supervise=True)``), in file order:

1. ``stream_options.continuous_usage_stats`` (with ``include_usage``, as vLLM): every
   streamed chunk carries the running ``usage`` (prompt tokens, the completion tokens
   streamed so far, their sum), the final usage chunk as without it; without
   ``include_usage``, or without ``continuous_usage_stats``, the chunks carry none.
2. kill -9 of the only prefill worker while a request is in its prefill: the router waits for
   the supervisor's restart (``router.retries.wait_for_live``) and places the request on the
   restarted worker; the client gets the same text as before the kill, no 503.
3. SIGTERM to every component while streams run (a drain, as ``k3serve serve`` stops): the
   streams finish and no component logs a warning for the drain's expected events.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

B = 16
MODEL = "k3-tiny"
PROMPT = "The lost prefill comes back on the restarted worker " * 4


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """The folder of the stack's component logs (``{name}.log``)."""
    return tmp_path_factory.mktemp("stack-logs")


@pytest.fixture(scope="module")
def stack(logs):
    from deploy.launcher import start_stack

    st = start_stack(model=MODEL, num_prefill=1, num_decode=1, api_key=None, block_size=B,
                     log_dir=str(logs), ready_timeout=180, supervise=True, max_restarts=2)
    try:
        yield st
    finally:
        st.stop()
        assert not [p for p in st.procs if p.poll() is None]


@pytest.fixture(scope="module")
def client(stack):
    import openai

    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


def _chunks(client, chat: bool, options: dict | None, max_tokens: int = 6) -> list:
    kw = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True,
          "extra_body": {"ignore_eos": True}}
    if options is not None:
        kw["stream_options"] = options
    if chat:
        return list(client.chat.completions.create(
            messages=[{"role": "user", "content": "count with me"}], **kw))
    return list(client.completions.create(prompt="one two three", **kw))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(client, chat):
    chunks = _chunks(client, chat, {"include_usage": True, "continuous_usage_stats": True})
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert final.usage.completion_tokens == 6
    body = chunks[:-1]
    assert body and all(c.usage is not None for c in body), [c.usage for c in body]
    counts = [c.usage.completion_tokens for c in body]
    assert counts == sorted(counts) and 1 <= counts[0] and counts[-1] == 6, counts
    for c in body:
        u = c.usage
        assert u.prompt_tokens == final.usage.prompt_tokens
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # the text of the chunks is the text of a stream without the running usage
    plain = _chunks(client, chat, {"include_usage": True})

    def text(cs):
        return "".join((c.choices[0].delta.content or "") if chat else c.choices[0].text
                       for c in cs if c.choices)

    assert text(body) == text(plain[:-1])
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None
    # vLLM's rule: continuous_usage_stats needs include_usage
    alone = _chunks(client, chat, {"continuous_usage_stats": True})
    assert all(c.usage is None for c in alone) and text(alone) == text(body)


def _complete(url: str, out: dict) -> None:
    t0 = time.monotonic()
    out["r"] = httpx.post(url + "/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        timeout=180)
    out["s"] = time.monotonic() - t0


def test_kill_the_only_prefill_worker_mid_prefill_the_request_completes(stack):
    ref: dict = {}
    _complete(stack.url, ref)
    assert ref["r"].status_code == 200, ref["r"].text
    i = next(k for k, s in enumerate(stack.specs) if s.name == "prefill-0")
    proc, old_url = stack.procs[i], stack.worker_urls[stack.specs[i].url_index]
    # a stopped worker holds the request unanswered (in its prefill); the kill then loses it
    os.kill(proc.pid, signal.SIGSTOP)
    out: dict = {}
    t = threading.Thread(target=_complete, args=(stack.url, out))
    try:
        t.start()
        time.sleep(1.0)
        assert "r" not in out
    finally:
        os.kill(proc.pid, signal.SIGKILL)
    t.join(170)
    r = out["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref["r"].json()["choices"][0]["text"]
    assert stack.specs[i].restarts == 1
    assert stack.worker_urls[stack.specs[i].url_index] != old_url  # the restarted worker
    print(f"request answered {out['s']:.1f} s after it was sent (the restart included)")
    health = httpx.get(stack.url + "/health").json()
    assert health["num_prefill_healthy"] == 1, health


def _stream(url: str, out: list) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": MODEL, "prompt": "drain me", "max_tokens": 96, "stream": True,
            "ignore_eos": True, "temperature": 0}, timeout=180) as r:
        out.append(r.status_code)
        out.append(b"".join(r.iter_bytes()))


def test_a_drain_logs_no_warning(stack, logs):
    """Last (it stops the stack): SIGTERM to every component while streams run, as ``k3serve
    serve`` stops: the streams finish, and neither the router (the drained workers stop
    answering its polls and probes) nor a worker (its drain starting and ending) logs a
    warning, error or traceback."""
    outs: list[list] = [[] for _ in range(3)]
    threads = [threading.Thread(target=_stream, args=(stack.url, o)) for o in outs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(outs) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the streams are running
    sizes = {s.name: (logs / f"{s.name}.log").stat().st_size for s in stack.specs}
    stack.stop(timeout=120)
    for t in threads:
        t.join(120)
    for o in outs:
        assert o[0] == 200 and o[1].rstrip().endswith(b"data: [DONE]"), o
        assert b'"finish_reason":"length"' in o[1]
    bad = []
    for name, start in sizes.items():
        with open(logs / f"{name}.log", "rb") as f:
            f.seek(start)
            for line in f.read().decode(errors="replace").splitlines():
                if " WARNING " in line or " ERROR " in line or "Traceback" in line:
                    bad.append(f"{name}: {line}")
    assert not bad, "\n".join(bad)
