"""Regressions found by reviewing the router's relay / tie-break / kick changes.

* ``WorkerPool.kick`` while a pull is already running: the running pull may have asked for the
  worker's events before the newer prefill stored its blocks, so the newer kick must cause one
  more pull (it used to be dropped: "a pull already pending covers this one" is false once
  that pull's request is on the wire).
* Every pull of a worker's events holds ``Worker.sync_lock`` (the n > 1 path's pull in
  ``Router.run_prompt`` did not, and overlapped the kick's pull of the same worker: the
  "computed" tokens of the overlapping answer were counted twice in the load account).
* Tie-breaks and affinity keys: the same across processes (hash randomisation), different
  for different ``cache_salt`` values.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from k3serve.messages import Capacity, WorkerInfo
from router.workers import Worker, WorkerPool

MODEL = "k3-tiny"


def _pool_and_worker() -> tuple[WorkerPool, Worker]:
    info = WorkerInfo(role="prefill", model=MODEL, fingerprint="f", block_size=4,
                      capacity=Capacity(num_pages=8, num_slots=8, num_snapshots=0),
                      max_model_len=256)
    return WorkerPool(MODEL, None), Worker("http://127.0.0.1:9", info)


# ----------------------------------------------------------------------------- kick
def test_kick_during_a_running_pull_pulls_again_after_it():
    """Kick #2 arrives while kick #1's pull is in flight: a second pull follows (its blocks
    may postdate the first pull's answer); kicks arriving meanwhile share that one pull."""
    async def run() -> tuple[int, int]:
        pool, w = _pool_and_worker()
        started = asyncio.Event()
        release = asyncio.Event()
        calls = 0

        async def sync(worker: Worker) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                started.set()
                await release.wait()  # the first pull's GET is on the wire

        pool.sync = sync  # type: ignore[method-assign]
        try:
            pool.kick(w)
            await started.wait()
            pool.kick(w)  # a newer prefill answered during the pull
            pool.kick(w)  # and another: the same follow-up pull covers both
            release.set()
            for _ in range(50):
                await asyncio.sleep(0)
            assert w.kick_task is not None
            await w.kick_task
            tasks_alive = sum(1 for t in asyncio.all_tasks()
                              if t.get_name().startswith("kick "))
            return calls, tasks_alive
        finally:
            await pool.close()

    calls, alive = asyncio.run(run())
    assert calls == 2
    assert alive == 0


def test_kick_waiting_for_the_lock_covers_later_kicks():
    """While the poll loop holds ``sync_lock``, kicks wait; they then pull once, not once
    each (no pile-up of tasks or pulls)."""
    async def run() -> int:
        pool, w = _pool_and_worker()
        calls = 0

        async def sync(worker: Worker) -> None:
            nonlocal calls
            calls += 1

        pool.sync = sync  # type: ignore[method-assign]
        try:
            async with w.sync_lock:  # the poll loop's pull
                for _ in range(5):
                    pool.kick(w)
                    await asyncio.sleep(0)
            assert w.kick_task is not None
            await w.kick_task
            return calls
        finally:
            await pool.close()

    assert asyncio.run(run()) == 1


def test_kick_failure_is_observed_and_a_later_kick_still_pulls():
    """A failing pull leaves no unobserved task exception and does not stop later kicks."""
    async def run() -> tuple[int, list]:
        pool, w = _pool_and_worker()
        calls = 0
        loop_errors: list = []
        asyncio.get_running_loop().set_exception_handler(lambda lp, ctx: loop_errors.append(ctx))

        async def sync(worker: Worker) -> None:
            nonlocal calls
            calls += 1
            raise RuntimeError("worker down")

        pool.sync = sync  # type: ignore[method-assign]
        try:
            pool.kick(w)
            await w.kick_task
            pool.kick(w)
            await w.kick_task
            return calls, loop_errors
        finally:
            await pool.close()

    calls, errors = asyncio.run(run())
    assert calls == 2
    assert errors == []


def test_pull_holds_the_sync_lock():
    """``WorkerPool.pull`` (what the pipeline's n > 1 path calls) never overlaps a kick's
    pull of the same worker."""
    async def run() -> int:
        pool, w = _pool_and_worker()
        inside = 0
        most = 0
        release = asyncio.Event()

        async def sync(worker: Worker) -> None:
            nonlocal inside, most
            inside += 1
            most = max(most, inside)
            try:
                await asyncio.wait_for(release.wait(), 0.2)
            except TimeoutError:
                pass
            finally:
                inside -= 1

        pool.sync = sync  # type: ignore[method-assign]
        try:
            pool.kick(w)
            await asyncio.sleep(0)
            puller = asyncio.create_task(pool.pull(w))
            await asyncio.sleep(0.05)
            release.set()
            await puller
            await w.kick_task
            return most
        finally:
            await pool.close()

    assert asyncio.run(run()) == 1


def test_n2_request_pulls_of_one_worker_never_overlap():
    """End to end: an ``n = 2`` request triggers the kick of its prefill worker and the
    pipeline's own pull before choices 2..n; the two must not run at the same time."""
    from router_fakes import Stack

    orig = WorkerPool.sync
    inside: dict[str, int] = {}
    overlaps: list[str] = []

    async def sync(self: WorkerPool, w: Worker) -> None:
        inside[w.url] = inside.get(w.url, 0) + 1
        if inside[w.url] > 1:
            overlaps.append(w.url)
        try:
            await asyncio.sleep(0.1)  # widen the window an overlap would need
            await orig(self, w)
        finally:
            inside[w.url] -= 1

    WorkerPool.sync = sync  # type: ignore[method-assign]
    stack = Stack(num_prefill=1, num_decode=1, poll_interval_s=60.0)
    try:
        overlaps.clear()
        r = stack.client.completions.create(model=MODEL, prompt="two choices " * 8,
                                            max_tokens=2, n=2)
        assert len(r.choices) == 2
        assert overlaps == []
    finally:
        stack.close()
        WorkerPool.sync = orig  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- tie-breaks
_PROBE = r"""
import json, sys
from router.pipeline import affinity_key
from router.placement import PlacementRequest, tie_breaks
from router.preprocess import prompt_hashes
out = {}
for salt in (None, "a", "b"):
    for ids in ([1, 2, 3], list(range(40))):
        hs = prompt_hashes(ids, 16, "fp", salt)
        k = affinity_key(ids, hs, "fp", salt)
        req = PlacementRequest(len(ids), 16, seq=7, key=k)
        out[f"{salt}/{len(ids)}"] = [k, tie_breaks(req, ["http://w1", "http://w2", "http://w3"])]
print(json.dumps(out))
"""


def _probe(seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                       text=True, check=True, timeout=120)
    return json.loads(r.stdout)


def test_tie_breaks_are_the_same_across_processes_and_salts_isolate():
    a, b = _probe("1"), _probe("12345")
    assert a == b  # no dependence on hash randomisation
    for n in (3, 40):  # short prompt (no full block) and long prompt
        keys = {a[f"{salt}/{n}"][0] for salt in ("None", "a", "b")}
        assert len(keys) == 3, keys  # cache_salt values never share an affinity key
    for k, ties in a.values():
        assert len(set(ties)) == 3  # distinct: a strict order among the workers
