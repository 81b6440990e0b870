"""Issue 15 part C: supervision and graceful drain on a live local stack.

One stack for the module (``start_stack(supervise=True)``: router + 1 prefill + 1 decode,
k3-tiny, block size 16, an API key); the tests run in order:

1. ``kill -9`` of the only decode worker while streams run: the supervisor starts it again on
   a fresh port, the router replaces the old entry with the new URL, and the streams migrate
   to it once it registered (text equal to the fault-free run); nothing else died.
2. SIGTERM of the decode worker while it holds a reservation: at once its ``/health`` says
   ``draining``, the router no longer lists it, a new reservation is refused with 503
   ``draining``; the held request still completes (prefill → transfer → stream); then the
   worker exits with status 0 and is not restarted.
3. The logs of every component never contain the API key or the cluster token.

Without a model (a backend whose children exit at once): the restart limit and the backoff
between failed starts (tenacity), a router past its limit ends the stack, a worker does not.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import tenacity

from deploy.launcher import Stack
from deploy.supervisor import Spec, Supervisor
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from tests.worker_procs import _sampling, _stream

B = 16
KEY = "sk-supervision-test"
AUTH = {"Authorization": f"Bearer {KEY}"}  # the router's /metrics, /health?detail=1
PROMPT = "The quick brown fox jumps over the lazy dog and"
AUTH = {"Authorization": f"Bearer {KEY}"}
N_STREAMS = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from deploy.launcher import start_stack

    logs = tmp_path_factory.mktemp("sup-logs")
    st = start_stack(model="k3-tiny", num_prefill=1, num_decode=1, api_key=KEY, block_size=B,
                     log_dir=str(logs), ready_timeout=180, supervise=True, max_restarts=2)
    st.log_dir = logs
    try:
        yield st
    finally:
        st.stop()
        assert not [p for p in st.procs if p.poll() is None]


def _complete(stack: Stack) -> httpx.Response:
    return httpx.post(stack.url + "/v1/completions", timeout=120,
                      headers=AUTH,
                      json={"model": "k3-tiny", "prompt": PROMPT, "max_tokens": 4})


def _router_workers(stack: Stack) -> dict[str, bool]:
    body = httpx.get(stack.url + "/health", params={"detail": 1}, headers=AUTH, timeout=5).json()
    return {w["url"]: w["healthy"] for w in body.get("workers", ())}


def _until(pred, timeout: float, what: str, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


async def _streams(url: str, n: int, during=None) -> list[tuple[str, str | None]]:
    """``n`` streaming completions at once (greedy, ≤ 32 tokens): (text, finish_reason) each;
    ``during(started)`` runs alongside once every stream has its first text."""
    async def one(c: httpx.AsyncClient, i: int, started: asyncio.Event):
        text, finish = "", None
        async with c.stream("POST", url + "/v1/completions", headers=AUTH, json={
                "model": "k3-tiny", "prompt": f"{PROMPT} {i}", "max_tokens": 32,
                "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200, (await r.aread())[:300]
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                ev = json.loads(line[5:])
                assert "error" not in ev, ev
                for ch in ev.get("choices") or ():
                    text += ch.get("text") or ""
                    finish = ch.get("finish_reason") or finish
                    started.set()
        return text, finish

    async with httpx.AsyncClient(timeout=180) as c:
        started = [asyncio.Event() for _ in range(n)]
        tasks = [asyncio.create_task(one(c, i, s)) for i, s in enumerate(started)]
        if during is not None:
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
            await during()
        return await asyncio.gather(*tasks)


def test_the_only_decode_worker_killed_mid_stream_restarts_and_its_streams_migrate(stack):
    """kill -9 of the ONLY decode worker while streams run: the supervisor starts it again on
    a fresh port, the router replaces the old entry with the new URL (same worker id), and
    every stream migrates to it once it registered — each completes with the text of the
    same request run without the fault; nothing else died."""
    want = asyncio.run(_streams(stack.url, N_STREAMS))
    assert all(f == "length" for _, f in want), want
    d = stack.specs.index(next(s for s in stack.specs if s.name == "decode-0"))
    old_url, old = stack.worker_urls[stack.specs[d].url_index], stack.procs[d]

    async def kill() -> None:
        old.kill()  # kill -9, mid-stream

    got = asyncio.run(_streams(stack.url, N_STREAMS, kill))
    assert old.wait(10) is not None
    assert got == want
    new_url = stack.worker_urls[stack.specs[d].url_index]
    assert new_url != old_url  # restarted by the supervisor, on a fresh port
    ws = _router_workers(stack)
    assert ws.get(new_url) and old_url not in ws, ws
    text = httpx.get(stack.url + "/metrics", headers=AUTH, timeout=10).text
    migrated = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith("k3serve:router_migrations_total"))
    assert migrated >= 1
    r = _complete(stack)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    assert stack.procs[d] is not old and stack.procs[d].poll() is None
    assert all(p.poll() is None for p in stack.procs)  # the stack never went down
    assert stack.supervisor is not None and stack.supervisor.fatal is None


def test_sigterm_drains_a_worker_then_it_exits_0(stack):
    d = stack.specs.index(next(s for s in stack.specs if s.name == "decode-0"))
    p_url = stack.worker_urls[0]
    d_url, proc = stack.worker_urls[stack.specs[d].url_index], stack.procs[d]
    h = {CLUSTER_TOKEN_HEADER: stack.cluster_token}
    ids = list(range(3, 40))

    def reserve(rid: str) -> httpx.Response:
        return httpx.post(d_url + "/internal/reserve", headers=h, timeout=30, json={
            "request_id": rid, "prompt_token_ids": ids, "sampling": _sampling(), "n": 1})

    held = reserve("held-1")
    assert held.status_code == 200, held.text
    os.kill(proc.pid, signal.SIGTERM)
    _until(lambda: httpx.get(d_url + "/health", timeout=5).json()["status"] == "draining", 10,
           "the decode worker reports draining")
    _until(lambda: d_url not in _router_workers(stack), 10, "the router drops the worker")
    r = reserve("new-1")
    assert r.status_code == 503 and r.json()["error"] == "draining", r.text
    assert proc.poll() is None  # it still holds the reserved request

    async def finish() -> tuple[list[int], str | None]:
        async with httpx.AsyncClient(headers=h, timeout=60) as c:
            res = held.json()
            p = await c.post(p_url + "/internal/prefill", json={
                "request_id": "held-1", "prompt_token_ids": ids, "sampling": _sampling(),
                "ticket": res["ticket"], "bootstrap_addr": res["bootstrap_addr"],
                "snapshot_at": [], "cache_salt": None})
            assert p.status_code == 200, p.text
            return await _stream(c, d_url, "held-1", p.json())

    toks, finish_reason = asyncio.run(finish())
    assert finish_reason in ("stop", "length") and toks
    assert proc.wait(timeout=30) == 0
    time.sleep(1.5)  # several supervisor checks: a drained worker is not restarted
    assert stack.procs[d] is proc and stack.worker_urls[stack.specs[d].url_index] == d_url


def test_no_secret_in_any_log(stack):
    text = "".join(f.read_text(errors="replace") for f in stack.log_dir.glob("*.log"))
    assert "listening on" in text  # the logs are there
    assert KEY not in text and stack.cluster_token not in text


# ============================================================================ no model
class _Exiting:
    """A backend whose components exit at once with ``code`` (a crash loop)."""

    name, internal_host = "fake", "127.0.0.1"

    def __init__(self, code: int) -> None:
        self.code, self.spawned = code, 0

    def free_port(self, host: str) -> int:
        from deploy.local import free_port

        return free_port(host)

    def spawn(self, name, module, args, env):
        self.spawned += 1
        return subprocess.Popen([sys.executable, "-c", f"raise SystemExit({self.code})"])


class _Waits(tenacity.wait.wait_base):
    """Records the attempt numbers tenacity asks a wait for (no real sleeping)."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def __call__(self, retry_state) -> float:
        self.asked.append(retry_state.attempt_number)
        return 0.01


