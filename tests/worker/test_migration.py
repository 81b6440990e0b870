"""Request migration and re-placement against a live stack (issue 15, part B).

One stack for the module — router + 2 prefill + 2 decode worker processes (k3-tiny, loopback,
``deploy.launcher.start_stack``), with 10 % of the transfers failing, 10 % hanging and 10 %
failing to pair (``K3SERVE_KV_FAULT_FAIL_FRACTION`` / ``_HANG_FRACTION`` / ``_PAIR_FRACTION``,
short deadlines). The tests run in file order:

0. the injected faults lose no request: every failed or hung transfer is recomputed by the
   decode worker (``k3serve:kv_transfer_fallbacks_total``), the hung ones expire on both sides
   (``k3serve:kv_transfer_expiries_total``), and the requests whose prefill worker answered
   502 ``transfer_pairing_failed`` are placed again. While the fault-free baseline runs (the
   engine threads busy on the CPU) every worker stays in placement.
1. SIGSTOP of a prefill worker mid-load: its liveness probes (``GET /health``, answered
   without the engine thread) go unanswered and the router takes it out of placement within
   seconds (the cache-event polls keep their 10 s timeout); requests waiting on it give up at
   ``--deadline`` and are placed again; SIGCONT: it rejoins, its index resynced.
2. kill -9 of a decode worker while ``N_STREAMS`` (50) streaming requests run: every stream
   completes and its text equals the same request run before the fault (greedy, and seeded
   sampling with presence / frequency / repetition penalties): nothing duplicated or skipped.
   The router moved the streams of the dead worker (``k3serve:router_migrations_total``) and
   the surviving decode worker resumed them (``k3serve:requests_resumed_total``).
3. kill -9 of a prefill worker mid-load: every request completes (those in flight on it are
   placed again on the other prefill worker), with the texts of the fault-free runs; the
   surviving decode worker frees every slot, page and ticket of the orphans.

On main before this change: (0) there is no fault injection nor expiry counter, and a 502
``transfer_pairing_failed`` reaches the client as a 503; (1) the dead worker's streams end with an SSE error and no
``finish_reason``; (2) the requests in flight on the dead prefill worker get 503 (not placed
again) and their decode reservations stay held for the sender's quiesce window (~50 s).

Streams of ≤ 32 tokens; the faults other than the decode kill use the first ``N_LOAD``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

B = 16
KEY = "sk-migr"
AUTH = {"Authorization": f"Bearer {KEY}"}  # the router's /metrics, /health?detail=1
MODEL = "k3-tiny"
N_STREAMS = 50  # must-show 1: the kill -9 of a decode worker
N_LOAD = 16  # the other faults' load (the first N_LOAD requests)
MAX_TOKENS = 32
AUTH = {"Authorization": f"Bearer {KEY}"}
# launcher order: router, prefill-0, prefill-1, decode-0, decode-1
PREFILL0, DECODE0, DECODE1 = 1, 3, 4


#: seconds a call waits on a worker out of placement (the router's ``--deadline``); the
#: cache-event polls keep their default 10 s timeout: only the liveness probe (GET /health,
#: answered without the engine thread) takes a stopped worker out of placement quickly
DEADLINE_S = 3
#: the router's view must show a stopped worker gone within this (the polls alone: ≥ 30 s)
OUT_WITHIN_S = 15

#: the workers' environment: injected faults, deadlines short enough for a test
FAULT_ENV = {"K3SERVE_KV_FAULT_FAIL_FRACTION": "0.1", "K3SERVE_KV_FAULT_HANG_FRACTION": "0.1",
             "K3SERVE_KV_FAULT_PAIR_FRACTION": "0.1",
             "K3SERVE_KV_RECEIVER_TIMEOUT_S": "5", "K3SERVE_KV_SENDER_TIMEOUT_S": "10"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from deploy.launcher import start_stack

    logs = tmp_path_factory.mktemp("migration-logs")
    saved = {k: os.environ.get(k) for k in FAULT_ENV}
    os.environ.update(FAULT_ENV)  # the children inherit it
    try:
        st = start_stack(model=MODEL, num_prefill=2, num_decode=2, api_key=KEY, block_size=B,
                         log_dir=str(logs), ready_timeout=180,
                         extra_router_args=["--deadline", str(DEADLINE_S)])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    st.log_dir = logs
    try:
        yield st
    finally:
        st.stop()


def body(i: int) -> dict:
    """Request ``i``: greedy when even, seeded sampling with every penalty when odd."""
    b = {"model": MODEL, "prompt": f"request {i}: the story of a small {'red blue'[i % 2 * 4:]} "
                                   f"fox who", "max_tokens": MAX_TOKENS}
    if i % 2:
        b.update(temperature=0.9, top_p=0.95, seed=1000 + i, presence_penalty=0.6,
                 frequency_penalty=0.4, repetition_penalty=1.3)
    else:
        b.update(temperature=0.0)
    return b


async def stream(c: httpx.AsyncClient, url: str, b: dict, started: asyncio.Event | None = None
                 ) -> tuple[str, str | None, int]:
    """One streaming completion: (text, finish_reason, completion tokens); ``started`` is set
    once the text has 8 characters (the stream is mid-way) or the stream finished."""
    text, finish, ntok = "", None, 0
    async with c.stream("POST", url + "/v1/completions", headers=AUTH,
                        json={**b, "stream": True,
                              "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, (await r.aread())[:300]
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            assert "error" not in ev, ev
            if ev.get("usage"):
                ntok = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices") or ():
                text += ch.get("text") or ""
                finish = ch.get("finish_reason") or finish
                if started is not None and (len(text) >= 8 or finish):
                    started.set()  # several tokens in
    return text, finish, ntok


def run_all(url: str, bodies: list[dict], during=None) -> list[tuple[str, str | None, int]]:
    """Stream every body at once; ``during(started_events)`` runs alongside (the fault)."""
    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            started = [asyncio.Event() for _ in bodies]
            tasks = [asyncio.create_task(stream(c, url, b, s)) for b, s in zip(bodies, started)]
            if during is not None:
                await during(started)
            return await asyncio.gather(*tasks)
    return asyncio.run(go())


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " "))
               and all(w in line.split("}", 1)[0] for w in want))


def usage(stack, url: str) -> dict:
    h = {"X-K3serve-Cluster-Token": stack.cluster_token}
    return httpx.get(url + "/internal/info", headers=h, timeout=10).json()["usage"]


def router_health(url: str) -> dict:
    return httpx.get(url + "/health", params={"detail": 1}, headers=AUTH, timeout=10).json()


async def watch_health(url: str, seen: list[bool], stop: asyncio.Event) -> None:
    """Record, while ``stop`` is unset, whether every worker's polls answer (the router's
    ``healthy``; an open breaker — the injected faults open one now and then — is another
    matter)."""
    async with httpx.AsyncClient(timeout=10) as c:
        while not stop.is_set():
            ws = (await c.get(url + "/health", params={"detail": 1},
                              headers=AUTH)).json()["workers"]
            seen.append(len(ws) == 4 and all(w["healthy"] for w in ws))
            await asyncio.sleep(0.1)


def liveness_misses(stack) -> list[str]:
    """The router's log lines of a worker taken out of placement (liveness or polls)."""
    text = (stack.log_dir / "router.log").read_text(errors="replace")
    return [ln for ln in text.splitlines()
            if "liveness probes in a row" in ln or "unhealthy after" in ln]


