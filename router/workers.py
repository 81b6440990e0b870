"""The router's view of its workers: registry, cache-event pollers, and the internal calls.

Workers register with ``POST /internal/register`` (and again after a restart); the router
reads ``GET /internal/info`` (:class:`~k3serve.messages.WorkerInfo`) and then keeps one poller
per worker that pulls ``GET /internal/cache_events?after=SEQ`` into the ``GlobalIndex``
(``GET /internal/cache_state`` on a new epoch or a gap) and doubles as the health check:
``unhealthy_after`` failed pulls in a row mark the worker unhealthy (placement skips it), one
success marks it healthy again.

Every internal call carries the cluster token in ``CLUSTER_TOKEN_HEADER``; every body is a
model of :mod:`k3serve.messages` (the request lifecycle: :mod:`k3serve.protocol`, steps 1–10).

Load figures the placement needs are the router's own account of what it sent
(:meth:`Worker.load` changes them, and nothing else does): a prefill worker's queued tokens
(predicted uncached tokens of prefills not answered yet) and its recent account of them
(:class:`~router.policies.load.RecentLoad`: decayed tokens and requests sent, placement's
``util`` and ``request_rate``), a decode worker's running requests and reserved tokens
(prompt + max new tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import aiohttp
import httpx
import pybreaker
import yarl
from pydantic import BaseModel, ValidationError

from k3serve.messages import (
    CHANNEL_PING_S,
    AbortRequest,
    AttachRequest,
    CacheEvents,
    ChannelRequest,
    PrefillRequest,
    PrefillResponse,
    ReserveRequest,
    ReserveResponse,
    StreamEvent,
    StreamRequest,
    WorkerInfo,
    WorkerLoad,
)
from k3serve.protocol import CLUSTER_TOKEN_ENV, CLUSTER_TOKEN_HEADER  # noqa: F401 - re-exported
from router.index import GlobalIndex, PrefixMatch, ResyncNeeded
from router.policies.load import PoolLoad, RecentLoad
from router.sse import SSEReader, decode_event

log = logging.getLogger("k3serve.router")

M = TypeVar("M", bound=BaseModel)


#: Error codes a worker answers when its transfer peer failed, not itself.
PEER_FAULTS = frozenset({"transfer_pairing_failed"})


class WorkerError(RuntimeError):
    """An internal call failed (connection, timeout, non-2xx status, malformed answer).

    Attributes:
        worker: The worker's base URL.
        retryable: True when nothing was computed for the request (connection refused, 503),
            so placing it elsewhere is safe.
        busy: The worker answered 503 ``busy``: it is alive but has no cache for the request
            now (a decode reservation); wait for room rather than mark it unhealthy.
    """

    def __init__(self, worker: str, message: str, retryable: bool = False,
                 busy: bool = False, status: int | None = None, hung: bool = False,
                 code: str | None = None, detail: str | None = None) -> None:
        super().__init__(f"{worker}: {message}")
        self.worker = worker
        self.retryable = retryable or busy
        self.busy = busy
        self.status = status  # the worker's HTTP status, if it answered
        self.hung = hung  # no answer within the request path's deadline
        self.code = code  # the worker's ErrorBody ``error``, if it sent one
        self.detail = detail  # ... and its ``message``

    @property
    def client_error(self) -> bool:
        """The worker refused the request itself (a 4xx such as 400 ``invalid_request``):
        another worker would refuse it the same way, so it is not placed again."""
        return self.status is not None and 400 <= self.status < 500 and not self.busy

    @property
    def fault(self) -> bool:
        """The worker is at fault (unreachable, hung, 5xx other than ``busy``, malformed
        answer): its circuit breaker counts it. A prefill worker's 502
        ``transfer_pairing_failed`` is its decode peer's failure (the peer's bootstrap did not
        answer): it does not count against the prefill worker — the peer's own liveness probe
        and calls take a dead peer out of placement."""
        if self.code in PEER_FAULTS:
            return False
        return not self.busy and (self.status is None or self.status >= 500)


class PoolBusy(WorkerError):
    """No free connection of the router's request pool within its pool timeout: the router
    is overloaded (answered 503 with ``Retry-After``); the worker is not at fault."""

    @property
    def fault(self) -> bool:
        return False


def _worker_fault(e: BaseException) -> bool:
    return isinstance(e, WorkerError) and e.fault


def _cut_off(b: pybreaker.CircuitBreaker) -> bool:
    """The breaker is open and its reset timeout has not elapsed (no trial call yet)."""
    if b.current_state != pybreaker.STATE_OPEN:
        return False
    opened = b._state_storage.opened_at  # pybreaker keeps no public accessor for it
    return opened is None or (datetime.now(UTC) - opened).total_seconds() < b.reset_timeout


class _BreakerLog(pybreaker.CircuitBreakerListener):
    def state_change(self, cb: pybreaker.CircuitBreaker, old: Any, new: Any) -> None:
        log.warning("worker %s: circuit %s -> %s", cb.name, getattr(old, "name", None),
                    new.name)


@dataclass
class Worker:
    """One registered worker and the router's running account of its load."""

    url: str
    info: WorkerInfo
    healthy: bool = True
    failures: int = 0
    alive: bool = True  # its liveness probe (``GET /health``) answers
    misses: int = 0  # liveness probes in a row that got no answer in time
    queued_tokens: int = 0  # prefill: predicted uncached tokens of unanswered prefills
    running: int = 0  # decode: requests reserved and not finished
    reserved_tokens: int = 0  # decode: Σ (prompt + max new tokens) of those
    #: prefill: decayed uncached tokens / requests sent (``util``, ``request_rate``)
    recent: RecentLoad = field(default_factory=RecentLoad, repr=False)
    #: prefill: decayed tokens the worker computed by its cache events (every replica's
    #: requests; :class:`~router.policies.load.PoolLoad`)
    seen: RecentLoad = field(default_factory=RecentLoad, repr=False)
    resyncs: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)
    live_task: asyncio.Task | None = field(default=None, repr=False)
    # one event pull at a time per worker (:meth:`WorkerPool.pull`: polls, kicks, the rest)
    sync_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    kick_task: asyncio.Task | None = field(default=None, repr=False)
    kick_wanted: bool = field(default=False, repr=False)  # a kick not yet served by a pull
    reported: WorkerLoad | None = None  # the worker's own figures, with its cache events
    sent_since_report: int = 0  # prefill tokens this router sent after that report
    requests_since_report: int = 0  # ... and prefill requests
    reported_at: float = 0.0  # monotonic seconds when that report arrived
    reports: int = 0  # reports so far (which report a prefill was sent under)
    reported_epoch: str | None = None  # the event epoch and last_seq of that report's answer
    reported_seq: int | None = None
    #: tokens of this router's prefills running when that report came, answered since
    answered_since_report: int = 0

    # -- load as placement sees it: the larger of the router's own account and what the worker
    # reported (which includes the requests of the other router replicas, a poll late)
    def placement_queued(self, rate: float, now: float | None = None) -> int:
        """Prefill tokens queued on the worker: the own account, or what is left of the
        reported queue plus what this router sent since the report and is still waiting for,
        the larger (a prefill sent after the report and already answered is no longer queued:
        counting it made a worker look busy until the next poll, and a repeat prompt then
        went to a worker without its prefix).

        What is left of the report: its tokens less those the worker computed since at
        ``rate`` (a work-conserving worker, the fluid model: ``max(0, Q − rate · age)``), less
        this router's prefills that were running when it came (it may count them) and were
        answered since. A report up to a poll old often still shows a prefill answered
        since; read as is it priced that worker ~1.5 × Q / rate seconds higher (prefix_home's
        queue weight), which decided near-ties differently in each router replica.

        Args:
            rate: the worker's prefill rate, tokens/s (> 0; the one placement prices it at).
            now: monotonic seconds (``None``: the clock).
        """
        if self.reported is None:
            return self.queued_tokens
        age = max(0.0, (time.monotonic() if now is None else now) - self.reported_at)
        left = max(0.0, self.reported.queued_prefill_tokens - rate * age
                   - self.answered_since_report)
        return max(self.queued_tokens,
                   round(left) + min(self.sent_since_report, self.queued_tokens))

    @property
    def placement_load(self) -> PoolLoad | RecentLoad:
        """``util`` / ``request_rate`` for placement: the larger of the own account and the
        pool's (the worker's computed tokens by its events plus what this router sent since
        its last report); the own account alone before the worker reported its load."""
        if self.reported is None:
            return self.recent
        return PoolLoad(self.recent, self.seen, self.sent_since_report,
                        self.requests_since_report)

    @property
    def counts_prefills(self) -> bool:
        """The worker reports its prefill counters (``WorkerLoad.prefills`` /
        ``prefill_tokens``): :attr:`seen` follows them, not the cache events' blocks."""
        r = self.reported
        return r is not None and r.prefills is not None and r.prefill_tokens is not None

    def report(self, load: WorkerLoad | None, epoch: str | None = None,
               seq: int | None = None) -> None:
        """A new load report from the worker (with its cache events: a poll's or a prefill
        answer's). Its prefill counters' increase since the last report goes into :attr:`seen`
        (tokens and requests); the first report sets the baseline.

        ``epoch`` / ``seq``: the event stream's epoch and ``last_seq`` of the answer that
        carried the report. Polls and prefill answers arrive on different connections, so
        an older report can land after a newer one: within one epoch a report whose
        ``last_seq`` is below the last applied one's, or whose counters went down (they never
        do within an epoch), is older and ignored — read as a restart it would add the
        worker's whole lifetime counters. Counters that went down in another epoch (or with
        no epoch given) restarted with the worker: their whole value is new."""
        same_epoch = epoch is not None and epoch == self.reported_epoch
        if same_epoch and seq is not None and self.reported_seq is not None \
                and seq < self.reported_seq:
            return  # an older answer than the one applied
        last = self.reported if self.counts_prefills else None
        counted = last is not None and load is not None and load.prefills is not None \
            and load.prefill_tokens is not None
        if counted:
            n, tok = load.prefills, load.prefill_tokens  # type: ignore[union-attr]
            went_down = n < last.prefills or tok < last.prefill_tokens  # type: ignore[operator,union-attr]
            if went_down and same_epoch:
                return  # older: counters only grow within an epoch
        self.reported, self.sent_since_report, self.requests_since_report = load, 0, 0
        self.reported_at, self.answered_since_report = time.monotonic(), 0
        self.reported_epoch, self.reported_seq = epoch, seq
        self.reports += 1
        if counted:
            dn, dt = (n, tok) if went_down else (n - last.prefills, tok - last.prefill_tokens)  # type: ignore[operator,union-attr]
            if dn or dt:
                self.seen.add(dt, requests=float(dn))

    @property
    def placement_running(self) -> int:
        """Decode requests on the worker (own account or reported, the larger)."""
        return max(self.running, self.reported.running if self.reported else 0)

    def placement_free_tokens(self) -> int:
        """Free decode cache tokens: capacity less the own reservations, and no more than the
        worker reported free (``1 << 62`` when neither is known)."""
        cap = self.info.capacity_tokens
        own = cap - self.reserved_tokens if cap else 1 << 62
        if self.reported is None or self.reported.free_pages is None:
            return own
        return min(own, self.reported.free_pages * self.info.block_size)

    def placement_free_slots(self) -> int:
        """Free decode state slots (own account or reported, the fewer)."""
        own = self.info.capacity.num_slots - self.running
        if self.reported is None or self.reported.free_slots is None:
            return own
        return min(own, self.reported.free_slots)

    breaker: pybreaker.CircuitBreaker = field(
        default_factory=lambda: pybreaker.CircuitBreaker(fail_max=3, reset_timeout=5.0,
                                                         exclude=[lambda e: not _worker_fault(e)],
                                                         throw_new_error_on_trip=False),
        repr=False)

    @property
    def available(self) -> bool:
        """Placement may use it: healthy (its polls answer), alive (its liveness probe
        answers) and its breaker not open."""
        return self.healthy and self.alive and not _cut_off(self.breaker)

    @property
    def name(self) -> str:
        """Metric label: the worker's own id, else its URL."""
        return self.info.worker_id or self.url

    @property
    def role(self) -> str:
        return self.info.role

    @contextlib.contextmanager
    def load(self, *, running: int = 0, reserved_tokens: int = 0,
             queued_tokens: int = 0) -> Iterator[None]:
        """Count load on this worker while the block runs; the only place the counters change.

        Args:
            running: Decode requests to add (reserved, not finished).
            reserved_tokens: Tokens those requests may occupy (prompt + max new tokens).
            queued_tokens: Prefill tokens sent and not answered yet (predicted uncached); a
                prefill (``queued_tokens`` > 0) also counts once in :attr:`recent`, which
                decays by itself (``util`` / ``request_rate`` of placement).
        """
        if queued_tokens > 0:
            self.recent.add(queued_tokens)
            self.requests_since_report += 1
        self.running += running
        self.reserved_tokens += reserved_tokens
        self.queued_tokens += queued_tokens
        self.sent_since_report += queued_tokens
        under = self.reports
        try:
            yield
        finally:
            self.running -= running
            self.reserved_tokens -= reserved_tokens
            self.queued_tokens -= queued_tokens
            if self.reports != under:  # a report came while it ran: it may count it
                self.answered_since_report += queued_tokens


