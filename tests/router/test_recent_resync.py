"""A worker's state loaded anew keeps the router's record of prompts sent to that process.

The launcher reports a stack ready once every worker is listed, which can be while the
router still reads a worker's first ``/internal/cache_state``; a prompt P the client sends
then may be placed on that worker. P's record in :class:`router.recent.RecentPlacements` is
what lets P + 1 character, sent right after P's answer, see that its only work on that
worker was the prefix it reuses; without the record P's work counts as load there and
P + 1 goes to the other worker with 0 tokens cached. A fake worker client holds the state
read open while P is placed, so the order is fixed; clocks are passed explicitly.
"""

from __future__ import annotations

import asyncio
import time

from deploy.fake_workers import FINGERPRINT, MODEL
from k3serve.messages import CacheEvents, Capacity, WorkerInfo, WorkerLoad
from router.choose import choose
from router.policies.home import HomeParams
from router.pool import WorkerPool
from router.preprocess import prompt_hashes
from router.workers import Worker

B = 64
P = list(range(1, 3074))  # 3,073 tokens: 48 full blocks, the prompt end at block 48
P1 = [*P, 7]  # P + one token: the same 48 full blocks
RATE = 1000.0  # measured prefill tokens/s of both workers


class StateReadHeld:
    """The workers' answers to the index sync: cache events of epoch ``epochs[url]`` (none,
    ``last_seq`` 0) and an empty state, whose read waits for :attr:`release` when held."""

    def __init__(self, epochs: dict[str, str]) -> None:
        self.epochs = epochs
        self.asked = asyncio.Event()  # a state read is waiting
        self.release = asyncio.Event()
        self.hold = False

    async def get(self, url: str, path: str, params=None, timeout=None):
        epoch = self.epochs[url]
        if path == "/internal/cache_events":
            return {"epoch": epoch, "last_seq": 0, "events": []}
        assert path == "/internal/cache_state", path
        if self.hold:
            self.asked.set()
            await self.release.wait()
        return {"epoch": epoch, "last_seq": 0, "blocks": [], "snapshots": []}


def _worker(pool: WorkerPool, url: str) -> Worker:
    """A monolithic worker as the registry adds it: listed (placement may use it) before
    its registration's first pull of cache events ran."""
    info = WorkerInfo(role="decode", model=MODEL, fingerprint=FINGERPRINT, block_size=B,
                      capacity=Capacity(num_pages=4096, num_slots=8, num_snapshots=64))
    w = Worker(url, info)
    pool.workers[url] = w
    pool.index.add_worker(url)
    return w


def _p_blocks(epoch: str) -> CacheEvents:
    """The events that report P's 48 blocks and its prompt-end snapshot on a worker."""
    hs = prompt_hashes(P, B, FINGERPRINT, None)
    return CacheEvents(epoch=epoch, last_seq=2, events=[
        {"seq": 1, "type": "stored", "block_hashes": hs},
        {"seq": 2, "type": "stored", "block_hashes": [hs[-1]], "snapshot": True}],
        load=WorkerLoad(prefill_rate=RATE))


def _place(pool: WorkerPool, workers: list[Worker], ids: list[int], now: float):
    return choose(pool.index, (FINGERPRINT, B), workers, [], ids, None, 2, 0, "prefix_home",
                  HomeParams(), 10_000.0, pool.recent, now=now)


def test_p_placed_during_a_workers_first_state_load_keeps_p_plus_one_there():
    async def run() -> None:
        pool = WorkerPool(MODEL, None)
        fake = StateReadHeld({"http://w0": "e0", "http://w1": "e1"})
        pool.index_sync.client = fake
        try:
            w0 = _worker(pool, "http://w0")
            await pool.index_sync.pull(w0)  # registered and synced
            w1 = _worker(pool, "http://w1")  # registering: its first state read is held
            fake.hold = True
            first_load = asyncio.create_task(pool.index_sync.pull(w1))
            await fake.asked.wait()
            t0 = time.monotonic()
            p = _place(pool, [w1], P, t0)  # P arrives meanwhile, on the worker registering
            assert p.prefill == w1.url and p.predicted_cached_tokens == 0
            w1.recent.add(len(P), now=t0)  # what Worker.load counts when P is sent
            fake.release.set()
            await first_load
            assert w1.resyncs == 1  # the first load went through the resync path
            # P computed: its answer's events come in; both workers have measured their rate
            pool.index_sync.absorb(w1, _p_blocks("e1"))
            w0.report(WorkerLoad(prefill_rate=RATE))
            p1 = _place(pool, [w0, w1], P1, t0 + len(P) / RATE + 0.1)
            assert p1.prefill == w1.url, p1
            assert p1.predicted_cached_tokens == 48 * B
            hashes = prompt_hashes(P1, B, FINGERPRINT, None)
            assert w1.url in pool.recent.match(hashes)  # P's record survived the load
        finally:
            await pool.close()

    asyncio.run(run())


def test_a_restart_forgets_only_what_was_sent_to_the_previous_process():
    """A new epoch voids the records sent before the pull that saw it; a prompt placed
    while the new state is read went to the new process and stays recorded. A gap within
    one epoch forgets nothing (the worker kept its cache)."""

    async def run() -> None:
        pool = WorkerPool(MODEL, None)
        fake = StateReadHeld({"http://w1": "e1"})
        pool.index_sync.client = fake
        rec = pool.recent
        try:
            w1 = _worker(pool, "http://w1")
            await pool.index_sync.pull(w1)
            t = time.monotonic()
            rec.record(w1.url, ["a", "b"], [2], 100.0, t - 1.0)  # sent to the old process
            fake.epochs[w1.url] = "e2"  # the worker restarted
            fake.hold = True
            load = asyncio.create_task(pool.index_sync.pull(w1))
            await fake.asked.wait()
            rec.record(w1.url, ["c", "d"], [2], 100.0, time.monotonic())  # to the new one
            fake.release.set()
            await load
            assert pool.index.cursor(w1.url) == ("e2", 0)
            assert rec.match(["a", "b"]) == {}
            assert w1.url in rec.match(["c", "d"])
            # a gap in epoch e2 (events after 0 announced, none sent): state loaded again
            fake.hold = False

            async def gap(url, path, params=None, timeout=None):
                if path == "/internal/cache_events":
                    return {"epoch": "e2", "last_seq": 5, "events": []}
                return {"epoch": "e2", "last_seq": 5, "blocks": [], "snapshots": []}

            fake.get = gap
            await pool.index_sync.pull(w1)
            assert w1.resyncs == 3 and pool.index.cursor(w1.url) == ("e2", 5)
            assert w1.url in rec.match(["c", "d"])
        finally:
            await pool.close()

    asyncio.run(run())


def test_forget_before_a_time():
    from router.recent import RecentPlacements

    rec = RecentPlacements(ttl_s=30.0)
    rec.record("w", ["a"], [1], 10.0, now=1.0)
    rec.record("w", ["b"], [1], 10.0, now=2.0)
    rec.record("v", ["a"], [1], 10.0, now=1.0)
    rec.forget("w", before=2.0)
    assert set(rec.match(["a"])) == {"v"} and set(rec.match(["b"])) == {"w"}
    assert rec.extended(["b"], 2.0, 10.0) == {"w": 10.0}  # still w's latest
    rec.forget("w")
    assert rec.match(["b"]) == {} and len(rec) == 1