@pytest.fixture(scope="module")
def baseline(stack):
    """Every request's (text, finish, tokens) without a fault, streamed concurrently; every
    worker (engine threads busy on the CPU) stays in placement all the while."""
    bodies = [body(i) for i in range(N_STREAMS)]
    low: list[bool] = []

    async def go():
        stop = asyncio.Event()
        w = asyncio.create_task(watch_health(stack.url, low, stop))
        async with httpx.AsyncClient(timeout=120) as c:
            got = await asyncio.gather(*(stream(c, stack.url, b) for b in bodies))
        stop.set()
        await w
        return got

    got = asyncio.run(go())
    assert low and all(low), low  # a busy worker is not a hung one
    assert liveness_misses(stack) == []
    return got


def test_injected_transfer_faults_lose_no_request(stack, baseline):
    assert all(f in ("stop", "length") for _, f, _ in baseline)  # every request completed
    assert sum(n for *_, n in baseline) > N_STREAMS * 4  # streams long enough to cut
    prefill, decode = stack.worker_urls[:2], stack.worker_urls[2:]
    fails = sum(metric(u, "k3serve:kv_faults_injected_total", kind="fail") for u in prefill)
    hangs = sum(metric(u, "k3serve:kv_faults_injected_total", kind="hang") for u in prefill)
    pairs = sum(metric(u, "k3serve:kv_faults_injected_total", kind="pair") for u in prefill)
    # ≥ 16 transfers over 2 workers: the 2nd, 5th and 8th of a worker get a fault
    assert fails >= 1 and hangs >= 1 and pairs >= 1
    fallbacks = sum(metric(u, "k3serve:kv_transfer_fallbacks_total") for u in decode)
    assert fallbacks >= fails + hangs  # every faulty transfer was recomputed by decode
    # each hung transfer expired on the decode side (ticket) and on the prefill side (sender)
    assert sum(metric(u, "k3serve:kv_transfer_expiries_total") for u in decode) >= hangs
    t_end = time.monotonic() + 30  # the senders' deadline (10 s) is later than the tickets'
    while sum(metric(u, "k3serve:kv_transfer_expiries_total") for u in prefill) < hangs:
        assert time.monotonic() < t_end, "a hung sender did not expire"
        time.sleep(0.3)


