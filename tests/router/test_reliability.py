"""The router when workers break (issue 15, part A), against fake workers (deploy.fake_workers):

* clients that go away leak no connection of the router, and request traffic that exhausts
  the request path's connection pool leaves every worker healthy (the health polls have their
  own pool); the starved requests are shed with 503 and ``Retry-After``, and the router
  serves again once connections free up;
* a hung worker leaves placement within a few polls, the requests already waiting on it give
  up at ``deadline_s`` (not the call timeout), and it rejoins with its index resynced;
* a worker whose request-path calls keep failing opens its circuit breaker: placement skips
  it (though its polls answer) until a trial request succeeds;
* ``max_model_len`` is the minimum over the available workers only;
* a worker whose bounded queue is full (503 ``busy`` + ``Retry-After``) is passed over, not
  blamed; every worker busy → 503 + ``Retry-After`` to the client;
* a worker's 400 before token #1 reaches the client once (not placed again);
* after a migration the running gauge and the ITL histogram follow the new decode worker.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from deploy.fake_stack import Stack
from deploy.fake_workers import MODEL, TOKEN, start_worker
from k3serve.messages import CacheState
from k3serve.protocol import CLUSTER_TOKEN_HEADER


def _wait(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _complete(s: Stack, prompt: str, max_tokens: int = 3, **kw) -> httpx.Response:
    return httpx.post(s.url + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw},
        timeout=20)


class _Holder:
    """A streaming request on a raw socket: reads until its first SSE event, then keeps the
    connection open (neither reading nor closing) until ``close()``."""

    def __init__(self, url: str, prompt: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 200,
                           "stream": True}).encode()
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while b"data:" not in got:
            chunk = self.sock.recv(65536)
            assert chunk, got
            got += chunk
        self.status = int(got.split(b" ", 2)[1])

    def close(self) -> None:
        self.sock.close()


def test_a_large_batch_that_the_client_gives_up_on_leaves_every_worker_healthy():
    """The failure of the issue: a batch of many prompts (one connection per choice) filled the
    connection pool that the health polls shared; they failed with ``PoolTimeout`` and every
    worker was marked unhealthy while each answered its own /health. Choices now run on the
    decode slots (``Admission.seat``) and the polls have their own pool."""
    # max_queued: the 120 choices fit in what the router runs at once (8 slots + 128 queued)
    s = Stack(num_prefill=1, num_decode=1, api_key=None, poll_timeout_s=1.0, max_queued=128)
    try:
        (dec, _), = s.decode
        dec.hang_after = 1  # every stream stalls after one token until the router aborts it
        body = {"model": MODEL, "prompt": [f"batch {i} " * 3 for i in range(120)],
                "max_tokens": 50}  # more choices than httpx's default pool (100 connections)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up, as in the issue
            httpx.post(s.url + "/v1/completions", json=body, timeout=6.0)
        _wait(lambda: all(w.running == 0 for w in s.router.pool.workers.values()),
              timeout=30, what="every choice of the batch to end")
        _wait(lambda: s.health()["num_workers_healthy"] == 2, timeout=5, what="healthy")
        dec.hang_after = None
        r = _complete(s, "still serving")
        assert r.status_code == 200, r.text
    finally:
        s.close()


def test_exhausted_request_pool_sheds_requests_and_leaves_workers_healthy():
    """The failure of the issue: requests that hold every connection of the router's pool
    starved the health polls (PoolTimeout) and every worker was marked unhealthy for good.
    Streams hold a connection each when they are one per request (``decode_channels`` off, or
    a decode worker without channels); on a decode channel they hold none."""
    s = Stack(num_prefill=1, num_decode=1, api_key=None, max_connections=3,
              pool_timeout_s=0.3, poll_timeout_s=0.2, unhealthy_after=2, max_queued=64,
              decode_channels=False)
    holders: list[_Holder] = []
    try:
        (dec, _), = s.decode
        dec.hang_after = 1  # streams stall after one token until the router aborts them
        for i in range(3):  # one connection each to the decode worker: the pool is full
            holders.append(_Holder(s.url, f"hold {i} " * 4))
            assert holders[-1].status == 200
        shed = []
        for i in range(3):  # no connection within pool_timeout_s: shed, no worker blamed
            r = _complete(s, f"starved {i}")
            assert r.status_code == 503, r.text
            assert r.headers.get("retry-after") == "1"
            assert r.json()["error"]["code"] == "overloaded"
            shed.append(r)
        for _ in range(10):  # many poll timeouts later, the polls still answer
            h = s.health()
            assert h["num_workers_healthy"] == 2, h
            time.sleep(0.05)
        for w in s.router.pool.workers.values():
            assert w.breaker.current_state == "closed" and w.available
    finally:
        for h in holders:
            h.close()
    try:
        _wait(lambda: all(w.running == 0 for w in s.router.pool.workers.values()),
              what="the held streams to be aborted")
        dec.hang_after = None
        r = _complete(s, "after the storm")
        assert r.status_code == 200, r.text
    finally:
        s.close()


def test_hung_worker_leaves_placement_waiting_requests_end_at_the_deadline_and_it_rejoins():
    s = Stack(num_prefill=2, num_decode=1, api_key=None, poll_timeout_s=0.2,
              unhealthy_after=2, deadline_s=1.0, timeout_s=600.0)
    try:
        (a, _), (b, _) = s.prefill
        for i in range(4):
            assert _complete(s, f"warm {i} " * 6).status_code == 200
        # placement may have sent every warm request to b (its tie-break hashes the worker
        # URLs, new ports each run): give a cache of its own so its index has something
        a.cm.run_prefill(9_000, list(range(300, 380)))
        _wait(lambda: s.router.pool.index.num_blocks(a.url) > 0, what="a's blocks indexed")
        a.stalled = True  # a hangs: answers nothing, polls included
        a_url = a.url
        # Requests placed on a before it is found out give up at deadline_s (1 s), not at the
        # call timeout (600 s): the client's 20 s timeout would fire first otherwise.
        outcomes = [_complete(s, f"during {i} " * 6).status_code for i in range(3)]
        assert all(c in (200, 503) for c in outcomes), outcomes
        _wait(lambda: not s.router.pool.workers[a_url].healthy, what="a marked unhealthy")
        assert s.health()["num_prefill_healthy"] == 1
        n_b = len(b.prefills)
        for i in range(4):  # placement skips a
            r = _complete(s, f"after {i} " * 6)
            assert r.status_code == 200, r.text
        assert len(b.prefills) == n_b + 4
        for i in range(3):  # a gets more cache while it is out of the router's sight
            a.cm.run_prefill(10_000 + i, list(range(40 + i * 40, 120 + i * 40)))
        a.stalled = False
        # back in placement: polls and liveness probe answer (and its breaker, opened by the
        # calls that gave up on it, lets a trial through after breaker_reset_s)
        _wait(lambda: s.router.pool.workers[a_url].available, what="a available again")
        want = CacheState.model_validate(a.cm.cache_state())
        _wait(lambda: s.router.pool.index.num_blocks(a_url) == len(want.blocks),
              what="a's index resynced")
        assert s.health()["num_prefill_healthy"] == 2
    finally:
        s.close()


def test_failing_worker_opens_its_breaker_and_closes_after_a_good_trial():
    s = Stack(num_prefill=2, num_decode=1, api_key=None, breaker_fail_max=2,
              breaker_reset_s=60.0, policy="round_robin")
    try:
        (a, _), _ = s.prefill
        a.fail_prefill = 1000  # a's polls answer, its prefills fail (503, not "busy")
        for i in range(8):
            r = _complete(s, f"br {i} " * 5)
            assert r.status_code == 200, r.text  # failed over to b
        wa = s.router.pool.workers[a.url]
        failures = 1000 - a.fail_prefill
        assert failures == 2, failures  # the breaker opened after breaker_fail_max
        assert wa.healthy and wa.breaker.current_state == "open" and not wa.available
        h = s.health()
        assert h["num_prefill_healthy"] == 1
        # the per-worker flag is the same "in placement" as the counts (it said true here)
        assert {w["url"]: w["healthy"] for w in h["workers"]}[a.url] is False
        a.fail_prefill = 0
        wa.breaker.reset_timeout = 0.2  # (instead of waiting a minute)
        time.sleep(0.3)  # past the reset timeout: the next request may try a again
        n_a = len(a.prefills)
        for i in range(6):
            assert _complete(s, f"again {i} " * 5).status_code == 200
        assert wa.breaker.current_state == "closed" and len(a.prefills) > n_a
    finally:
        s.close()


@pytest.mark.parametrize("death", ["stopped", "hung"])
def test_max_model_len_is_the_minimum_over_available_workers(death):
    s = Stack(num_prefill=1, num_decode=1, api_key=None, poll_timeout_s=0.2,
              unhealthy_after=2)
    short, srv = start_worker("decode", TOKEN)
    try:
        short.max_model_len = 64
        r = httpx.post(s.url + "/internal/register", json={"url": short.url},
                       headers={CLUSTER_TOKEN_HEADER: TOKEN})
        assert r.status_code == 200, r.text
        card = httpx.get(s.url + f"/v1/models/{MODEL}").json()
        assert card["max_model_len"] == 64
        r = _complete(s, "x" * 70, max_tokens=8)
        assert r.status_code == 400, r.text  # past the short worker's length
        if death == "stopped":
            srv.stop()
        else:
            short.stalled = True
        _wait(lambda: not s.router.pool.workers[short.url].healthy, what="short one out")
        card = httpx.get(s.url + f"/v1/models/{MODEL}").json()
        assert card["max_model_len"] == 4096
        r = _complete(s, "x" * 70, max_tokens=8)
        assert r.status_code == 200, r.text
    finally:
        short.stalled = False
        srv.stop()
        s.close()


def test_a_busy_prefill_worker_is_passed_over_and_all_busy_is_503_with_retry_after():
    """A worker whose bounded queue is full answers 503 ``busy`` + ``Retry-After``
    (worker/http.py): the router places the request on another worker without blaming the
    busy one; when every prefill worker is busy the client gets 503 + ``Retry-After``."""
    s = Stack(num_prefill=2, num_decode=1, api_key=None, policy="round_robin")
    try:
        (a, _), (b, _) = s.prefill
        a.busy_prefills = 1000
        for i in range(4):
            r = _complete(s, f"busy {i} " * 4)
            assert r.status_code == 200, r.text
        assert len(b.prefills) == 4 and not a.prefills
        wa = s.router.pool.workers[a.url]
        assert wa.available and wa.breaker.current_state == "closed"  # busy, not failed
        b.busy_prefills = 1000
        r = _complete(s, "all busy")
        assert r.status_code == 503, r.text
        assert r.headers.get("retry-after") == "1"
        assert r.json()["error"]["code"] == "overloaded"
        a.busy_prefills = b.busy_prefills = 0
        assert _complete(s, "room again").status_code == 200
    finally:
        s.close()


def test_a_400_from_a_worker_before_token_1_is_passed_through_and_not_retried():
    """A deterministic refusal (400 ``invalid_request``) is not placed again on other workers
    (it used to be tried up to 3 times and answered 503): the client gets the 400 once."""
    s = Stack(num_prefill=2, num_decode=1, api_key=None, policy="round_robin")
    try:
        (a, _), (b, _) = s.prefill
        a.invalid_prefills = b.invalid_prefills = 10
        r = _complete(s, "refused " * 4)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_request" and "bad token" in err["message"], err
        assert a.invalid_prefills + b.invalid_prefills == 19  # one worker asked, once
        (d, _), = s.decode
        _wait(lambda: len(d.aborted) >= 1, what="the reservation on D aborted")
        for w in s.router.pool.workers.values():
            assert w.available and w.breaker.current_state == "closed"
    finally:
        s.close()


def test_pairing_failures_do_not_open_the_prefill_workers_breaker():
    """A 502 ``transfer_pairing_failed`` is the decode peer's failure (its bootstrap is dead):
    it must not count against the prefill worker. A new user's kill -9 of one of two decode
    workers opened the only prefill worker's breaker this way and in-flight requests got 503
    "no healthy prefill worker"."""
    s = Stack(num_prefill=1, num_decode=2, api_key=None, policy="round_robin")
    try:
        (a, _), = s.prefill
        a.pairing_failures = 4  # more than the breaker's 3 failures in a row
        for i in range(4):
            r = _complete(s, f"pair {i} " * 4)
            assert r.status_code == 200, r.text  # re-placed until the pairing succeeds
        assert a.pairing_failures == 0
        P = s.router.pool.workers[a.url]
        assert P.available and P.breaker.current_state == "closed"
    finally:
        s.close()


def test_migrated_choice_counts_running_and_itl_on_the_worker_that_serves_it():
    """After a migration the running gauge and the ITL histogram follow the new decode worker
    (router/migrate.py ``ServedBy``; they kept the first worker's label before)."""
    import asyncio
    from contextlib import ExitStack
    from types import SimpleNamespace

    from k3serve.messages import PrefillResponse, StreamEvent
    from k3serve.sampling import SamplingParams
    from router.metrics import RouterMetrics
    from router.placement import Placement
    from router.stream import END, Placed, stream_choice
    from router.workers import WorkerError

    def worker(name: str):
        return SimpleNamespace(url=f"http://{name}", name=name,
                               info=SimpleNamespace(max_model_len=4096))

    P, D0, D1 = worker("p0"), worker("d0"), worker("d1")
    metrics = RouterMetrics()
    seen: dict[str, float] = {}

    def running(name: str) -> float:
        return metrics.running.labels(name)._value.get()

    class Pool:
        async def relay(self, w, body, handle):
            if w is D0:
                for t in (11, 12):
                    if handle([StreamEvent(token_ids=[t])]):
                        return
                seen["d0 while streaming"] = running("d0")
                raise WorkerError(w.url, "stream: killed")
            seen["d0 after migration"], seen["d1 after migration"] = running("d0"), running("d1")
            for t in (13, 14):
                if handle([StreamEvent(token_ids=[t])]):
                    return
            handle([StreamEvent(token_ids=[15], finish_reason="length")])

    async def resume(failed, tokens, lps, k):
        return D1, "sub-m1"

    async def go() -> list:
        out: asyncio.Queue = asyncio.Queue()
        c = Placed("sub", Placement("http://p0", "http://d0", 0), P, D0,
                   PrefillResponse(request_id="sub", token_id=10, position=4, seed=0),
                   ExitStack())
        await stream_choice(c, 4, 0, SamplingParams(max_tokens=6, ignore_eos=True), out,
                            Pool(), metrics, lambda w, s: None, resume=resume)
        items = []
        while not out.empty():
            items.append(out.get_nowait())
        return items

    items = asyncio.run(go())
    assert [t for d in items if d is not END for t in d.token_ids] == [10, 11, 12, 13, 14, 15]
    assert seen == {"d0 while streaming": 1, "d0 after migration": 0, "d1 after migration": 1}
    assert running("d0") == running("d1") == 0

    def itl_count(name: str) -> float:
        return sum(s.value for fam in metrics.itl.collect() for s in fam.samples
                   if s.name.endswith("_count") and s.labels.get("worker") == name)

    assert (itl_count("d0"), itl_count("d1")) == (2, 3)


def test_a_pd_stack_whose_last_prefill_worker_deregistered_stays_pd():
    """Draining the only prefill worker (it deregisters) must not turn the stack monolithic
    (the decode workers prefilling while /health says ok with 0 prefill workers): /health is
    503 and a request gets 503 with Retry-After until a prefill worker registers again."""
    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    try:
        (a, _), = s.prefill
        assert _complete(s, "before drain " * 3).status_code == 200
        r = httpx.post(s.url + "/internal/deregister", json={"url": a.url},
                       headers={CLUSTER_TOKEN_HEADER: TOKEN})
        assert r.status_code == 200, r.text
        assert httpx.get(s.url + "/health").status_code == 503
        r = _complete(s, "after drain " * 3)
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text
        r = httpx.post(s.url + "/internal/register", json={"url": a.url},
                       headers={CLUSTER_TOKEN_HEADER: TOKEN})
        assert r.status_code == 200, r.text
        _wait(lambda: httpx.get(s.url + "/health").status_code == 200, what="PD again")
        assert _complete(s, "after return " * 3).status_code == 200
    finally:
        s.close()
