"""The whole stack with the real ``openai`` client: API, cache hits, metrics, auth, bad input.

``deploy.launcher.start_stack`` starts router + 2 prefill + 1 decode worker processes once
for this module (k3-tiny, block size 16, an API key); tests then talk OpenAI to it:

* completions and chat, streaming and not; streamed text equals the non-streamed text;
* ``usage.prompt_tokens_details.cached_tokens`` exact on a repeated prompt: ⌊(L−1)/B⌋·B;
* ``n=2`` gives two choices; stop strings cut the text; logprobs come back per token;
* the router's ``/metrics`` carries the DESIGN.md §6 names with nonzero prompt and cached
  token counts, the workers' ``/metrics`` theirs;
* the API key is enforced (401 with an OpenAI error body);
* a bad-input sweep against the live stack: 400 with an OpenAI-style body, never 5xx.

And ``k3serve serve`` as a subprocess: prints the URL; SIGTERM stops an idle stack (every child
process, the store's master included) within :data:`IDLE_STOP_S`. ``k3serve bench`` against
the module's stack takes its key from ``K3SERVE_API_KEY``; a wrong key is one line with the
router's 401 message.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from k3serve.protocol import CLUSTER_TOKEN_ENV, CLUSTER_TOKEN_HEADER
from tests.parallel.ray_cluster import alive
from tests.worker_procs import components

ROOT = Path(__file__).resolve().parents[2]
B = 16
KEY = "sk-e2e-test"
AUTH = {"Authorization": f"Bearer {KEY}"}  # the router's /metrics, /health?detail=1
MODEL = "k3-tiny"
#: an idle stack's stop, SIGTERM to the launcher's exit (a correctness bound, not a speed
#: figure: the drain polls, the servers' shutdown and the store's teardown each take < 1.5 s)
IDLE_STOP_S = 5.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from deploy.launcher import start_stack

    logs = tmp_path_factory.mktemp("stack-logs")
    st = start_stack(model=MODEL, num_prefill=2, num_decode=1, api_key=KEY, block_size=B,
                     log_dir=str(logs), ready_timeout=180)
    try:
        yield st
    finally:
        st.stop()
        assert not [p for p in st.procs if p.poll() is None]


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _wait_indexed(stack, min_blocks: int, timeout: float = 5.0) -> None:
    """Let the router pull the workers' cache events (it polls every 0.1 s)."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        ws = httpx.get(stack.url + "/health", params={"detail": 1}, headers=AUTH,
                       timeout=5).json()["workers"]
        if sum(w["blocks"] for w in ws if w["role"] == "prefill") >= min_blocks:
            return
        time.sleep(0.1)