class WorkerPool:
    """Registered workers, their cache index, pollers, and the HTTP calls to them.

    Two HTTP clients with their own connection pools: :attr:`session` (aiohttp) for the
    request path (reserve, prefill, generate, resume, streams, aborts) and ``health`` (httpx)
    for registration reads and the cache-event pollers, so that request traffic can never
    starve the health checks; a request that finds no free connection within
    ``pool_timeout_s`` fails with :class:`PoolBusy` (the router is overloaded; no worker
    failed).

    Each worker has a circuit breaker (:mod:`pybreaker`) fed by request-path calls: after
    ``breaker_fail_max`` failures in a row (connection refused, a call given up on a hung
    worker, a 5xx other than ``busy``) the breaker opens and placement skips the
    worker; after ``breaker_reset_s`` one trial request may go there again (half-open), and
    its success closes the breaker. A re-registration (restart) closes it too.

    Args:
        model: The served model name; workers of another model are refused.
        cluster_token: Sent on every internal call; ``None`` sends none.
        poll_interval_s: Seconds between cache-event pulls of one worker.
        unhealthy_after: Failed pulls in a row that mark a worker unhealthy.
        timeout_s: Timeout of one internal call (a stream: between two events).
        transport: httpx transport of the ``health`` client (registration reads, cache-event
            polls); the request path always goes over the network.
        on_worker: Called with each worker once registered (metrics series).
        poll_timeout_s: Timeout of one cache-event pull (the health check): a worker that is
            alive but stuck (stopped, wedged) fails its polls and leaves placement.
        deadline_s: Seconds a request-path call (reserve, prefill, the wait between two
            stream events) waits on a worker that does not answer (its liveness probes or its
            polls fail) before it fails as hung; a worker that answers is waited for up to
            ``timeout_s`` (an open breaker alone does not cut calls already running: a busy
            worker catching up after a stall would fail them all).
        pool_timeout_s: Seconds a request-path call waits for a free connection.
        max_connections: Size of the request path's connection pool.
        breaker_fail_max: Request-path failures in a row that open a worker's breaker.
        breaker_reset_s: Seconds an open breaker waits before a trial request.
        live_interval_s / live_timeout_s / live_misses: the liveness probe, a second task per
            worker on the health client: ``GET /health`` every ``live_interval_s``, which the
            worker answers on its event loop without waiting for its engine thread (a worker
            busy computing answers it at once; its cache-event pulls wait for the engine
            thread between two steps, so their timeout must stay long). ``live_misses``
            probes in a row with no answer within ``live_timeout_s`` (or an answer 5xx other
            than ``draining``) take the worker out of placement (:attr:`Worker.alive`): a
            stopped (``SIGSTOP``) or wedged process leaves within
            ``live_misses × (live_interval_s + live_timeout_s)`` seconds; one answer brings
            it back.
        channels: read the token streams of a decode worker that serves decode channels
            (``WorkerInfo.channels``) on one channel per worker (:class:`DecodeChannel`);
            False: one stream per request, as with an older worker.
    """

    def __init__(self, model: str, cluster_token: str | None, poll_interval_s: float = 0.1,
                 unhealthy_after: int = 3, timeout_s: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 on_worker: Callable[[Worker], None] | None = None,
                 poll_timeout_s: float = 10.0, deadline_s: float = 30.0,
                 pool_timeout_s: float = 5.0, max_connections: int = 1024,
                 breaker_fail_max: int = 3, breaker_reset_s: float = 5.0,
                 live_interval_s: float = 0.5, live_timeout_s: float = 1.5,
                 live_misses: int = 2, channels: bool = True) -> None:
        self.model = model
        self.live_interval_s = live_interval_s
        self.live_timeout_s = live_timeout_s
        self.live_misses = live_misses
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self.unhealthy_after = unhealthy_after
        self.deadline_s = deadline_s
        self.breaker_fail_max = breaker_fail_max
        self.breaker_reset_s = breaker_reset_s
        self.index = GlobalIndex()
        self.workers: dict[str, Worker] = {}
        self._on_worker = on_worker
        headers = {CLUSTER_TOKEN_HEADER: cluster_token} if cluster_token else {}
        # The request path (reserve, prefill, generate, resume, streams, aborts) on aiohttp: its
        # C HTTP parser costs a fraction of httpx + httpcore + anyio per call and per streamed
        # read (issue 19: most of the router's fixed cost per request was there). A stream of
        # its own (no decode channel) holds a connection; at most ``max_connections`` calls
        # run at once (past that a call waits ``pool_timeout_s`` for a turn, then sheds as
        # PoolBusy); idle connections are kept 2 s (< uvicorn's 5 s keep-alive: a connection
        # is never reused as it closes). A decode channel is one connection per decode worker,
        # outside that count.
        self._headers = headers
        self._timeout_s = timeout_s
        self._pool_timeout_s = pool_timeout_s
        self._slots = asyncio.Semaphore(max_connections)
        self._session: aiohttp.ClientSession | None = None  # made in the running loop
        self._draining: set[asyncio.Task] = set()  # stream readers in :meth:`_drain`
        # decode channels of this process, by decode worker URL (:class:`DecodeChannel`)
        self.channels = channels
        self._channels: dict[str, DecodeChannel] = {}
        self._closing: set[asyncio.Task] = set()  # :meth:`_spawn`: aborts, channels ending
        self._stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0,
                                                     sock_read=None)
        # Registration reads and the cache-event pollers: httpx (``transport``: tests may route
        # them in-process), its own pool (one poller per worker) and short timeouts.
        self.health = httpx.AsyncClient(
            headers=headers, transport=transport,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
            timeout=httpx.Timeout(timeout_s, connect=min(5.0, poll_timeout_s)))
        self._closed = False

    async def close(self) -> None:
        """Stop every poller and close the HTTP client."""
        self._closed = True
        tasks = [t for w in self.workers.values() for t in (w.task, w.live_task, w.kick_task)
                 if t] + list(self._draining) + list(self._closing) + [
                     c.task for c in self._channels.values() if c.task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._session is not None:
            await self._session.close()
        await self.health.aclose()

    # ------------------------------------------------------------------ registry
    async def register(self, url: str) -> Worker:
        """Register (or re-register) the worker at ``url`` after reading its info.

        Raises:
            WorkerError: its info cannot be read or is malformed.
            ValueError: it serves another model, or changed role under the same URL, or its
                tensor-parallel degree differs from a registered worker's (:func:`check_parallel`).
        """
        url = url.rstrip("/")
        info = _parse(WorkerInfo, url, "/internal/info",
                      await self._get(url, "/internal/info", timeout=self.poll_timeout_s))
        if info.model != self.model:
            raise ValueError(f"worker {url} serves model {info.model!r}, router serves "
                             f"{self.model!r}")
        for o in self.workers.values():
            if o.url != url and (o.info.fingerprint, o.info.block_size) != (info.fingerprint,
                                                                            info.block_size):
                raise ValueError(
                    f"worker {url} has layout fingerprint {info.fingerprint!r} and block size "
                    f"{info.block_size}; registered worker {o.url} has {o.info.fingerprint!r} "
                    f"and {o.info.block_size} (one layout per cluster: their caches could not "
                    f"be exchanged)")
        check_parallel(url, info, [o for o in self.workers.values() if o.url != url])
        for o in list(self.workers.values()):  # restarted on another port: the old URL is dead
            if o.url != url and info.worker_id and o.info.worker_id == info.worker_id:
                if await self._answers_as(o, info.worker_id):
                    log.warning("two live workers named %s: %s and %s", info.worker_id, o.url,
                                url)
                    continue
                log.info("worker %s moved %s -> %s: old entry removed", info.worker_id, o.url,
                         url)
                self.remove(o.url)
        w = self.workers.get(url)
        if w is not None and w.info.role != info.role:
            raise ValueError(f"worker {url} changed role {w.info.role} -> {info.role}")
        if w is None:
            w = Worker(url, info)
            w.breaker = self._breaker(url)
            self.workers[url] = w
            self.index.add_worker(url)
            if self._on_worker:
                self._on_worker(w)
        else:  # a restart: new info, same load account; the new epoch forces a resync
            w.info, w.healthy, w.failures, w.alive, w.misses = info, True, 0, True, 0
            w.breaker.close()
        await self.pull(w)
        if w.task is None or w.task.done():
            w.task = asyncio.create_task(self._poll_loop(w), name=f"poll {url}")
        if w.live_task is None or w.live_task.done():
            w.live_task = asyncio.create_task(self._live_loop(w), name=f"live {url}")
        log.info("registered %s worker %s (%s)", info.role, w.name, url)
        return w

    async def _answers_as(self, w: Worker, worker_id: str) -> bool:
        """Whether ``w``'s URL still answers ``/internal/info`` as ``worker_id`` (2 s)."""
        try:
            body = await self._get(w.url, "/internal/info", timeout=2.0)
        except WorkerError:
            return False
        return isinstance(body, dict) and body.get("worker_id") == worker_id

    def remove(self, url: str) -> Worker | None:
        """Forget the worker at ``url`` at once (a draining worker's deregistration, or the old
        URL of a worker that registered again from a new one): it leaves placement and the
        index, its poller stops; requests already running on it go on. ``None``: unknown."""
        w = self.workers.pop(url.rstrip("/"), None)
        if w is None:
            return None
        self.index.remove_worker(w.url)
        for t in (w.task, w.live_task, w.kick_task):
            if t is not None:
                t.cancel()
        log.info("removed %s worker %s (%s)", w.role, w.name, w.url)
        return w

    @property
    def layout(self) -> tuple[str, int] | None:
        """``(fingerprint, block_size)`` shared by every worker; ``None`` before the first."""
        for w in self.workers.values():
            return w.info.fingerprint, w.info.block_size
        return None

    def live(self, role: str) -> list[Worker]:
        """Workers of a role that placement may use, in registration order: healthy (their
        last polls answered) and not cut off by an open breaker."""
        return [w for w in self.workers.values() if w.role == role and w.available]

    def _breaker(self, url: str) -> pybreaker.CircuitBreaker:
        return pybreaker.CircuitBreaker(
            fail_max=self.breaker_fail_max, reset_timeout=self.breaker_reset_s,
            exclude=[lambda e: not _worker_fault(e)], name=url,
            listeners=[_BreakerLog()], throw_new_error_on_trip=False)

    def match(self, hashes: list[str], max_blocks: int) -> dict[str, PrefixMatch]:
        """``GlobalIndex.match`` keyed by worker URL."""
        return self.index.match(hashes, max_blocks)

    # ------------------------------------------------------------------ polling
    async def sync(self, w: Worker) -> None:
        """Pull a worker's cache events once (until caught up), resyncing when needed.

        The index parses the answers (``CacheEvents``, ``CacheState``).

        Raises:
            WorkerError: the worker did not answer properly.
        """
        for _ in range(64):  # a long backlog arrives in pages; bounded per call
            _epoch, after = self.index.cursor(w.url)
            body = await self._get(w.url, "/internal/cache_events", {"after": after},
                                   timeout=self.poll_timeout_s)
            try:
                events = self.index.parse_events(w.url, body)
                self._absorb(w, events)
            except ResyncNeeded as e:
                log.info("resync %s: %s", w.url, e)
                state = await self._get(w.url, "/internal/cache_state")
                try:
                    self.index.load_state(w.url, state)
                except ValueError as e2:
                    raise WorkerError(w.url, str(e2)) from None
                w.resyncs += 1
                return
            if self.index.cursor(w.url)[1] >= events.last_seq:
                return

    def _absorb(self, w: Worker, events: CacheEvents) -> None:
        """Apply one ``CacheEvents`` answer of ``w`` (a poll's, or a prefill answer's):
        its load report, its events into the index (those at or before the cursor are
        skipped there: overlapping answers apply each event once, in ``seq`` order), and the
        new local MLA blocks among them to the pool's account of the worker (:attr:`Worker.seen`)
        when it reports no prefill counters, counted from the cursor as it is now, so an event
        two answers carry counts once.
        Synchronous: no other pull can apply events in between.

        Raises:
            ResyncNeeded: as :meth:`GlobalIndex.apply_events` (nothing of the events applied).
        """
        w.report(events.load, events.epoch, events.last_seq)
        before = self.index.cursor(w.url)[1]
        self.index.apply_events(w.url, events)
        # computed blocks (new, local MLA blocks): the pool's account of a worker that does
        # not report its prefill counters (``WorkerLoad.prefills``)
        computed = 0 if w.counts_prefills else sum(
            len(ev.block_hashes) for ev in events.events
            if ev.seq > before and ev.type == "stored" and not ev.snapshot
            and ev.source == "local")
        if computed:
            w.seen.add(computed * w.info.block_size, requests=0.0)

    def events_cursor(self, w: Worker) -> int | None:
        """What a prefill request asks the worker for (``PrefillRequest.events_after``): the
        last ``seq`` of ``w``'s events applied, ``None`` before its first sync."""
        epoch, after = self.index.cursor(w.url)
        return after if epoch is not None and after >= 0 else None

    def answered(self, w: Worker, events: CacheEvents | None) -> None:
        """A prefill (or generate) answer of ``w`` came back: its blocks into the index
        before the client can send its next request, so a repeated prompt's predicted cached
        tokens are the worker's actual reuse (a replica learns other replicas' placements
        only from these events).

        ``events``: the cache events the answer carried (``PrefillResponse.cache_events``),
        applied at once (:meth:`_absorb`) — no pull. Without them (a worker that does not
        send them), or when they cannot be applied (another epoch: the worker restarted; a
        gap) or do not reach the worker's newest event (the answer's page was full), the
        worker's events are pulled now instead (:meth:`kick`)."""
        if w.url not in self.workers:  # removed meanwhile (drained, moved)
            return
        if events is not None:
            try:
                self._absorb(w, events)
                if self.index.cursor(w.url)[1] >= events.last_seq:
                    return
            except ResyncNeeded:
                pass
        self.kick(w)

    async def pull(self, w: Worker) -> None:
        """:meth:`sync` under ``w.sync_lock``: every pull of a worker's events (the poll loop,
        :meth:`kick`, a registration, the pipeline's) goes through here, one at a time per
        worker (two overlapping pulls both count the same answer's new blocks).

        Raises:
            WorkerError: as :meth:`sync`.
        """
        async with w.sync_lock:
            await self.sync(w)

    def kick(self, w: Worker) -> None:
        """Pull ``w``'s cache events now, without waiting for its next poll.

        Called when a prefill answer did not bring the worker's events (:meth:`answered`):
        the blocks it just stored are then in the index before the client can send its next
        request, so a repeated prompt's predicted cached tokens are the worker's actual reuse
        (a replica learns other replicas' placements only from these events). One kick task
        per worker: kicks that arrive
        before its pull starts share that pull; a kick that arrives while a pull runs (whose
        request may predate the blocks) gets one more pull after it. A failure is left to the
        poll loop, which counts it against the worker's health."""
        if self._closed:
            return
        w.kick_wanted = True
        if w.kick_task is not None and not w.kick_task.done():
            return

        async def pull() -> None:
            while w.kick_wanted and not self._closed:
                async with w.sync_lock:
                    w.kick_wanted = False  # kicks from here on need a pull after this one
                    with contextlib.suppress(Exception):
                        await self.sync(w)

        w.kick_task = asyncio.get_running_loop().create_task(pull(), name=f"kick {w.url}")

    async def _poll_loop(self, w: Worker) -> None:
        while not self._closed:
            try:
                await self.pull(w)
                if not w.healthy:
                    log.info("worker %s is healthy again", w.url)
                w.failures, w.healthy = 0, True
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure counts against health
                w.failures += 1
                if w.healthy and w.failures >= self.unhealthy_after:
                    w.healthy = False
                    log.warning("worker %s unhealthy after %d failed polls: %s", w.url,
                                w.failures, e)
            await asyncio.sleep(self.poll_interval_s)

    async def probe(self, w: Worker) -> bool:
        """One liveness probe: ``GET /health`` within ``live_timeout_s``. True when the
        worker's event loop answered: any status below 500 (a worker without the route
        answers 404, alive all the same) or 503 ``draining``; False on no answer in time, a
        refused connection, or another 5xx (``engine_stopped``: its engine thread died)."""
        try:
            r = await self.health.get(w.url + "/health",
                                      timeout=httpx.Timeout(self.live_timeout_s))
        except httpx.HTTPError:
            return False
        if r.status_code < 500:
            return True
        with contextlib.suppress(ValueError):
            body = r.json()
            return isinstance(body, dict) and body.get("status") == "draining"
        return False

    async def _live_loop(self, w: Worker) -> None:
        while not self._closed:
            try:
                ok = await self.probe(w)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a probe that cannot run is a miss
                ok = False
            if ok:
                if not w.alive:
                    log.info("worker %s answers its liveness probe again", w.url)
                w.misses, w.alive = 0, True
            else:
                w.misses += 1
                if w.alive and w.misses >= self.live_misses:
                    w.alive = False
                    log.warning("worker %s out of placement: %d liveness probes in a row "
                                "unanswered within %g s", w.url, w.misses, self.live_timeout_s)
            await asyncio.sleep(self.live_interval_s)

    def mark_failed(self, w: Worker) -> None:
        """A request-path call could not reach the worker: skip it until a poll succeeds."""
        w.healthy = False
        w.failures = max(w.failures, self.unhealthy_after)

    @contextlib.contextmanager
    def calling(self, w: Worker, what: str) -> Iterator[None]:
        """Run one request-path call to ``w`` through its breaker.

        Raises:
            WorkerError: the breaker is open (``retryable``: nothing was sent), or the call
                failed (the breaker counts it when the worker is at fault).
            PoolBusy: no free connection (not counted: the router is overloaded).
        """
        if _cut_off(w.breaker):
            raise WorkerError(w.url, f"{what}: circuit open", retryable=True)
        try:
            with w.breaker.calling():
                yield
        except pybreaker.CircuitBreakerError:
            raise WorkerError(w.url, f"{what}: circuit open", retryable=True) from None

    # ------------------------------------------------------------------ calls
    async def _get(self, url: str, path: str, params: Mapping[str, Any] | None = None,
                   timeout: float | None = None) -> Any:
        """A GET off the request path (info, cache events and state) on the health client."""
        try:
            r = await self.health.get(url + path, params=params,
                                      timeout=httpx.USE_CLIENT_DEFAULT if timeout is None
                                      else httpx.Timeout(timeout,
                                                         connect=min(5.0, timeout)))
        except httpx.HTTPError as e:
            raise WorkerError(url, f"GET {path}: {e!r}", retryable=True) from None
        return _json_body(url, path, r)

    @property
    def session(self) -> aiohttp.ClientSession:
        """The request path's HTTP client (made on first use, in the running event loop)."""
        if self._session is None:
            # every call posts a JSON message (Content-Type set once); no cookies (the jar's
            # per-call filtering is pure cost) and URLs parsed once (:func:`_url`)
            self._session = aiohttp.ClientSession(
                headers={**self._headers, "Content-Type": "application/json"},
                cookie_jar=aiohttp.DummyCookieJar(),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0,
                                              sock_read=self._timeout_s))
        return self._session

    @contextlib.asynccontextmanager
    async def _slot(self, w: Worker, what: str) -> AsyncIterator[None]:
        """One of the request path's ``max_connections`` concurrent calls.

        Raises:
            PoolBusy: none free within ``pool_timeout_s``.
        """
        if self._slots.locked():  # none free: wait for one (a task and a timer)
            try:
                await asyncio.wait_for(self._slots.acquire(), self._pool_timeout_s)
            except TimeoutError:
                raise PoolBusy(w.url, f"{what}: no free connection") from None
        else:  # one is free: taken at once, without ``wait_for``'s task and timer
            await self._slots.acquire()
        try:
            yield
        finally:
            self._slots.release()

    async def _call(self, w: Worker, path: str, body: BaseModel) -> tuple[int, bytes]:
        """``POST`` a message on the request path; returns (status, body bytes).

        Raises:
            WorkerError: connection refused or failed (``retryable``), no answer within the
                call timeout (``hung``), a broken answer; ``PoolBusy``: no free connection.
        """
        async with self._slot(w, f"POST {path}"):
            try:
                async with self.session.post(_url(w.url, path),
                                             data=body.model_dump_json().encode()) as r:
                    return r.status, await r.read()
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                raise WorkerError(w.url, f"POST {path}: {e!r}", retryable=True) from None
            except TimeoutError as e:
                raise WorkerError(w.url, f"POST {path}: no answer in time: {e!r}",
                                  hung=True) from None
            except aiohttp.ClientError as e:
                raise WorkerError(w.url, f"POST {path}: {e!r}") from None

    async def _post(self, w: Worker, path: str, body: BaseModel, answer: type[M]) -> M:
        """A request-path call: ``body`` posted to ``w``, the answer validated as ``answer``.

        Raises:
            WorkerError: as :meth:`_call`; a non-2xx status (``busy`` for a 503 ``busy``),
                an answer that is not a valid ``answer``.
        """
        with self.calling(w, path):
            status, data = await self._bounded(w, self._call(w, path, body))
            _check_status(w.url, path, status, data)
            try:
                return answer.model_validate_json(data)
            except ValidationError as e:
                if e.errors()[0].get("type") == "json_invalid":
                    raise WorkerError(w.url, f"{path}: answer is not JSON") from None
                raise WorkerError(w.url, f"{path}: malformed {answer.__name__}: "
                                         f"{_first(e)}") from None

    async def _bounded(self, w: Worker, call: Any) -> Any:
        """Await an internal call in a task of its own; give up once it has waited
        ``deadline_s`` while ``w`` does not answer (:attr:`Worker.alive` or
        :attr:`Worker.healthy` false: hung or dead). A worker that answers is busy, not hung:
        it is waited for up to the call timeout, whatever its breaker says.

        The task is cancelled at most once, here: a second cancellation of the caller
        cannot interrupt the closing of its connection (see :meth:`stream`).

        Raises:
            WorkerError: ``hung``, past the deadline on an unavailable worker.
        """
        t = asyncio.ensure_future(call)
        started = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait([t], timeout=min(1.0, self.deadline_s))
                if done:
                    return t.result()
                if (time.monotonic() - started >= self.deadline_s
                        and not (w.alive and w.healthy)):
                    t.cancel()
                    raise WorkerError(w.url, f"no answer within {self.deadline_s:g} s from a "
                                             f"worker that stopped answering", hung=True)
        except asyncio.CancelledError:
            t.cancel()
            raise

    async def reserve(self, w: Worker, body: ReserveRequest) -> ReserveResponse:
        """``POST /internal/reserve`` on a decode worker.

        Raises:
            WorkerError: connection failure or timeout, non-2xx status (``busy`` set for a
                503 ``busy``), malformed answer.
        """
        return await self._post(w, "/internal/reserve", body, ReserveResponse)

    async def prefill(self, w: Worker, body: PrefillRequest) -> PrefillResponse:
        """``POST /internal/prefill`` on a prefill worker: token #1.

        Raises:
            WorkerError: as :meth:`reserve`.
        """
        return await self._post(w, "/internal/prefill", body, PrefillResponse)

    async def abort(self, w: Worker, request_id: str) -> None:
        """Best-effort ``POST /internal/abort`` (errors are logged, never raised)."""
        try:
            async with self.session.post(
                    _url(w.url, "/internal/abort"),
                    data=AbortRequest(request_id=request_id).model_dump_json().encode(),
                    timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                await r.read()
        except Exception as e:  # noqa: BLE001 - best effort
            log.info("abort %s on %s failed: %r", request_id, w.url, e)

    async def stream(self, w: Worker, body: StreamRequest) -> AsyncIterator[StreamEvent]:
        """``POST /internal/stream``: yield each SSE ``data:`` event as a ``StreamEvent``
        (:meth:`stream_batches`, one event at a time).

        Raises:
            WorkerError: as :meth:`stream_batches`.
        """
        async for batch in self.stream_batches(w, body):
            for ev in batch:
                yield ev

    async def stream_batches(self, w: Worker, body: StreamRequest
                             ) -> AsyncIterator[list[StreamEvent]]:
        """``POST /internal/stream`` on a decode worker: yield, per network read, every event
        that arrived in it (a non-empty list of ``StreamEvent`` s, in order), so the relay
        handles tokens that arrived together at once (:mod:`router.sse` parses the raw body).

        Args:
            w: The decode worker.
            body: The reserved request and token #1 as the prefill worker answered it (the
                decode worker continues from it when the transfer failed).

        Ends after an event with a ``finish_reason``, a ``data: [DONE]`` event, or the end of
        the body; the caller tells from the events whether the stream finished. The wait
        between two batches is bounded like every request-path call (:meth:`_bounded`).
        :meth:`relay_stream` is the same stream handed to a callback in the reader's task
        (the relay's path: one task wake-up less per batch).

        Raises:
            WorkerError: connection failure, non-2xx status, malformed or error event
                (``PoolBusy``: no free connection; ``hung``: no event in time).
        """
        with self.calling(w, "/internal/stream"):
            batches: asyncio.Queue = asyncio.Queue()
            last = time.monotonic()  # the reader's last batch (or the start)

            def deliver(batch: list[StreamEvent]) -> bool:
                nonlocal last
                last = time.monotonic()
                batches.put_nowait(batch)
                return False

            reader = asyncio.create_task(self._read_stream(w, body, deliver,
                                                           batches.put_nowait))
            # The bound on the wait between two batches (as :meth:`_bounded`, without a task
            # and a timer per batch): one timer per stream looks every ``min(1, deadline_s)``
            # s whether the wait has lasted ``deadline_s`` on an unavailable worker.
            loop = asyncio.get_running_loop()
            every = min(1.0, self.deadline_s, self._timeout_s)
            waiting: float | None = None  # monotonic start of the current wait
            timer: asyncio.TimerHandle | None = None

            def watch() -> None:
                nonlocal timer
                if waiting is not None and time.monotonic() - waiting >= self.deadline_s \
                        and not w.available:
                    batches.put_nowait(WorkerError(
                        w.url, f"no answer within {self.deadline_s:g} s from an unavailable "
                               f"worker", hung=True))
                    return
                if time.monotonic() - last >= self._timeout_s:
                    batches.put_nowait(self._no_event(w))
                    return
                timer = loop.call_later(every, watch)

            timer = loop.call_later(every, watch)
            try:
                while True:
                    if batches.empty():
                        waiting = time.monotonic()
                        item = await batches.get()
                        waiting = None
                    else:
                        item = batches.get_nowait()
                    if item is None:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if item[-1].finish_reason:
                        return
            finally:
                timer.cancel()
                await _stop_reader(reader, self._draining)

    async def relay_stream(self, w: Worker, body: StreamRequest,
                           handle: Callable[[list[StreamEvent]], bool]) -> None:
        """``POST /internal/stream`` on a decode worker, each batch (the events of one
        network read, as :meth:`stream_batches` yields them) passed to ``handle`` at once in
        the task that reads the body: no queue and no second task between the read and the
        relay (the router's per-event cost).

        Args:
            w / body: as :meth:`stream_batches`.
            handle: Called with each non-empty batch, in order; returns True to stop reading
                (the router finished the choice itself). Must not block; what it raises ends
                the stream and is raised here.

        A decode worker that serves decode channels (``WorkerInfo.channels``) sends the
        stream on this process's channel to it (:meth:`_attach`): ``handle`` is then called
        in the channel's reader task, with the events of one network read of the channel.

        Returns once the stream ended (an event with a ``finish_reason``, ``data: [DONE]``,
        the end of the body) or ``handle`` returned True. The wait between two batches is
        bounded as in :meth:`stream_batches` (``deadline_s`` on an unavailable worker).

        Raises:
            WorkerError: as :meth:`stream_batches`; whatever ``handle`` raised.
        """
        with self.calling(w, "/internal/stream"):
            loop = asyncio.get_running_loop()
            ended: asyncio.Future = loop.create_future()
            last = time.monotonic()  # the last batch (or the start): the wait's start

            def end(item: BaseException | None) -> None:
                if not ended.done():
                    ended.set_result(item)

            def deliver(batch: list[StreamEvent]) -> bool:
                nonlocal last
                last = time.monotonic()
                try:
                    return handle(batch) or bool(batch[-1].finish_reason)
                except BaseException as e:  # noqa: BLE001 - raised by relay_stream
                    end(e)
                    return True

            def reader_done(t: asyncio.Task) -> None:  # a reader that died of a bug
                end(None if t.cancelled() or t.exception() is None else t.exception())

            if self.channels and w.info.channels:  # on the worker's decode channel
                stop = await self._attach(w, body, deliver, end, ended)
            else:  # a stream of its own, read in a task
                reader = asyncio.create_task(self._read_stream(w, body, deliver, end))
                reader.add_done_callback(reader_done)
                stop = functools.partial(_stop_reader, reader, self._draining)
            every = min(1.0, self.deadline_s, self._timeout_s)
            timer: asyncio.TimerHandle | None = None

            def watch() -> None:
                nonlocal timer
                waited = time.monotonic() - last
                if waited >= self.deadline_s and not w.available:
                    end(WorkerError(w.url, f"no answer within {self.deadline_s:g} s from an "
                                           f"unavailable worker", hung=True))
                    return
                if waited >= self._timeout_s:
                    end(self._no_event(w))
                    return
                timer = loop.call_later(every, watch)

            timer = loop.call_later(every, watch)
            try:
                item = await ended
                if item is not None:
                    raise item
            finally:
                timer.cancel()
                await stop()

    async def _attach(self, w: Worker, body: StreamRequest,
                      deliver: Callable[[list[StreamEvent]], bool],
                      end: Callable[[BaseException | None], None],
                      ended: asyncio.Future) -> Callable[[], Awaitable[None]]:
        """Send ``body``'s stream on this process's decode channel to ``w`` (opened first
        when it is not open): ``deliver`` / ``end`` as :meth:`_read_stream` calls them, from
        the channel's reader; ``ended``: done once ``end`` was called. Returns the coroutine
        function that detaches the stream: one the worker did not end (a watcher gave up on
        it, the caller went away) is aborted there too, as closing a stream of its own does.

        A channel the worker no longer knows (409 ``unknown_channel``: it restarted, or the
        channel's connection just dropped) is opened again once, unless the stream already
        ended meanwhile (the old channel's end reached it).

        Raises:
            WorkerError: the channel could not be opened, or the attach call failed (as
                :meth:`_post`); ``PoolBusy``: no free connection for the call.
        """
        ch = self._channels.get(w.url)
        if ch is None:
            ch = self._channels[w.url] = DecodeChannel(self, w)
        key = body.request_id.encode()
        for again in (False, True):
            cid = ch.open_id or await self._bounded(w, ch.open())
            try:
                ch.attach(cid, key, deliver, end)
                status, data = await self._bounded(w, self._call(
                    w, "/internal/attach", AttachRequest(channel=cid, **body.model_dump())))
                _check_status(w.url, "/internal/attach", status, data)
            except WorkerError as e:
                ch.detach(cid, key)
                if e.code == "unknown_channel" and not again and not ended.done():
                    ch.close(cid)
                    continue
                raise
            except BaseException:
                if ch.detach(cid, key):  # the worker may have taken it: end it there
                    self._spawn(self.abort(w, body.request_id))
                raise
            break

        async def detach() -> None:
            if ch.detach(cid, key):  # still streaming on the worker: stop it there
                self._spawn(self.abort(w, body.request_id))

        return detach

    def _spawn(self, aw: Any) -> None:
        """Run ``aw`` (a coroutine or a task) in the background, kept until it ends;
        cancelled by :meth:`close`."""
        t = asyncio.ensure_future(aw)
        self._closing.add(t)
        t.add_done_callback(self._closing.discard)

    async def _drain(self, r: aiohttp.ClientResponse) -> None:
        """Read what is left of a decode stream's body after D ended the stream (``[DONE]``,
        the chunked end: they follow at once), for ``DRAIN_S`` at most, so that its
        connection goes back to the pool: aiohttp closes a connection whose response was
        left unread, and every stream then paid for a new connection on both sides. The
        reader is not cancelled meanwhile (:func:`_stop_reader`); a body that does not end in
        time, or fails, just closes its connection."""
        me = asyncio.current_task()
        self._draining.add(me)
        try:
            async with asyncio.timeout(DRAIN_S):
                async for _ in r.content.iter_any():
                    pass
        except (TimeoutError, aiohttp.ClientError):
            pass
        finally:
            self._draining.discard(me)

    def _no_event(self, w: Worker) -> WorkerError:
        """A decode stream that sent nothing for ``timeout_s``."""
        return WorkerError(w.url, f"stream: no event within {self._timeout_s:g} s", hung=True)

    async def _read_stream(self, w: Worker, body: StreamRequest,
                           deliver: Callable[[list[StreamEvent]], bool],
                           end: Callable[[BaseException | None], None]) -> None:
        """Read D's SSE stream: ``deliver`` a list of ``StreamEvent`` s per network read (it
        returns True to stop reading), then ``end(None)`` at the end, or ``end`` of the
        ``WorkerError`` that ended it (after the events before it were delivered). The events
        are decoded by :func:`router.sse.decode_event` (the same message, msgspec's decoder:
        :class:`router.sse.StreamEventWire`)."""
        try:
            async with self._slot(w, "stream"), self.session.post(
                    _url(w.url, "/internal/stream"), data=body.model_dump_json().encode(),
                    headers=_STREAM_HEADERS,
                    # the wait between two events is bounded by the stream's watcher
                    # (``timeout_s``, :meth:`relay_stream`), not by aiohttp's read timeout,
                    # which re-arms a timer on every network read of the stream
                    timeout=self._stream_timeout) as r:
                if r.status // 100 != 2:
                    text = (await r.read()).decode("utf-8", "replace")
                    raise WorkerError(w.url, f"stream: HTTP {r.status}: {text[:200]}",
                                      retryable=r.status == 503, status=r.status)
                sse = SSEReader()
                done = ended = False  # ended: D ended the stream (a finish, or [DONE])
                async for chunk in r.content.iter_any():
                    batch: list[StreamEvent] = []
                    failed: WorkerError | None = None
                    try:
                        for data in sse.feed(chunk):
                            ev = _stream_event(w.url, data)
                            if ev is None:
                                done = ended = True
                                break
                            batch.append(ev)
                            if ev.finish_reason:
                                done = ended = True
                                break
                    except WorkerError as e:  # after the events before it
                        failed = e
                    if batch and deliver(batch):
                        # stopped by the consumer: if D's end was not in this batch, what
                        # follows is not its news (the router aborts the request on D); if it
                        # was (the finish it stopped at), the rest of the body is drained
                        done = True
                    elif failed is not None:
                        raise failed
                    if done:
                        break
                if ended and not r.content.at_eof():
                    end(None)  # the consumer has the end; the rest of the body follows
                    await self._drain(r)
                    return
            end(None)
        except WorkerError as e:
            end(e)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            end(WorkerError(w.url, f"stream: {e!r}", retryable=True))
        except TimeoutError as e:
            end(WorkerError(w.url, f"stream: no event in time: {e!r}", hung=True))
        except aiohttp.ClientError as e:
            end(WorkerError(w.url, f"stream: {e!r}"))


_STREAM_HEADERS = {"Accept": "text/event-stream", "Cache-Control": "no-store"}
#: A decode channel: its worker writes at least a keep-alive every ``CHANNEL_PING_S``; one
#: silent for 3 × that is given up (its streams fail, the next attach opens a new one).
_CHANNEL_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5.0,
                                         sock_read=3 * CHANNEL_PING_S)


