"""Retry rules of a choice before its token #1: which failures place it again, which wait
for decode room, and :func:`first_then_retrying` (a tenacity loop entered only on a first
failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState

from router.errors import APIError
from router.placement import NoWorkerAvailable
from router.workers import PoolBusy, WorkerError

T = TypeVar("T")
log = logging.getLogger("k3serve.router")

#: Pause before a choice that found every decode worker busy retries its reservation; waiting
#: choices take turns, so at most 1 / BUSY_RETRY_S such retries per second leave the router.
BUSY_RETRY_S = 0.005
#: Placements of one choice before its token #1 (the first and the re-placements): enough
#: that a worker that hangs or dies mid-call, on top of transient transfer failures on the
#: others (a failed pairing, a dropped connection), does not fail the request.
FIRST_TOKEN_ATTEMPTS = 5
#: A migrating choice with no healthy decode worker to go to looks again this often (s).
RESUME_WAIT_S = 0.25


def failover(e: BaseException) -> bool:
    """A worker failed before token #1 (unreachable, killed mid-call, an error answer such as
    502 ``transfer_pairing_failed``, ``busy``: its queue is full): nothing reached the client,
    so the choice is placed again — on other workers where there are (both reservations were
    aborted). No free connection of the router's own pool (``PoolBusy``) is shed instead, and
    a request the worker refused (a 4xx such as 400 ``invalid_request``: every worker would)
    is answered as it is (:func:`refused`)."""
    return isinstance(e, WorkerError) and not isinstance(e, PoolBusy) and not e.client_error


def refused(e: WorkerError) -> Exception:
    """A worker's 400 before token #1 as the client's 400 (the worker's code and message);
    another 4xx stays a ``WorkerError`` (the router's own fault, answered 503)."""
    if e.status != 400:
        return e
    return APIError(400, f"the request was refused by a worker: {e.detail or e}",
                    code=e.code or "invalid_request")


def busy(e: BaseException) -> bool:
    """A decode worker had no room for the reservation now."""
    return isinstance(e, WorkerError) and e.busy


async def first_then_retrying(attempt: Callable[[int], Awaitable[T]],
                              retryable: Callable[[BaseException], bool],
                              retrying: Callable[[], AsyncRetrying]) -> T:
    """``attempt(1)``, awaited directly; only when it fails with an error ``retryable``
    accepts does the tenacity loop ``retrying()`` run, from that failure: the loop's attempt
    1 re-raises it (so its retry, stop, before-sleep and error callbacks see it as their own
    first attempt), then ``attempt(2)``, ``attempt(3)``, ... as the loop decides.

    The same attempts, waits and errors as running the loop from the start, without
    tenacity's per-attempt work (its callbacks are checked and wrapped on every attempt:
    ~0.1 ms of router CPU per request for the two loops a choice runs) in the usual case,
    where the first attempt succeeds (benchmarks/router_relay.py).

    Raises:
        Whatever ``attempt(1)`` raised that ``retryable`` refuses; else what the loop raises.
    """
    try:
        return await attempt(1)
    except BaseException as e:  # re-raised below, or by the loop
        if not retryable(e):
            raise
        failed: BaseException | None = e
    async for a in retrying():
        with a:
            n = a.retry_state.attempt_number
            if n == 1 and failed is not None:
                e, failed = failed, None
                raise e
            result = await attempt(n)
    return result


class BusyGate:
    """Choices waiting for decode room retry one at a time, in turn (FIFO): a crowd of them
    must not flood the decode workers with reservation attempts."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    async def turn(self, seconds: float, deadline: float) -> None:
        """Wait for this choice's turn to retry a reservation that found no decode room
        (the turn lasts ``seconds``; never past ``deadline``, monotonic seconds)."""
        async def turn() -> None:
            async with self._lock:
                await asyncio.sleep(seconds)

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(turn(), max(0.0, deadline - time.monotonic()))


def no_room(busy_wait_s: float) -> Callable[[RetryCallState], None]:
    """The busy loop's ``retry_error_callback``: raises ``NoWorkerAvailable`` naming the
    wait (``busy_wait_s`` seconds)."""
    def fail(_: RetryCallState) -> None:
        raise NoWorkerAvailable(f"no decode worker had room for the request within "
                                f"{busy_wait_s:g} s")

    return fail


async def wait_for_live(live: Callable[[str], Sequence[object]], monolithic: bool,
                        deadline: float, what: str) -> None:
    """Before a choice whose worker failed before token #1 is placed again: while a role it
    needs (prefill and decode; decode only on a ``monolithic`` stack) has no live worker
    (``live(role)`` is empty: the only prefill worker was killed), wait for one — a
    supervised worker comes back on a fresh port and registers again — looking every
    ``RESUME_WAIT_S`` seconds, until ``deadline`` (monotonic seconds; the router passes
    ``RouterConfig.busy_wait_s`` after the request arrived). Returns at once when every role
    has one; past ``deadline`` placement answers 503 (``NoWorkerAvailable``, with
    ``Retry-After``). ``what`` names the request (its sub-request id) in the log."""
    roles = ("decode",) if monolithic else ("prefill", "decode")
    missing = [r for r in roles if not live(r)]
    if not missing:
        return
    log.info("%s: no live %s worker; waiting up to %.0f s for one", what, " or ".join(missing),
             max(0.0, deadline - time.monotonic()))
    while time.monotonic() < deadline and not all(live(r) for r in roles):
        await asyncio.sleep(RESUME_WAIT_S)