def test_a_stopped_prefill_worker_leaves_placement_within_seconds_and_rejoins(stack, baseline):
    """SIGSTOP of prefill-0 mid-load (alive, answering nothing): its liveness probes go
    unanswered and the router takes it out of placement within seconds (its cache-event polls,
    10 s each, would take ≥ 30 s); the requests waiting on it give up at ``--deadline`` and are
    placed again — every stream completes with its fault-free text. SIGCONT: it rejoins and
    the router's index of it is resynced from its events."""
    victim, url = stack.procs[PREFILL0], stack.worker_urls[PREFILL0 - 1]
    seen: dict[str, float] = {}

    async def stop(started: list[asyncio.Event]) -> None:
        t_end = time.monotonic() + 60
        while sum(s.is_set() for s in started) < len(started) // 4:
            assert time.monotonic() < t_end, "the streams did not start"
            await asyncio.sleep(0.005)
        os.kill(victim.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=10) as c:
            while (await c.get(stack.url + "/health")).json()["num_prefill_healthy"] != 1:
                assert time.monotonic() - t0 < OUT_WITHIN_S, "the stopped worker stayed in"
                await asyncio.sleep(0.1)
        seen["out"] = time.monotonic() - t0

    try:
        got = run_all(stack.url, [body(i) for i in range(N_LOAD)], stop)
        assert "out" in seen
        for i, (want, have) in enumerate(zip(baseline, got)):
            assert have == want, (i, body(i), want, have)
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    h = {"X-K3serve-Cluster-Token": stack.cluster_token}
    t_end = time.monotonic() + 60
    while True:  # back in placement, its index equal to its cache (resynced from its events)
        r = router_health(stack.url)
        mine = next(w for w in r["workers"] if w["url"] == url)
        blocks = len(httpx.get(url + "/internal/cache_state", headers=h,
                               timeout=10).json()["blocks"])
        if r["num_prefill_healthy"] == 2 and mine["blocks"] == blocks > 0:
            break
        assert time.monotonic() < t_end, (r, blocks)
        time.sleep(0.2)
    assert httpx.post(stack.url + "/v1/completions", headers=AUTH, timeout=60,
                      json=body(0)).status_code == 200
    # what the router gave up on while it was stopped ends there too: nothing left held
    t_end = time.monotonic() + 60
    while (u := usage(stack, url))["slots_used"] or u["num_engine_requests"]:
        assert time.monotonic() < t_end, u
        time.sleep(0.3)


def test_kill_decode_mid_stream_migrates_every_stream(stack, baseline):
    victim = stack.procs[DECODE0]
    survivor = stack.worker_urls[DECODE1 - 1]
    resumed0 = metric(survivor, "k3serve:requests_resumed_total")

    async def kill(started: list[asyncio.Event]) -> None:
        """Kill decode-0 once half the streams are mid-way: others are between token #1 and
        their stream, or not yet reserved."""
        t_end = time.monotonic() + 60
        while sum(s.is_set() for s in started) < len(started) // 2:
            assert time.monotonic() < t_end, "the streams did not start"
            await asyncio.sleep(0.005)
        os.kill(victim.pid, signal.SIGKILL)

    got = run_all(stack.url, [body(i) for i in range(N_STREAMS)], kill)
    assert victim.wait(10) is not None
    for i, (want, have) in enumerate(zip(baseline, got)):
        assert have == want, (i, body(i), want, have)
    migrated = metric(stack.url, "k3serve:router_migrations_total")
    assert migrated >= 1  # some streams were on the killed worker mid-way
    assert metric(survivor, "k3serve:requests_resumed_total") - resumed0 == migrated


def test_kill_prefill_mid_load_loses_no_request(stack, baseline):
    victim, url = stack.procs[PREFILL0], stack.worker_urls[PREFILL0 - 1]
    h = {"X-K3serve-Cluster-Token": stack.cluster_token}

    async def kill(started: list[asyncio.Event]) -> None:
        """Kill prefill-0 while one of its senders is paired with a decode worker (the
        reservation there cannot be reused until that sender is known to have stopped)."""
        async with httpx.AsyncClient(timeout=10, headers=h) as c:
            t_end = time.monotonic() + 30
            while not any(r.get("sender_state") in ("WAITING_FOR_INPUT", "TRANSFERRING")
                          for r in (await c.get(url + "/internal/requests")).json()[
                              "requests"].values()):
                assert time.monotonic() < t_end, "no transfer started at prefill-0"
                await asyncio.sleep(0.002)
        os.kill(victim.pid, signal.SIGKILL)

    got = run_all(stack.url, [body(i) for i in range(N_LOAD)], kill)
    assert victim.wait(10) is not None
    for i, (want, have) in enumerate(zip(baseline, got)):
        assert have == want, (i, body(i), want, have)
    # the orphans' reservations on the decode worker are freed once their sender is seen
    # dead, well before its announced quiesce time (sender timeout 10 s + 2 × 10 s)
    survivor = stack.worker_urls[DECODE1 - 1]
    t_end = time.monotonic() + 15
    while True:
        u = usage(stack, survivor)
        if not (u["slots_used"] or u["num_engine_requests"] or u["open_tickets"]
                or u["unreleased_tickets"]):
            break
        assert time.monotonic() < t_end, (u, httpx.get(survivor + "/internal/requests",
                                                       headers=h, timeout=10).json())
        time.sleep(0.3)