def _stream_event(url: str, data: bytes) -> StreamEvent | None:
    """One ``data:`` payload of decode worker ``url``'s stream (its own, or its part of a
    channel) as a ``StreamEvent`` (:func:`router.sse.decode_event`); ``None`` for ``[DONE]``.

    Raises:
        WorkerError: a malformed event, or an error event without tokens.
    """
    if data.strip() == b"[DONE]":
        return None
    try:
        ev = decode_event(data)
    except ValueError as e:
        raise WorkerError(url, f"stream: malformed StreamEvent: {e}") from None
    if ev.error is not None and not ev.token_ids:
        raise WorkerError(url, f"stream: {ev.error}")
    return ev


@functools.lru_cache(maxsize=4096)
def _url(base: str, path: str) -> yarl.URL:
    """A request-path URL, parsed once (a worker's base URL and one of the few paths)."""
    return yarl.URL(base + path)


class DecodeChannel:
    """This router process's decode channel to one decode worker: ``POST /internal/channel``
    held open in a task of its own (:meth:`open`), whose body carries the token streams of
    every request attached to it (:meth:`WorkerPool._attach`), each event tagged with its
    request id (:class:`k3serve.messages.ChannelRequest`). Per network read of the channel,
    each attached request's events go to its ``deliver`` as one batch, in order, and its
    stream ends as it would on a stream of its own: ``end(None)`` after a ``finish_reason``,
    ``[DONE]``, or ``deliver`` returning True; ``end`` of a ``WorkerError`` after an error
    or malformed event. A channel whose body ends or fails ends every stream on it with a
    ``WorkerError`` (migration takes them on); the next attach opens a new channel.

    The router then reads one connection per decode worker, and the events of many requests
    that one worker wrote together in one network read (issue 19: the per-read cost of the
    HTTP client and the event loop is paid per worker write, not per request).

    Args:
        pool: the router's pool (its session and timeouts).
        w: the decode worker.
    """

    def __init__(self, pool: WorkerPool, w: Worker) -> None:
        self.pool, self.w = pool, w
        self.cid = ""
        self.task: asyncio.Task | None = None
        self._opened: asyncio.Future | None = None
        self._subs: dict[bytes, tuple[Callable[[list[StreamEvent]], bool],
                                      Callable[[BaseException | None], None]]] = {}

    @property
    def open_id(self) -> str | None:
        """The id of the channel when it is open (the worker answered it), else ``None``."""
        t, opened = self.task, self._opened
        if t is None or t.done() or opened is None or not opened.done():
            return None
        return self.cid if opened.exception() is None else None

    async def open(self) -> str:
        """The channel's id, once the worker has answered its ``POST /internal/channel``
        (opened now when it is not open).

        Raises:
            WorkerError: the worker refused it or could not be reached; ``hung``: no answer
                within the call timeout (``timeout_s``).
        """
        if self.task is None or self.task.done():
            self.cid = secrets.token_hex(8)
            self._subs = {}
            self._opened = asyncio.get_running_loop().create_future()
            self.task = asyncio.create_task(self._run(self.cid, self._opened, self._subs))
        try:  # shielded: a caller that goes away leaves it opening for the others
            await asyncio.wait_for(asyncio.shield(self._opened), self.pool._timeout_s)
        except TimeoutError:
            self.close(self.cid)
            raise WorkerError(self.w.url, f"channel: not answered within "
                                          f"{self.pool._timeout_s:g} s", hung=True) from None
        return self.cid

    def attach(self, cid: str, rid: bytes, deliver: Callable[[list[StreamEvent]], bool],
               end: Callable[[BaseException | None], None]) -> None:
        """Route the events of request ``rid`` (its id, ASCII bytes) on channel ``cid`` (as
        :meth:`open` returned it) to ``deliver``/``end``.

        Raises:
            WorkerError: ``cid`` is not the open channel any more (retryable, code
                ``unknown_channel``: open it again).
        """
        if cid != self.cid or self.task is None or self.task.done():
            raise WorkerError(self.w.url, "channel: closed", retryable=True,
                              code="unknown_channel")
        self._subs[rid] = (deliver, end)

    def detach(self, cid: str, rid: bytes) -> bool:
        """Drop request ``rid`` of channel ``cid``: what the worker still sends for it is
        ignored. Returns whether it was still attached (its stream had not ended)."""
        return cid == self.cid and self._subs.pop(rid, None) is not None

    def close(self, cid: str | None = None) -> None:
        """End the channel (``cid``: only if it is still the open one); its streams end with
        a ``WorkerError`` and the next :meth:`open` opens a new one at once."""
        if self.task is not None and (cid is None or cid == self.cid):
            self.task.cancel()
            self.pool._spawn(self.task)  # kept (and awaited by the pool's close) as it ends
            self.task = None

    async def _run(self, cid: str, opened: asyncio.Future,
                   subs: dict[bytes, tuple[Callable[[list[StreamEvent]], bool],
                                           Callable[[BaseException | None], None]]]) -> None:
        w, pool = self.w, self.pool
        err: WorkerError | None = None
        try:
            async with pool.session.post(
                    _url(w.url, "/internal/channel"),
                    data=ChannelRequest(channel=cid).model_dump_json().encode(),
                    headers=_STREAM_HEADERS, timeout=_CHANNEL_TIMEOUT) as r:
                if r.status // 100 != 2:
                    data = await r.read()
                    _check_status(w.url, "/internal/channel", r.status, data)
                opened.set_result(None)
                sse = SSEReader()
                async for chunk in r.content.iter_any():
                    self._dispatch(sse.feed_tagged(chunk), subs)
            err = WorkerError(w.url, "channel: the decode worker ended it")
        except WorkerError as e:
            err = e
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            err = WorkerError(w.url, f"channel: {e!r}", retryable=True)
        except aiohttp.ClientError as e:
            err = WorkerError(w.url, f"channel: {e!r}")
        except asyncio.CancelledError:
            err = WorkerError(w.url, "channel: closed by the router", retryable=True)
            raise
        except Exception as e:  # a bug here must not leave the channel's streams hanging
            log.exception("decode channel to %s failed", w.url)
            err = WorkerError(w.url, f"channel: {e!r}")
        finally:
            if not opened.done():
                opened.set_exception(err)
                opened.exception()  # retrieved: nobody may be waiting any more
            ends = [end for _, end in subs.values()]
            subs.clear()
            for end in ends:
                end(err)
            if pool.workers.get(w.url) is not w and pool._channels.get(w.url) is self:
                del pool._channels[w.url]  # the worker is gone: forget its channel

    def _dispatch(self, items: list[tuple[bytes, bytes]],
                  subs: dict[bytes, tuple[Callable[[list[StreamEvent]], bool],
                                          Callable[[BaseException | None], None]]]) -> None:
        """One network read of the channel: each attached request's events as one batch."""
        url = self.w.url
        batches: dict[bytes, list[StreamEvent]] = {}

        def finish(rid: bytes, err: BaseException | None) -> None:
            deliver, end = subs.pop(rid)
            batch = batches.pop(rid, None)
            if batch:
                deliver(batch)
            end(err)

        for rid, data in items:
            if rid not in subs:  # detached (the router finished it first), or not ours
                continue
            try:
                ev = _stream_event(url, data)
            except WorkerError as e:
                finish(rid, e)
                continue
            if ev is None:  # [DONE]
                finish(rid, None)
                continue
            batch = batches.get(rid)
            if batch is None:
                batches[rid] = [ev]
            else:
                batch.append(ev)
            if ev.finish_reason:
                finish(rid, None)
        for rid, batch in batches.items():
            deliver, end = subs[rid]
            if deliver(batch):  # the consumer stopped: what follows is not its news
                del subs[rid]
                end(None)


