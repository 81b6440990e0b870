"""The pieces that carry measured rates and recent placements into the live router's placement:
the worker's :class:`worker.loop.PrefillMeter` and ``WorkerLoad.prefill_rate``, the router's
``Worker.measured_rate``, :func:`router.choose.choose` with the pool's
:class:`router.recent.RecentPlacements`, the registry's forget hook, and ``k3serve serve``'s
store default."""

from __future__ import annotations

import asyncio
import math

import pytest
from pydantic import ValidationError

from deploy.fake_workers import FINGERPRINT, MODEL
from k3serve.messages import Capacity, WorkerInfo, WorkerLoad
from router.choose import choose
from router.config import RouterConfig
from router.pipeline import Router
from router.policies.table import POLICIES
from router.recent import RecentPlacements
from router.workers import Worker
from worker.loop import PrefillMeter

B = 16


def test_prefill_meter_counts_prefill_steps_over_its_window():
    m = PrefillMeter(window=2)
    assert m.rate is None
    m.add(0, 0.5)  # a decode-only step: not counted
    assert m.rate is None
    m.add(300, 1.0)
    m.add(100, 1.0)
    assert m.rate == pytest.approx(200.0)
    m.add(900, 1.0)  # the first step leaves the window
    assert m.rate == pytest.approx(500.0)
    with pytest.raises(ValueError, match="window"):
        PrefillMeter(0)


def test_worker_load_carries_a_positive_prefill_rate():
    assert WorkerLoad().prefill_rate is None
    assert WorkerLoad(prefill_rate=612.5).prefill_rate == 612.5
    with pytest.raises(ValidationError):
        WorkerLoad(prefill_rate=0)
    w = Worker("http://p", _info("prefill"))
    assert w.measured_rate == 0.0
    w.report(WorkerLoad(prefill_rate=612.5))
    assert w.measured_rate == 612.5


def _info(role: str) -> WorkerInfo:
    return WorkerInfo(role=role, model=MODEL, fingerprint=FINGERPRINT, block_size=B,
                      capacity=Capacity(num_pages=512, num_slots=8, num_snapshots=16))


def _router() -> Router:
    r = Router(RouterConfig(model=MODEL))
    for role, url in (("prefill", "http://p0"), ("prefill", "http://p1"), ("decode", "http://d0")):
        r.pool.workers[url] = Worker(url, _info(role))
        r.pool.index.add_worker(url)
    return r


def test_choose_records_the_prompt_and_the_next_extension_meets_it():
    """P placed, no cache event yet: P + a few tokens is priced as a hit where P went."""
    router = _router()
    try:
        ids = list(range(1, 3 * 64 + 2))
        p, P, _ = router.place(ids, None, 4)
        assert p.predicted_cached_tokens == 0 and len(router.pool.recent) == 1
        q, Q, _ = router.place([*ids, 7], None, 4)
        assert Q is P
        assert q.predicted_cached_tokens == (len(ids) - 1) // B * B
    finally:
        asyncio.run(router.close())


def test_choose_prices_the_queue_at_the_measured_rate():
    """The measured rate, not the static --prefill-rate, reaches the views."""
    seen = []

    def record(req, workers, params):
        seen.append(list(workers))
        return 0

    POLICIES["_rec"] = record
    router = _router()
    try:
        router.pool.workers["http://p0"].report(WorkerLoad(prefill_rate=250.0))
        wl = list(router.pool.workers.values())
        choose(router.pool.index, (FINGERPRINT, B), wl[:2], wl[2:], list(range(1, 100)), None,
               4, 0, "_rec", router.config.placement, 10_000.0, RecentPlacements())
        v = {w.worker_id: w for w in seen[-1]}
        assert v["http://p0"].rate == 250.0 and v["http://p1"].rate == 10_000.0
    finally:
        POLICIES.pop("_rec", None)
        asyncio.run(router.close())


def test_a_removed_worker_is_forgotten():
    router = _router()
    try:
        ids = list(range(1, 200))
        _, P, _ = router.place(ids, None, 4)
        rec = router.pool.recent
        assert P.url in rec.match(_hashes(ids))
        router.registry.remove(P.url)
        assert rec.match(_hashes(ids)) == {}
    finally:
        asyncio.run(router.close())


def _hashes(ids: list[int]) -> list[str]:
    from router.preprocess import prompt_hashes

    return prompt_hashes(ids, B, FINGERPRINT, None)


def test_extended_decays_from_the_end_of_the_computation():
    rec = RecentPlacements()
    rec.record("w", ["a", "b"], [2], 1000.0, now=0.0)
    assert rec.extended(["a", "b", "c"], 20.0, 10.0)["w"] == pytest.approx(1000 * math.exp(-2))
    # at 100 tokens/s the prompt was computed until t = 10
    assert rec.extended(["a", "b", "c"], 20.0, 10.0, {"w": 100.0})["w"] == pytest.approx(
        1000 * math.exp(-1))


def test_serve_store_default(monkeypatch, capsys):
    import deploy.local
    from deploy.serve import build_parser, use_store

    p = build_parser()
    assert p.parse_args([]).store is None
    assert p.parse_args(["--store"]).store is True
    assert p.parse_args(["--no-store"]).store is False
    assert use_store(True) is True and use_store(False) is False
    monkeypatch.setattr(deploy.local, "mooncake_master_path", lambda: "/bin/true")
    assert use_store(None) is True

    def missing() -> str:
        raise FileNotFoundError("mooncake_master: not found")

    monkeypatch.setattr(deploy.local, "mooncake_master_path", missing)
    assert use_store(None) is False
    assert "no shared store" in capsys.readouterr().err
    assert use_store(True) is True  # explicit: the launcher's start fails hard
