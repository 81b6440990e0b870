"""One worker as the router knows it: its record, its load account and its breaker.

:class:`Worker` is the router's account of one registered worker (what it reported, what the
router sent it); :class:`~router.registry.WorkerRegistry` keeps them, :mod:`router.client`
calls them, :mod:`router.index_sync` feeds their cache events to the ``GlobalIndex``.

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
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pybreaker

from k3serve.messages import WorkerInfo, WorkerLoad
from router.policies.load import PoolLoad, RecentLoad

log = logging.getLogger("k3serve.router")

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



def worker_fault(e: BaseException) -> bool:
    """``e`` is a :class:`WorkerError` the worker is at fault for (its breaker counts it)."""
    return isinstance(e, WorkerError) and e.fault


class Breaker(pybreaker.CircuitBreaker):
    """A worker's circuit breaker: :mod:`pybreaker`'s, counting only :func:`worker_fault`
    errors, with :attr:`cut_off`.

    Args:
        name: The worker's URL (the log line of a state change).
        fail_max: Failures in a row that open it.
        reset_timeout: Seconds an open breaker waits before one trial call.
    """

    def __init__(self, name: str | None = None, fail_max: int = 3,
                 reset_timeout: float = 5.0) -> None:
        super().__init__(fail_max=fail_max, reset_timeout=reset_timeout,
                         exclude=[lambda e: not worker_fault(e)], name=name,
                         listeners=[BreakerLog()] if name else (),
                         throw_new_error_on_trip=False)

    @property
    def cut_off(self) -> bool:
        """The breaker is open and its reset timeout has not elapsed (no trial call yet)."""
        if self.current_state != pybreaker.STATE_OPEN:
            return False
        opened = self._state_storage.opened_at  # pybreaker keeps no public accessor for it
        return opened is None or (datetime.now(UTC) - opened).total_seconds() < self.reset_timeout


class BreakerLog(pybreaker.CircuitBreakerListener):
    """Logs a breaker's state changes (a warning naming the worker)."""

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
    # one event pull at a time per worker (:meth:`router.index_sync.IndexSync.pull`: polls, kicks, the rest)
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
        the larger (a prefill sent after the report and already answered is not queued).

        What is left of the report: its tokens less those the worker computed since at
        ``rate`` (a work-conserving worker, the fluid model: ``max(0, Q − rate · age)``), less
        this router's prefills that were running when it came (it may count them) and were
        answered since: a report up to a poll old may still count a prefill answered since,
        which every router replica would price differently.

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
    def measured_rate(self) -> float:
        """The worker's measured prefill rate, tokens/s, from its last load report
        (``WorkerLoad.prefill_rate``); 0.0 when it reported none."""
        r = self.reported
        return r.prefill_rate or 0.0 if r is not None else 0.0

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

    breaker: Breaker = field(default_factory=Breaker, repr=False)

    @property
    def available(self) -> bool:
        """Placement may use it: healthy (its polls answer), alive (its liveness probe
        answers) and its breaker not open."""
        return self.healthy and self.alive and not self.breaker.cut_off

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


def check_parallel(url: str, info: WorkerInfo, others: list[Worker]) -> None:
    """Refuse a worker whose ``tp`` differs from a registered worker's: a prefill instance hands
    its cache only to a decode instance of the same tensor-parallel degree (the
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
