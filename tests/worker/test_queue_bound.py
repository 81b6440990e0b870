"""Issue 15: each worker's queue is bounded (``WorkerConfig.max_queued``, ``--max-queued``).

Admission calls (``/internal/reserve``, ``/prefill``, ``/generate``, ``/resume``) that the
worker holds unanswered count as its queue (a prefill waits for token #1); one more is
answered 503 ``busy`` with ``Retry-After`` and an :class:`~k3serve.messages.ErrorBody`, counted
in ``k3serve:requests_shed_total``; once calls are answered the worker admits again. The
router's side (place elsewhere, or 503 + ``Retry-After`` when every worker is busy) is
tests/router/test_reliability.py.

The apps are built around workers without an engine (``__new__``) whose engine loop holds
every call until the test releases it, so "queued" is exact and nothing is timed.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from decode.worker import DecodeWorker
from k3serve.messages import ErrorBody
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from prefill.worker import PrefillWorker
from worker.config import WorkerConfig
from worker.http import RETRY_AFTER_S, create_app
from worker.metrics import WorkerMetrics

TOKEN = "queue-test-token"
MAX_QUEUED = 3
SAMPLING = {"temperature": 0.0, "max_tokens": 4, "seed": 1}


class HeldLoop:
    """An engine loop whose calls wait for ``release`` and then fail with a ValueError (the
    handlers answer it 400 ``invalid_request``): each call is one queued request."""

    alive = True  # /health: the engine thread runs

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0

    async def call(self, fn, *args, timeout=None):
        self.calls += 1
        await self.release.wait()
        raise ValueError("released by the test")


def _app(role: str):
    cls = {"prefill": PrefillWorker, "decode": DecodeWorker}[role]
    w = cls.__new__(cls)  # no engine
    w.config = WorkerConfig(role=role, cluster_token=TOKEN, max_queued=MAX_QUEUED)
    w.worker_id, w.store = f"{role}-q", None
    w.metrics = WorkerMetrics(w.worker_id, role)
    w.loop = HeldLoop()
    return w, create_app(w)


def _call(role: str, i: int) -> tuple[str, dict]:
    ids = [3, 4, 5, 6 + i]
    if role == "prefill":
        return "/internal/prefill", {"request_id": f"q{i}", "prompt_token_ids": ids,
                                     "sampling": SAMPLING, "ticket": "t",
                                     "bootstrap_addr": "http://127.0.0.1:9"}
    return "/internal/reserve", {"request_id": f"q{i}", "prompt_token_ids": ids,
                                 "sampling": SAMPLING}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_past_max_queued_a_worker_answers_503_busy_with_retry_after(role):
    w, app = _app(role)

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://w", headers={CLUSTER_TOKEN_HEADER: TOKEN},
                                     timeout=30) as c:
            held = [asyncio.create_task(c.post(_call(role, i)[0], json=_call(role, i)[1]))
                    for i in range(MAX_QUEUED)]
            while w.loop.calls < MAX_QUEUED:  # every held call is in the engine's queue
                await asyncio.sleep(0.01)
            assert app.state.queued == MAX_QUEUED
            for i in range(2):  # one more: refused at once, typed body, Retry-After
                path, body = _call(role, 100 + i)
                r = await c.post(path, json=body)
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == str(RETRY_AFTER_S)
                err = ErrorBody.model_validate(r.json())
                assert err.error == "busy" and f"max_queued {MAX_QUEUED}" in err.message
            assert w.loop.calls == MAX_QUEUED  # the refused calls never reached the engine
            # control: routes outside the queue are answered while it is full
            assert (await c.get("/health")).status_code == 200
            w.loop.release.set()
            for t in held:
                r = await t
                assert r.status_code == 400 and r.json()["error"] == "invalid_request", r.text
            assert app.state.queued == 0
            path, body = _call(role, 200)
            r = await c.post(path, json=body)  # admitted again (the held loop answers 400)
            assert r.status_code == 400, r.text
            text = (await c.get("/metrics")).text
            shed = [ln for ln in text.splitlines()
                    if ln.startswith("k3serve:requests_shed_total{")]
            assert shed and float(shed[0].rsplit(" ", 1)[1]) == 2, shed

    asyncio.run(go())