async def relay_batches(batches: AsyncIterator[list[StreamEvent]],
                        handle: Callable[[list[StreamEvent]], bool]) -> None:
    """Pass each batch of ``batches`` (e.g. :meth:`WorkerPool.stream_batches`) to
    ``handle`` until it returns True or they end: :meth:`WorkerPool.relay_stream`'s contract
    over any batch iterator (a scripted pool in tests)."""
    async for batch in batches:
        if handle(batch):
            break


#: Longest a stream's reader reads the rest of a body after D ended the stream (s).
DRAIN_S = 1.0


async def _stop_reader(reader: asyncio.Task, draining: set[asyncio.Task]) -> None:
    """Cancel a stream's reader task once and wait (5 s at most) for it to end; a reader in
    ``draining`` (reading the rest of a body D ended, :meth:`WorkerPool._drain`) is left to
    end by itself (within ``DRAIN_S``).

    The reader owns the connection and is cancelled once, here: a close that a second
    cancellation interrupts (a client that goes away cancels its choices more than once)
    leaves the connection checked out of the pool for good, and a pool of such connections
    starves every later call.
    """
    if reader in draining:
        return
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait([reader], timeout=5.0)


def check_parallel(url: str, info: WorkerInfo, others: list[Worker]) -> None:
    """Refuse a worker whose ``tp`` differs from a registered worker's: a prefill instance hands
    its cache only to a decode instance of the same tensor-parallel degree (issue 16; the
    kvstore pairing would refuse every such request), so the router never pairs them.

    Raises:
        ValueError: naming ``tp`` and both workers.
    """
    for o in others:
        if o.info.tp != info.tp:
            raise ValueError(
                f"tp: worker {url} ({info.role}) has tp={info.tp}; registered worker {o.url} "
                f"({o.info.role}) has tp={o.info.tp} (one tensor-parallel degree per cluster: "
                f"prefill and decode caches are exchanged rank for rank)")


