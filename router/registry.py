"""The router's registry of workers: registration, liveness, and who placement may use.

Workers register with ``POST /internal/register`` (and again after a restart); the registry
reads ``GET /internal/info`` (:class:`~k3serve.messages.WorkerInfo`), refuses a worker that
does not fit the cluster (model, cache layout, tensor-parallel degree), and keeps one liveness
probe per worker (``GET /health``). A worker's cache-event pulls double as its health check
(:class:`~router.index_sync.IndexSync`): ``unhealthy_after`` failed pulls in a row mark it
unhealthy, one success healthy again. Placement uses the workers that are healthy, alive and
whose breaker is not open (:meth:`WorkerRegistry.live`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from k3serve.messages import WorkerInfo
from router.client import WorkerClient, parse
from router.index import GlobalIndex
from router.workers import Breaker, Worker, WorkerError, check_parallel

log = logging.getLogger("k3serve.router")


class WorkerRegistry:
    """The registered workers, by URL, in registration order, and their liveness probes.

    Args:
        model: The served model name; workers of another model are refused.
        client: The calls to the workers (info reads, probes).
        index: The cache index: a worker's entry is added and removed with it.
        poll_timeout_s: Timeout of a registration's info read, seconds.
        unhealthy_after: Failed pulls in a row that mark a worker unhealthy
            (:meth:`mark_failed` sets it at once).
        breaker_fail_max: Request-path failures in a row that open a worker's breaker.
        breaker_reset_s: Seconds an open breaker waits before a trial request.
        live_interval_s / live_timeout_s / live_misses: the liveness probe, a task per worker
            on the health client: ``GET /health`` every ``live_interval_s``, which the worker
            answers on its event loop without waiting for its engine thread (a worker busy
            computing answers it at once; its cache-event pulls wait for the engine thread
            between two steps, so their timeout must stay long). ``live_misses`` probes in a
            row with no answer within ``live_timeout_s`` (or an answer 5xx other than
            ``draining``) take the worker out of placement (:attr:`Worker.alive`): a stopped
            (``SIGSTOP``) or wedged process leaves within
            ``live_misses × (live_interval_s + live_timeout_s)`` seconds; one answer brings
            it back.
        on_worker: Called with each worker once registered (metrics series).
        on_register: Awaited with each worker at every registration, before it is announced
            (the first pull of its cache events and its poller, :mod:`router.index_sync`).
        on_remove: Called with each worker removed (its poller stops).
        on_forget: Called with the worker's URL when what the router recorded of its cache
            is void: it was removed, or it registered again (a restart: a new event epoch,
            an empty cache) — :meth:`router.recent.RecentPlacements.forget`.
    """

    def __init__(self, model: str, client: WorkerClient, index: GlobalIndex,
                 poll_timeout_s: float = 10.0, unhealthy_after: int = 3,
                 breaker_fail_max: int = 3, breaker_reset_s: float = 5.0,
                 live_interval_s: float = 0.5, live_timeout_s: float = 1.5,
                 live_misses: int = 2,
                 on_worker: Callable[[Worker], None] | None = None,
                 on_register: Callable[[Worker], Awaitable[None]] | None = None,
                 on_remove: Callable[[Worker], None] | None = None,
                 on_forget: Callable[[str], None] | None = None) -> None:
        self.model = model
        self.client, self.index = client, index
        self.poll_timeout_s = poll_timeout_s
        self.unhealthy_after = unhealthy_after
        self.breaker_fail_max = breaker_fail_max
        self.breaker_reset_s = breaker_reset_s
        self.live_interval_s = live_interval_s
        self.live_timeout_s = live_timeout_s
        self.live_misses = live_misses
        self.on_worker, self.on_register, self.on_remove = on_worker, on_register, on_remove
        self.on_forget = on_forget
        self.workers: dict[str, Worker] = {}
        self.closed = False
        #: the router is stopping: unanswered liveness probes are logged at INFO (the workers
        #: drain and exit; :meth:`router.pool.WorkerPool.begin_stop`)
        self.stopping = False

    async def close(self) -> None:
        """Stop every liveness probe."""
        self.closed = True
        tasks = [w.live_task for w in self.workers.values() if w.live_task]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def register(self, url: str) -> Worker:
        """Register (or re-register) the worker at ``url`` after reading its info.

        Raises:
            WorkerError: its info cannot be read or is malformed.
            ValueError: it serves another model, or changed role under the same URL, or its
                tensor-parallel degree differs from a registered worker's (:func:`check_parallel`).
        """
        url = url.rstrip("/")
        info = parse(WorkerInfo, url, "/internal/info",
                      await self.client.get(url, "/internal/info", timeout=self.poll_timeout_s))
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
            w = Worker(url, info, breaker=Breaker(url, self.breaker_fail_max,
                                                  self.breaker_reset_s))
            self.workers[url] = w
            self.index.add_worker(url)
            if self.on_worker:
                self.on_worker(w)
        else:  # a restart: new info, same load account; the new epoch forces a resync
            w.info, w.healthy, w.failures, w.alive, w.misses = info, True, 0, True, 0
            w.breaker.close()
            if self.on_forget:
                self.on_forget(w.url)
        if self.on_register:
            await self.on_register(w)
        if w.live_task is None or w.live_task.done():
            w.live_task = asyncio.create_task(self._live_loop(w), name=f"live {url}")
        log.info("registered %s worker %s (%s)", info.role, w.name, url)
        return w

    async def _answers_as(self, w: Worker, worker_id: str) -> bool:
        """Whether ``w``'s URL still answers ``/internal/info`` as ``worker_id`` (2 s)."""
        try:
            body = await self.client.get(w.url, "/internal/info", timeout=2.0)
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
        if w.live_task is not None:
            w.live_task.cancel()
        if self.on_remove:
            self.on_remove(w)
        if self.on_forget:
            self.on_forget(w.url)
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

    async def _live_loop(self, w: Worker) -> None:
        while not self.closed:
            try:
                ok = await self.client.probe(w, self.live_timeout_s)
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
                    log.log(logging.INFO if self.stopping else logging.WARNING,
                            "worker %s out of placement: %d liveness probes in a row "
                            "unanswered within %g s", w.url, w.misses, self.live_timeout_s)
            await asyncio.sleep(self.live_interval_s)

    def mark_failed(self, w: Worker) -> None:
        """A request-path call could not reach the worker: skip it until a poll succeeds."""
        w.healthy = False
        w.failures = max(w.failures, self.unhealthy_after)