# ============================================================================ OpenAI API
def test_completions_cached_tokens_exact_on_a_repeated_prompt(stack, client):
    prompt = "Prefix caching reuses the KDA snapshot and the MLA latent blocks. " * 2
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    L = first.usage.prompt_tokens
    assert L > 2 * B
    assert first.choices[0].finish_reason in ("length", "stop")
    _wait_indexed(stack, (L - 1) // B)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert again.usage.prompt_tokens == L
    assert again.usage.prompt_tokens_details.cached_tokens == (L - 1) // B * B
    assert again.choices[0].text == first.choices[0].text


def test_streaming_equals_non_streaming(client):
    prompt = "Disaggregated serving moves the cache between workers."
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                            temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_and_not(client):
    msgs = [{"role": "user", "content": "Say something about delta attention."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    s = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(s)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == r.usage.prompt_tokens


def test_n2_logprobs_and_seed(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "two answers please"}],
        max_tokens=8, n=2, temperature=1.0, seed=5, logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    for c in r.choices:
        assert c.logprobs is not None and len(c.logprobs.content) >= 1
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "two answers please"}],
        max_tokens=8, n=2, temperature=1.0, seed=5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_stop_string_cuts_the_text(client):
    prompt = "Stop strings end generation where they appear: "
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = next((ch for ch in text[2:] if ch != "\ufffd"), None)
    if stop is None:
        pytest.skip(f"no usable stop character in {text!r}")
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_metrics_have_the_design_names(stack, client):
    client.completions.create(model=MODEL, prompt="metrics " * 8, max_tokens=2, temperature=0)
    text = httpx.get(stack.url + "/metrics", headers=AUTH, timeout=10).text
    for name in ("k3serve:request_prompt_tokens_total", "k3serve:request_cached_tokens_total",
                 "k3serve:router_predicted_cached_tokens_total", "k3serve:cache_hit_rate",
                 "k3serve:time_to_first_token_seconds", "k3serve:inter_token_latency_seconds",
                 "k3serve:e2e_request_latency_seconds", "k3serve:num_requests_running",
                 "k3serve:num_requests_waiting"):
        assert name in text, name

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{"))

    assert total("k3serve:request_prompt_tokens_total") > 0
    assert total("k3serve:request_cached_tokens_total") > 0  # the repeated prompt above
    headers = {"X-K3serve-Cluster-Token": stack.cluster_token}
    for url in stack.worker_urls:
        w = httpx.get(url + "/metrics", timeout=10).text
        for name in ("k3serve:prefix_cache_queries_total", "k3serve:prefix_cache_hits_total",
                     "k3serve:kv_transfer_bytes_total", "k3serve:kv_transfer_seconds",
                     "k3serve:kda_snapshots", "k3serve:cache_usage_ratio",
                     "k3serve:num_requests_running", "k3serve:num_requests_waiting",
                     "k3serve:kv_transfer_fallbacks_total"):
            assert name in w, (url, name)
        # internal endpoints need the cluster token the launcher generated
        assert httpx.get(url + "/internal/info", timeout=5).status_code == 403
        assert httpx.get(url + "/internal/info", headers=headers, timeout=5).status_code == 200


def test_api_key_enforced(stack):
    import openai

    bad = openai.OpenAI(base_url=stack.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    r = httpx.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"},
                   timeout=10)
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["type"] and err["message"] and err["code"] == "invalid_api_key"


def test_bench_takes_the_key_from_the_environment(stack, monkeypatch, capsys):
    from cli.main import main

    args = ["bench", "--url", stack.url, "--rate", "inf", "--num", "2", "--input-len", "8",
            "--output-len", "2", "--no-progress"]
    monkeypatch.setenv("K3SERVE_API_KEY", KEY)
    assert main(args) == 0, capsys.readouterr()
    assert "num_failed               0 requests" in capsys.readouterr().out
    monkeypatch.setenv("K3SERVE_API_KEY", "sk-wrong")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [(f"k3serve bench: error: HTTP 401 Unauthorized from GET {stack.url}/metrics: "
                   "Incorrect API key provided. (give the key with --api-key or "
                   "K3SERVE_API_KEY)")], err


@pytest.mark.parametrize("path,body,status", [
    ("/v1/completions", b'{"model": "k3-tiny", "prompt": ', 400),                # malformed
    ("/v1/completions", b"[1, 2, 3]", 400),                                        # not object
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400),
    ("/v1/completions", {"model": MODEL}, 400),                                     # no prompt
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 20000, "max_tokens": 4}, 400),
    ("/v1/completions", {"model": "gpt-17", "prompt": "x"}, 404),                   # model
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 999999]}, 400),           # vocab
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
     400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [], "n": 0}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 0}, 400),
])
def test_bad_input_sweep(stack, path, body, status):
    headers = {"Authorization": f"Bearer {KEY}"}
    if isinstance(body, bytes):
        r = httpx.post(stack.url + path, content=body, timeout=30,
                       headers={**headers, "Content-Type": "application/json"})
    else:
        r = httpx.post(stack.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"


# ============================================================================ failures
def _health(stack) -> dict:
    try:
        return httpx.get(stack.url + "/health", params={"detail": 1}, headers=AUTH,
                         timeout=5).json()
    except httpx.HTTPError:
        return {}


def test_workers_re_register_after_a_router_restart(stack, client):
    """The router forgets every worker when it restarts; they register again on their own."""
    old = stack.procs[0]
    args = old.args
    old.terminate()
    old.wait(15)
    new = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ,
                                                   K3SERVE_CLUSTER_TOKEN=stack.cluster_token),
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    stack.procs[0] = new
    t_end = time.monotonic() + 60
    while _health(stack).get("num_workers_healthy", 0) < 3:
        assert new.poll() is None and time.monotonic() < t_end, _health(stack)
        time.sleep(0.2)
    r = client.completions.create(model=MODEL, prompt="after the restart", max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_dead_prefill_worker_requests_still_served(stack, client):
    """Kill a prefill worker: the router retries a refused prefill elsewhere and takes the dead
    worker out of placement; every request ends (served or a retryable 503), none hangs."""
    import openai

    victim = stack.procs[1]  # prefill-0
    victim.kill()
    victim.wait(10)
    ok = 0
    for i in range(4):
        try:
            r = client.completions.create(model=MODEL, prompt=f"still alive {i} " * 4,
                                          max_tokens=3, timeout=60)
            ok += r.usage.completion_tokens == 3
        except openai.APIStatusError as e:  # a prefill in flight on the dead worker
            assert e.status_code == 503 and e.body["code"] in ("worker_error",
                                                               "service_unavailable")
    assert ok >= 3
    t_end = time.monotonic() + 10
    while _health(stack).get("num_prefill_healthy") != 1:
        assert time.monotonic() < t_end, _health(stack)
        time.sleep(0.2)


# ============================================================================ k3serve serve
def test_k3serve_serve_prints_url_and_sigterm_stops_every_child(tmp_path):
    from deploy.local import free_port

    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(port), "--prefill", "1", "--decode", "1",
                          "--block-size", str(B), "--max-prompts", "2", "--num-pages", "96"],
                         cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         # setproctitle leaves /proc/PID/environ readable (the cluster token)
                         env={**os.environ, "SPT_NOENV": "1"})
    kids: list[int] = []
    try:
        url, lines = None, []
        t_end = time.monotonic() + 180
        while url is None and time.monotonic() < t_end:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "serving" in line and f":{port}" in line:
                url = f"http://127.0.0.1:{port}"
        assert url, "".join(lines[-30:])
        # Mooncake's glog lines (the store client's setup prints one E line) stay off the
        # terminal: they go to the kvstore.mooncake logger at DEBUG
        assert not [ln for ln in lines if re.match(r"[IWEF]\d{4} ", ln)], "".join(lines)
        kids = components(p.pid)
        # router + 1 prefill + 1 decode, and the store's master where mooncake is installed
        ours = [k for k in kids if "mooncake_master" not in Path(f"/proc/{k}/cmdline").read_text()]
        assert len(ours) == 3 and len(kids) <= 4, kids
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
        # the router's and the workers' own flags pass through `k3serve serve`
        r = httpx.post(url + "/v1/completions", timeout=10, json={
            "model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_prompts"
        # `ps` names each process by its role (setproctitle); the workers got --num-pages 96
        titles = {k: Path(f"/proc/{k}/cmdline").read_text().replace("\0", " ").strip()
                  for k in ours}
        assert Path(f"/proc/{p.pid}/cmdline").read_text().strip("\0 ") == "k3serve serve"
        assert sorted(t.split()[1] for t in titles.values()) == [
            "decode-worker", "prefill-worker", "router"], titles
        assert all(t.startswith("k3serve ") for t in titles.values()), titles
        for k, t in titles.items():
            if t.split()[1].endswith("-worker"):
                env = dict(x.split("=", 1) for x in Path(f"/proc/{k}/environ").read_text().split(
                    "\0") if "=" in x)
                info = httpx.get(f"http://127.0.0.1{t.split()[2]}/internal/info", timeout=10,
                                 headers={CLUSTER_TOKEN_HEADER: env[CLUSTER_TOKEN_ENV]}).json()
                assert info["capacity"]["num_pages"] == 96, (t, info["capacity"])
        # idle (no request in flight): one SIGTERM stops everything within IDLE_STOP_S
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        stop_s = time.monotonic() - t0
        assert stop_s <= IDLE_STOP_S, f"an idle stack took {stop_s:.1f} s to stop"
        assert not [k for k in kids if alive(k)]  # the launcher waited for each child
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    t_end = time.monotonic() + 10
    while any(alive(k) for k in kids) and time.monotonic() < t_end:
        time.sleep(0.1)
    assert not [k for k in kids if alive(k)]
