"""Issue 15, must-show 7 (soak): transfers must not expire because the prefill worker is busy.

The soak found every transfer failing under a steady load (``sender failed: timed out after
30 s in state TRANSFERRING``). Not a Transfer Engine stall: a prefill's sender starts at
admission, with its deadline, and the scheduler admitted every queued prompt that found a slot
(chunks end on log-spaced snapshot points, so the oldest prefill seldom fills a step and the
rest of the budget admits the next prompts). All the admitted prompts then shared the steps
and each one's prefill took as long as the whole queue: past the deadline, the cache was
thrown away and the decode worker recomputed it (twice the work, so the collapse fed itself).

Here a real prefill + decode pair (``tests/worker_procs.py``) gets a burst of N prompts at
once with a short sender deadline (``K3SERVE_KV_SENDER_TIMEOUT_S``), far longer than one
prompt's prefill but shorter than the whole burst's on this box: every request completes,
every transfer succeeds and none falls back; the prefill worker never computes more prompts
at once than its backlog cap allows (``num_running`` polled during the burst).
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.worker.conftest import CAP
from tests.worker_procs import HEADERS, Proc, _metric, _request

N = 24
PROMPT = (150, 250)  # tokens; one prompt: < 2 s here, the whole burst at once: ~15 s
@pytest.fixture(scope="module")
def pair(shared_pair):
    """The session's pair (tests/worker/conftest.py: ``--max-prefill-backlog`` CAP, sender
    deadline SENDER_TIMEOUT_S); other tests may have used it before: counters are deltas."""
    return shared_pair


async def _burst(P: Proc, D: Proc) -> tuple[list, int]:
    """N requests at once; returns (each request's tokens or exception, the most prompts the
    prefill worker ran at once)."""
    rng = random.Random(15)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(*PROMPT))] for _ in range(N)]
    most = 0
    done = asyncio.Event()

    async def watch(c: httpx.AsyncClient) -> None:
        nonlocal most
        while not done.is_set():
            u = (await c.get(P.url + "/internal/info")).json()["usage"]
            most = max(most, u["num_running"])
            await asyncio.sleep(0.02)

    async with httpx.AsyncClient(headers=HEADERS, timeout=120) as c:
        await _request(c, P, D, "warm", prompts[0][:40])
        w = asyncio.create_task(watch(c))
        try:
            res = await asyncio.gather(*(_request(c, P, D, f"load-{i}", ids)
                                         for i, ids in enumerate(prompts)),
                                       return_exceptions=True)
        finally:
            done.set()
            await w
    return res, most


def test_a_burst_the_stack_can_serve_completes_with_every_transfer(pair):
    P, D = pair

    def counters() -> tuple[float, ...]:
        return (_metric(P.url, "k3serve:kv_transfers_total", outcome="failed"),
                _metric(P.url, "k3serve:kv_transfer_expiries_total"),
                _metric(P.url, "k3serve:kv_transfers_total", outcome="success"),
                _metric(D.url, "k3serve:kv_transfer_fallbacks_total"))

    before = counters()
    res, most = asyncio.run(_burst(P, D))
    errors = [r for r in res if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    failed, expired, ok, fallbacks = (a - b for a, b in zip(counters(), before))
    assert failed == 0 and expired == 0 and fallbacks == 0
    assert ok == N + 1  # + warm-up
    # admission stops while CAP tokens or more are left to compute (each prompt alone is
    # longer): a few prompts overlap at the ends of their prefills; uncapped, all N did
    assert most <= N // 4, f"{most} prompts computed at once (cap {CAP} tokens)"