def _fake_stack(kind: str, code: int) -> tuple[Stack, Spec]:
    st = Stack(url="http://127.0.0.1:9", api_key=None, cluster_token="t")
    spec = Spec("decode-0" if kind == "worker" else "router", "x", ["--port", "1"], {}, kind,
                url_index=0 if kind == "worker" else -1)
    st.specs.append(spec)
    st.worker_urls.append("http://127.0.0.1:1")
    st.procs.append(subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"]))
    st.procs[0].wait()
    return st, spec


@pytest.mark.parametrize("kind", ["worker", "router"])
def test_a_crash_loop_backs_off_and_stops_at_the_restart_limit(kind):
    st, spec = _fake_stack(kind, 3)
    launch, waits, said = _Exiting(3), _Waits(), []
    sup = Supervisor(st, launch, max_restarts=3, wait=waits, poll_s=0.05, say=said.append)
    sup.start()
    try:
        _until(lambda: any("left down" in m for m in said), 30, "the supervisor gives up")
    finally:
        sup.stop()
    assert launch.spawned == spec.restarts == 3
    backoffs = [m for m in said if "next try in" in m]
    assert len(backoffs) == 2 and waits.asked[:2] == [1, 2]  # between failed starts only
    assert (sup.fatal is not None) == (kind == "router")
    if kind == "worker":  # fresh ports on each try
        assert len({e.split(": ", 1)[1] for e in spec.events}) == 3


def test_a_component_that_exits_0_is_not_restarted():
    st, spec = _fake_stack("worker", 0)
    launch, said = _Exiting(0), []
    sup = Supervisor(st, launch, max_restarts=3, poll_s=0.05, say=said.append)
    sup.check()
    sup.check()
    assert launch.spawned == 0 and spec.restarts == 0
    assert said == ["decode-0 exited with status 0; not restarted (stopped on purpose)"]
