"""The router's worker layer, wired together: registry, client, index sync, decode streams.

:class:`WorkerPool` builds the four parts of one router process and closes them; each has
one job:

* :class:`~router.registry.WorkerRegistry` (:attr:`WorkerPool.registry`): the workers,
  their registration and liveness, who placement may use;
* :class:`~router.client.WorkerClient` (:attr:`WorkerPool.client`): every call to a worker
  (breakers, deadlines, typed messages);
* :class:`~router.index_sync.IndexSync` (:attr:`WorkerPool.index_sync`): cache-event polls
  and prefill answers into the :class:`~router.index.GlobalIndex`;
* :class:`~router.decode_stream.DecodeStreams` (:attr:`WorkerPool.streams`): a choice's
  decode stream, over the worker's decode channel or a stream of its own;
* :class:`~router.recent.RecentPlacements` (:attr:`WorkerPool.recent`): where placement just
  sent prompts, before the workers' cache events report them (a worker's entries are
  forgotten when it leaves or registers again).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import httpx

from router.channel import DecodeChannels
from router.client import WorkerClient
from router.config import RouterConfig
from router.decode_stream import DecodeStreams
from router.index import GlobalIndex
from router.index_sync import IndexSync
from router.recent import RecentPlacements
from router.registry import WorkerRegistry
from router.workers import Worker

#: Seconds a placement counts as a pending hit on its worker (the prefill and the cache
#: events that report it arrive well within it).
RECENT_TTL_S = 30.0


class WorkerPool:
    """The worker layer of one router process.

    Args:
        model: The served model name; workers of another model are refused.
        cluster_token: Sent on every internal call; ``None`` sends none.
        poll_interval_s: Seconds between cache-event pulls of one worker.
        unhealthy_after: Failed pulls in a row that mark a worker unhealthy.
        timeout_s: Timeout of one internal call (a stream: between two events).
        transport: httpx transport of the health client (registration reads, cache-event
            polls, liveness probes); the request path always goes over the network.
        on_worker: Called with each worker once registered (metrics series).
        poll_timeout_s / deadline_s / pool_timeout_s / max_connections: see
            :class:`~router.client.WorkerClient` and :class:`~router.index_sync.IndexSync`.
        breaker_fail_max / breaker_reset_s / live_interval_s / live_timeout_s / live_misses:
            see :class:`~router.registry.WorkerRegistry`.
        channels: read decode streams on decode channels where the worker serves them
            (:class:`~router.decode_stream.DecodeStreams`).

    Attributes:
        index: The cache index.
        recent: Where placement just sent prompts (entries live :data:`RECENT_TTL_S`).
        workers: The registered workers by URL (the registry's).
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
        self.index = GlobalIndex()
        self.recent = RecentPlacements(RECENT_TTL_S)
        self.client = WorkerClient(cluster_token, timeout_s, transport,
                                   poll_timeout_s=poll_timeout_s, deadline_s=deadline_s,
                                   pool_timeout_s=pool_timeout_s,
                                   max_connections=max_connections)
        self.registry = WorkerRegistry(
            model, self.client, self.index, poll_timeout_s=poll_timeout_s,
            unhealthy_after=unhealthy_after, breaker_fail_max=breaker_fail_max,
            breaker_reset_s=breaker_reset_s, live_interval_s=live_interval_s,
            live_timeout_s=live_timeout_s, live_misses=live_misses, on_worker=on_worker)
        self.workers = self.registry.workers
        self.index_sync = IndexSync(self.client, self.index, self.workers,
                                    poll_interval_s=poll_interval_s,
                                    poll_timeout_s=poll_timeout_s,
                                    unhealthy_after=unhealthy_after)
        self.registry.on_register = self.index_sync.start
        self.registry.on_remove = self.index_sync.stop
        self.registry.on_forget = self.recent.forget
        self.index_sync.on_resync = self.recent.forget
        self.streams = DecodeStreams(self.client, DecodeChannels(self.client, self.workers),
                                     use_channels=channels)

    @classmethod
    def of(cls, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None,
           on_worker: Callable[[Worker], None] | None = None) -> WorkerPool:
        """The worker layer a router configuration asks for."""
        return cls(config.model, config.cluster_token, config.poll_interval_s,
                   config.unhealthy_after, config.timeout_s, transport, on_worker=on_worker,
                   poll_timeout_s=config.poll_timeout_s, deadline_s=config.deadline_s,
                   pool_timeout_s=config.pool_timeout_s,
                   max_connections=config.max_connections,
                   breaker_fail_max=config.breaker_fail_max,
                   breaker_reset_s=config.breaker_reset_s, channels=config.decode_channels)

    def begin_stop(self) -> None:
        """The router is stopping (SIGTERM / SIGINT): the workers drain and exit too, so their
        polls and liveness probes failing from now on is expected (logged at INFO, not
        WARNING); placement and the open streams go on as before."""
        self.registry.stopping = self.index_sync.stopping = True

    async def close(self) -> None:
        """Stop every poller and probe, end the decode streams' tasks, close the clients."""
        await self.registry.close()
        await self.index_sync.close()
        tasks = self.streams.tasks()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.client.close()
