"""The router's cache index, kept in sync with its workers' cache events.

One poller per worker pulls ``GET /internal/cache_events?after=SEQ`` into the
:class:`~router.index.GlobalIndex` (``GET /internal/cache_state`` on a new epoch or a gap)
and doubles as the health check: ``unhealthy_after`` failed pulls in a row mark the worker
unhealthy (placement skips it), one success marks it healthy again. A prefill answer's cache
events are applied at once (:meth:`IndexSync.answered`); without them the worker's events are
pulled at once (:meth:`IndexSync.kick`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from k3serve.messages import CacheEvents
from router.client import WorkerClient
from router.index import GlobalIndex, PrefixMatch, ResyncNeeded
from router.workers import Worker, WorkerError

log = logging.getLogger("k3serve.router")


class IndexSync:
    """Pulls, applies and kicks the cache events of every registered worker.

    Args:
        client: The calls to the workers (the health client's reads).
        index: The index the events go into.
        workers: The registered workers by URL (:attr:`WorkerRegistry.workers`, read only:
            an answer of a worker removed meanwhile is dropped).
        poll_interval_s: Seconds between cache-event pulls of one worker.
        poll_timeout_s: Timeout of one cache-event pull (the health check): a worker that is
            alive but stuck (stopped, wedged) fails its polls and leaves placement.
        unhealthy_after: Failed pulls in a row that mark a worker unhealthy.
    """

    def __init__(self, client: WorkerClient, index: GlobalIndex, workers: Mapping[str, Worker],
                 poll_interval_s: float = 0.1, poll_timeout_s: float = 10.0,
                 unhealthy_after: int = 3) -> None:
        self.client, self.index, self.workers = client, index, workers
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self.unhealthy_after = unhealthy_after
        self.closed = False
        #: the router is stopping (:meth:`router.pool.WorkerPool.begin_stop`): workers that
        #: drain and exit are expected to stop answering; their polls failing is logged at INFO
        self.stopping = False
        #: Called as ``on_resync(url, before)`` after a worker's state was loaded under a new
        #: epoch (the worker restarted with an empty cache): what the router recorded of the
        #: prompts it sent there before ``before`` (monotonic seconds: when the pull that
        #: saw the new epoch was sent) is void
        #: (:meth:`router.recent.RecentPlacements.forget`). Not called on a worker's first
        #: load (nothing was sent to an earlier process) nor on a gap within one epoch (the
        #: worker kept its cache): a prompt placed there while the state was being read is
        #: being computed by that very process, and its record is what lets the next
        #: request that extends it find it before its cache events arrive.
        self.on_resync: Callable[[str, float], None] | None = None
        #: Monotonic seconds, the clock of ``before`` (placement records on the same clock).
        self.clock: Callable[[], float] = time.monotonic

    async def close(self) -> None:
        """Stop every poller and kick."""
        self.closed = True
        tasks = [t for w in self.workers.values() for t in (w.task, w.kick_task) if t]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def start(self, w: Worker) -> None:
        """A worker (re-)registered: pull its events now, then poll them in a task of its own.

        Raises:
            WorkerError: as :meth:`sync`.
        """
        await self.pull(w)
        if w.task is None or w.task.done():
            w.task = asyncio.create_task(self._poll_loop(w), name=f"poll {w.url}")

    def stop(self, w: Worker) -> None:
        """A worker was removed: its poller and kick stop."""
        for t in (w.task, w.kick_task):
            if t is not None:
                t.cancel()

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
            epoch, after = self.index.cursor(w.url)
            asked = self.clock()
            body = await self.client.get(w.url, "/internal/cache_events", {"after": after},
                                   timeout=self.poll_timeout_s)
            try:
                events = self.index.parse_events(w.url, body)
                self.absorb(w, events)
            except ResyncNeeded as e:
                log.info("resync %s: %s", w.url, e)
                state = await self.client.get(w.url, "/internal/cache_state")
                try:
                    self.index.load_state(w.url, state)
                except ValueError as e2:
                    raise WorkerError(w.url, str(e2)) from None
                w.resyncs += 1
                restarted = epoch is not None and self.index.cursor(w.url)[0] != epoch
                if restarted and self.on_resync:
                    self.on_resync(w.url, asked)
                return
            if self.index.cursor(w.url)[1] >= events.last_seq:
                return

    def absorb(self, w: Worker, events: CacheEvents) -> None:
        """Apply one ``CacheEvents`` answer of ``w`` (a poll's, or a prefill answer's):
        its load report, its events into the index (those at or before the cursor are
        skipped there: overlapping answers apply each event once, in ``seq`` order), and the
        new local MLA blocks among them to the router's account of the worker (:attr:`Worker.seen`)
        when it reports no prefill counters, counted from the cursor as it is now, so an event
        two answers carry counts once.
        Synchronous: no other pull can apply events in between.

        Raises:
            ResyncNeeded: as :meth:`GlobalIndex.apply_events` (nothing of the events applied).
        """
        w.report(events.load, events.epoch, events.last_seq)
        before = self.index.cursor(w.url)[1]
        self.index.apply_events(w.url, events)
        # computed blocks (new, local MLA blocks): the pool account of a worker that does
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
        applied at once (:meth:`absorb`) — no pull. Without them (a worker that does not
        send them), or when they cannot be applied (another epoch: the worker restarted; a
        gap) or do not reach the worker's newest event (the answer's page was full), the
        worker's events are pulled now instead (:meth:`kick`)."""
        if w.url not in self.workers:  # removed meanwhile (drained, moved)
            return
        if events is not None:
            try:
                self.absorb(w, events)
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
        if self.closed:
            return
        w.kick_wanted = True
        if w.kick_task is not None and not w.kick_task.done():
            return

        async def pull() -> None:
            while w.kick_wanted and not self.closed:
                async with w.sync_lock:
                    w.kick_wanted = False  # kicks from here on need a pull after this one
                    with contextlib.suppress(Exception):
                        await self.sync(w)

        w.kick_task = asyncio.get_running_loop().create_task(pull(), name=f"kick {w.url}")

    async def _poll_loop(self, w: Worker) -> None:
        while not self.closed:
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
                    log.log(logging.INFO if self.stopping else logging.WARNING,
                            "worker %s unhealthy after %d failed polls: %s", w.url, w.failures,
                            e)
            await asyncio.sleep(self.poll_interval_s)
