"""A prefill's answer puts that worker's new blocks into the router's index at once.

With the poll loop slowed to a minute, only the answer can put the first request's blocks
into the router's index before the second, identical request is placed: the second request's
predicted cached tokens must equal the worker's actual reuse, and be > 0. A worker that
carries its cache events in the answer (``PrefillResponse.cache_events``) is not pulled at
all; one that does not (an older worker) is pulled once its prefill answered
(``IndexSync.kick``).
"""

from __future__ import annotations

import time

import pytest

from deploy.fake_stack import Stack
from deploy.fake_workers import MODEL


def _sums(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(name))


@pytest.mark.parametrize("answer_events", [True, False], ids=["in-answer", "pulled"])
def test_prefill_answer_indexes_the_workers_events_before_the_next_request(answer_events):
    stack = Stack(num_prefill=2, num_decode=1, poll_interval_s=60.0,
                  worker={"answer_events": answer_events})
    try:
        prefill = [st for st, _ in stack.prefill]
        deadline = time.monotonic() + 10
        # the registration's pull and the poll loop's first one, then none for 60 s
        while min(st.events_pulls for st in prefill) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        pulls0 = sum(st.events_pulls for st in prefill)
        prompt = "kick the index " * 12
        stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        m0 = stack.metrics()
        stack.wait_indexed(snapshots=1)  # only the answer (or its pull) can bring it in 60 s
        stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        m1 = stack.metrics()
        cached = (_sums(m1, "k3serve:request_cached_tokens_total")
                  - _sums(m0, "k3serve:request_cached_tokens_total"))
        pred = (_sums(m1, "k3serve:router_predicted_cached_tokens_total")
                - _sums(m0, "k3serve:router_predicted_cached_tokens_total"))
        assert cached > 0
        assert pred == cached
        pulls = sum(st.events_pulls for st in prefill) - pulls0
        if answer_events:
            assert pulls == 0  # the answers carried the events
        else:
            assert pulls >= 1  # ... else the router pulled them
        # the index holds each worker's blocks exactly as the worker's own log has them
        for st in prefill:
            want = set(st.cm.cache_state()["blocks"])
            got = stack.router.pool.index._cursors[st.url].blocks
            assert got == want
    finally:
        stack.close()


def test_events_carried_twice_apply_and_count_once():
    """An answer's events and a poll that carries the same ones (overlapping cursors): each
    event is applied once, in order, and its new blocks count once in the pool's account of
    the worker; events of another epoch (a restarted worker) are not applied from the
    answer: the worker is pulled instead."""
    import asyncio

    from k3serve.messages import CacheEvents, Capacity, WorkerInfo
    from router.pool import WorkerPool
    from router.workers import Worker

    def events(epoch: str, first: int, last: int) -> CacheEvents:
        return CacheEvents(epoch=epoch, last_seq=last, events=[
            {"seq": s, "type": "stored", "block_hashes": [f"h{s}"]} for s in range(first, last + 1)])

    async def run():
        pool = WorkerPool(MODEL, None)
        info = WorkerInfo(role="prefill", model=MODEL, fingerprint="f", block_size=16,
                          capacity=Capacity(num_pages=8))
        w = Worker("http://127.0.0.1:9", info)
        pool.workers[w.url] = w
        pool.index.add_worker(w.url)
        pool.index.load_state(w.url, {"epoch": "e1", "last_seq": 0})
        try:
            assert pool.index_sync.events_cursor(w) == 0
            pool.index_sync.answered(w, events("e1", 1, 3))  # a prefill answer
            assert pool.index.cursor(w.url) == ("e1", 3) and w.kick_task is None
            pool.index_sync.absorb(w, events("e1", 2, 4))  # a poll sent before the answer came back
            assert pool.index.cursor(w.url) == ("e1", 4)
            assert pool.index.num_blocks(w.url) == 4
            assert round(w.seen.tokens()) == 4 * 16  # h1..h4 once each (decay: seconds)
            pool.index_sync.answered(w, events("e2", 1, 1))  # restarted: not applied, pulled instead
            assert pool.index.cursor(w.url) == ("e1", 4) and w.kick_task is not None
        finally:
            await pool.close()

    asyncio.run(run())