def _check_status(url: str, path: str, status: int, data: bytes) -> None:
    """Raise ``WorkerError`` for a non-2xx answer (``busy``: a 503 whose body is
    ``{"error": "busy", ...}``)."""
    if status // 100 == 2:
        return
    err: Any = None
    with contextlib.suppress(ValueError):
        err = json.loads(data)
    code = err.get("error") if isinstance(err, dict) else None
    detail = err.get("message") if isinstance(err, dict) else None
    text = data.decode("utf-8", "replace")
    raise WorkerError(url, f"{path}: HTTP {status}: {text[:300]}", retryable=status == 503,
                      busy=status == 503 and code == "busy", status=status,
                      code=code if isinstance(code, str) else None,
                      detail=detail if isinstance(detail, str) else None)


def _json_body(url: str, path: str, r: httpx.Response) -> Any:
    if r.status_code // 100 != 2:
        err: Any = None
        with contextlib.suppress(ValueError):
            err = r.json()
        code = err.get("error") if isinstance(err, dict) else None
        detail = err.get("message") if isinstance(err, dict) else None
        busy = r.status_code == 503 and code == "busy"
        raise WorkerError(url, f"{path}: HTTP {r.status_code}: {r.text[:300]}",
                          retryable=r.status_code == 503, busy=busy, status=r.status_code,
                          code=code if isinstance(code, str) else None,
                          detail=detail if isinstance(detail, str) else None)
    try:
        return r.json()
    except (json.JSONDecodeError, ValueError):
        raise WorkerError(url, f"{path}: answer is not JSON") from None


def _parse(model: type[M], url: str, path: str, body: Any) -> M:
    """Validate an internal answer with its message model.

    Raises:
        WorkerError: the answer does not fit the model (the first error is named).
    """
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise WorkerError(url, f"{path}: malformed {model.__name__}: {_first(e)}") from None


def _first(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    return f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))
