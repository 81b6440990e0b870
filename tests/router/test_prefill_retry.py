"""A request whose prefill worker fails before token #1 while no other prefill worker is live
waits for one (``router.retries.wait_for_live``: a supervised worker comes back and
registers) instead of failing at once; with none back within ``busy_wait_s`` of its arrival
it fails with 503 and ``Retry-After``. Fake workers (deploy/fake_workers.py); the live kill of
a real prefill worker is in tests/deploy/test_edges_live.py."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from deploy.fake_stack import Stack
from deploy.fake_workers import MODEL, TOKEN, start_worker
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from router.retries import wait_for_live

#: the router's settings that take a hung worker out of placement within a second
FAST = {"poll_timeout_s": 0.2, "unhealthy_after": 1, "deadline_s": 0.5}


def _wait(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _post(s: Stack, out: dict) -> None:
    out["r"] = httpx.post(s.url + "/v1/completions", json={
        "model": MODEL, "prompt": "lost prefill " * 3, "max_tokens": 3, "temperature": 0},
        timeout=60)


def _register(s, url: str, within_s: float = 15.0) -> None:
    """Register ``url`` as a worker does (worker/registration.py): again while the router
    answers 503 (it could not read the worker's info within ``poll_timeout_s``, 0.2 s here,
    which a loaded machine can miss)."""
    deadline = time.monotonic() + within_s
    while True:
        r = httpx.post(s.url + "/internal/register", json={"url": url},
                       headers={CLUSTER_TOKEN_HEADER: TOKEN})
        if r.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text


def test_a_request_whose_only_prefill_worker_hung_waits_for_a_new_one():
    s = Stack(num_prefill=1, num_decode=1, api_key=None, busy_wait_s=30.0, **FAST)
    (a, _), = s.prefill
    late = None
    try:
        a.stalled = True  # every call to a waits unanswered: its prefill is lost
        out: dict = {}
        t = threading.Thread(target=_post, args=(s, out))
        t.start()
        wa = s.router.pool.workers[a.url]
        _wait(lambda: not wa.available, what="the hung worker out of placement")
        time.sleep(1.0)  # past the router's deadline on it: the request is waiting now
        assert "r" not in out, out["r"].text  # no 503: it waits for a prefill worker
        late = start_worker("prefill", TOKEN)
        _register(s, late[0].url)
        t.join(30)
        assert out["r"].status_code == 200, out["r"].text
        assert len(late[0].prefills) == 1
    finally:
        a.stalled = False
        if late is not None:
            late[1].stop()
        s.close()


def test_with_no_prefill_worker_back_the_request_fails_with_503_after_the_wait():
    busy_wait_s = 2.0
    s = Stack(num_prefill=1, num_decode=1, api_key=None, busy_wait_s=busy_wait_s, **FAST)
    (a, _), = s.prefill
    try:
        a.stalled = True
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json={
            "model": MODEL, "prompt": "never prefilled", "max_tokens": 3}, timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert r.headers.get("retry-after") == "1"
        assert r.json()["error"]["code"] == "service_unavailable"
        assert busy_wait_s <= took < busy_wait_s + 5, took
    finally:
        a.stalled = False
        s.close()


def test_wait_for_live_returns_when_every_role_has_a_worker_or_at_the_deadline():
    live: dict[str, list[str]] = {"prefill": [], "decode": ["d"]}

    async def back_later() -> float:
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        loop.call_later(0.5, lambda: live["prefill"].append("p"))
        await wait_for_live(live.__getitem__, False, t0 + 10, "r-0")
        return time.monotonic() - t0

    assert 0.5 <= asyncio.run(back_later()) < 2.0
    live["prefill"].clear()

    async def never() -> float:
        t0 = time.monotonic()
        await wait_for_live(live.__getitem__, False, t0 + 0.6, "r-0")
        return time.monotonic() - t0

    assert 0.6 <= asyncio.run(never()) < 1.5

    async def monolithic() -> float:  # only decode workers are needed: no wait
        t0 = time.monotonic()
        await wait_for_live(live.__getitem__, True, t0 + 10, "r-0")
        return time.monotonic() - t0

    assert asyncio.run(monolithic()) < 0.1
