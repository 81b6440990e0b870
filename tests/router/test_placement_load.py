"""The router's recent-load account (``util``, ``request_rate``) and the live router feeding it
to placement: one :class:`router.policies.load.RecentLoad` per worker, moved by
``Worker.load`` when a prefill is sent, decaying by itself, read by ``Router.place`` into the
views every policy gets (the simulator uses the same class; tests/simulate)."""

from __future__ import annotations

import asyncio
import math

import pytest

from deploy.fake_workers import FINGERPRINT, MODEL
from k3serve.messages import Capacity, WorkerInfo
from router.config import RouterConfig
from router.pipeline import Router
from router.placement import PlacementRequest
from router.policies import WorkerView
from router.policies.home import HomeParams, prefix_home
from router.policies.load import RecentLoad
from router.policies.table import DEFAULT_POLICY, POLICIES
from router.workers import Worker

H = 10.0  # the account's horizon (HomeParams.util_horizon_s's default)
RATE = 1000.0  # prefill tokens/s the fake workers report


class Clock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_recent_load_moves_with_sends_and_decays():
    clk = Clock()
    r = RecentLoad(H, clk)
    assert r.util(RATE) == 0 and r.request_rate() == 0
    r.add(4000)
    r.add(6000)
    assert r.util(RATE) == pytest.approx(10_000 / (RATE * H))  # 1.0: 10 s of work per 10 s
    assert r.request_rate() == pytest.approx(2 / H)
    clk.t += H
    assert r.util(RATE) == pytest.approx(math.exp(-1))
    assert r.request_rate() == pytest.approx(2 / H * math.exp(-1))
    clk.t -= 5  # a clock read out of order never grows the account
    assert r.util(RATE) == pytest.approx(math.exp(-1))
    # steady sending converges to the real busy fraction and rate: 5 requests/s of 100 tokens
    s = RecentLoad(H, clk)
    for _ in range(5 * 60):  # 60 s ≫ H
        clk.t += 0.2
        s.add(100)
    assert s.util(RATE) == pytest.approx(500 / RATE, rel=0.05)
    assert s.request_rate() == pytest.approx(5.0, rel=0.05)
    with pytest.raises(ValueError, match="horizon_s"):
        RecentLoad(0)


def _router(policy: str, clk: Clock) -> Router:
    """A router with two prefill workers and one decode worker entered by hand (no HTTP:
    ``place`` reads only the pool's workers and index)."""
    r = Router(RouterConfig(model=MODEL, policy=policy))
    for role, url in (("prefill", "http://p0"), ("prefill", "http://p1"), ("decode", "http://d0")):
        info = WorkerInfo(role=role, model=MODEL, fingerprint=FINGERPRINT, block_size=16,
                          capacity=Capacity(num_pages=256, num_slots=8, num_snapshots=16),
                          prefill_rate=RATE)
        w = Worker(url, info)
        w.recent.clock = clk
        r.pool.workers[url] = w
        r.pool.index.add_worker(url)
    return r


def test_live_router_feeds_util_and_request_rate_to_placement():
    assert RouterConfig().policy == DEFAULT_POLICY == "prefix_home"
    seen: list[list[WorkerView]] = []

    def record(req, workers, params):
        seen.append(list(workers))
        return prefix_home(req, workers, params)

    POLICIES["_record"] = record
    clk = Clock()
    router = _router("_record", clk)
    try:
        ids = list(range(1, 161))  # 10 blocks, cold everywhere
        p, P, _ = router.place(ids, None, 4)
        assert [(v.util, v.request_rate) for v in seen[-1]] == [(0.0, 0.0), (0.0, 0.0)]
        # what the pipeline does with the choice: hold the prefill's load while it runs
        uncached = len(ids) - p.predicted_cached_tokens
        with P.load(queued_tokens=uncached):
            router.place(ids, None, 4)
            v = {w.worker_id: w for w in seen[-1]}
            assert v[P.url].queued_tokens == uncached
        assert P.queued_tokens == 0  # the queue empties when the answer is in ...
        router.place(ids, None, 4)
        v = {w.worker_id: w for w in seen[-1]}
        other = next(u for u in v if u != P.url)
        # ... the recent account does not: it decays
        assert v[P.url].util == pytest.approx(uncached / (RATE * H))
        assert v[P.url].request_rate == pytest.approx(1 / H)
        assert (v[other].util, v[other].request_rate) == (0.0, 0.0)
        clk.t += H
        router.place(ids, None, 4)
        v = {w.worker_id: w for w in seen[-1]}
        assert v[P.url].util == pytest.approx(uncached / (RATE * H) * math.exp(-1))
        assert v[P.url].request_rate == pytest.approx(math.exp(-1) / H)
    finally:
        POLICIES.pop("_record", None)
        asyncio.run(router.close())


def test_default_policy_spreads_cold_work_by_recent_load():
    """Queues empty on both workers (every prefill answered at once): only the recent account
    tells them apart, and the default policy sends cold prompts to the one that did less
    lately until the two accounts meet, then alternates."""
    clk = Clock()
    router = _router(DEFAULT_POLICY, clk)
    try:
        ids = list(range(1, 161))
        for _ in range(20):  # p0 prefilled 20 cold prompts just now
            with router.pool.workers["http://p0"].load(queued_tokens=len(ids)):
                pass
        got = []
        for k in range(40):  # distinct prompts (a repeat would be a pending hit where it went)
            ids = list(range(1 + 200 * k, 161 + 200 * k))
            p, P, _ = router.place(ids, None, 4)
            with P.load(queued_tokens=len(ids) - p.predicted_cached_tokens):
                got.append(P.url)
        assert got[:18] == ["http://p1"] * 18
        assert abs(20 + got.count("http://p0") - got.count("http://p1")) <= 2
    finally:
        asyncio.run(router.close())


def test_default_policy_keeps_a_repeat_at_home_on_an_idle_pool():
    """The new-user failure: one prompt prefilled on p1 a moment ago, the same prompt again on
    an otherwise idle pool. p1 holds 41 of its 42 blocks; its recent account is all the pool
    has done, so relative to the mean it is 'over its share' — but at a busy fraction far below
    ``balance_floor`` that must cost nothing: the repeat goes home (it went to p0 and missed
    before the floor)."""
    clk = Clock()
    r0, r1 = RecentLoad(H, clk), RecentLoad(H, clk)
    r1.add(168)
    clk.t += 0.1
    views = [WorkerView("p0", 0, 0, 0, 10_000.0, util=r0.util(10_000.0),
                        request_rate=r0.request_rate()),
             WorkerView("p1", 41, 41, 0, 10_000.0, util=r1.util(10_000.0),
                        request_rate=r1.request_rate())]
    req = PlacementRequest(168, 4, seq=0, max_new_tokens=16)
    assert views[1].util > 0 and views[0].util == 0
    assert prefix_home(req, views, HomeParams()) == 1
    # the floor is what keeps it there: without it the bound is relative only and it moves
    assert prefix_home(req, views, HomeParams(balance_floor=0.0)) == 0
    # a truly busy home still spills cold-ish work (the bound applies above the floor)
    r1.add(10 * 10_000 * H)
    busy = [views[0], WorkerView("p1", 1, 1, 0, 10_000.0, util=r1.util(10_000.0),
                                 request_rate=r1.request_rate())]
    assert prefix_home(req, busy, HomeParams()) == 0
