"""What both worker roles share: engine + engine thread, kvstore engine, metrics, info.

A role (``prefill.worker.PrefillWorker``, ``decode.worker.DecodeWorker``) subclasses
:class:`BaseWorker`, keeps its requests' state on the engine thread and adds its routes;
:mod:`worker.http` builds the FastAPI app around it, :mod:`worker.serve` runs it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from typing import Any

from k3serve.engine.connector import DisaggConnector
from k3serve.messages import (
    CacheEvents,
    Capacity,
    ErrorBody,
    RequestsDebug,
    SpecCounters,
    WorkerInfo,
    WorkerLoad,
    WorkerUsage,
)
from k3serve.sampling import SamplingParams
from kvstore import KVEngine
from worker.config import WorkerConfig
from worker.loop import EngineLoop, build_engine, parallel_info
from worker.metrics import WorkerMetrics


class Failure(Exception):
    """An internal call that fails: answered as HTTP ``status`` with an
    :class:`~k3serve.messages.ErrorBody` (``code`` as listed there).

    Raised by handlers or by functions run on the engine thread (it travels back through
    :meth:`EngineLoop.call`); :mod:`worker.http` turns it into the answer.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def body(self) -> ErrorBody:
        return ErrorBody(error=self.code, message=self.message)


def sampling_params(params: SamplingParams) -> SamplingParams:
    """``params`` of an internal request, which carries one choice (its ranges were checked
    when the body was read: a bad value is a 400 ``invalid_sampling`` naming the field).

    Raises:
        Failure: 400 ``invalid_sampling`` when ``n != 1`` (the router splits ``n > 1`` into
            sub-requests with derived seeds before any internal call).
    """
    if params.n != 1:
        raise Failure(400, "invalid_sampling",
                      f"sampling.n: must be 1 (the router splits n > 1 into sub-requests), "
                      f"got {params.n}")
    return params


class BaseWorker(abc.ABC):
    """Engine + loop, kvstore engine and layout, metrics, and the bodies both roles answer.

    Subclasses implement :meth:`abort`, :meth:`describe` and :meth:`routes`, and usually
    :meth:`tick`, :meth:`on_outputs`, :meth:`fail_all`; they may extend :meth:`usage`,
    :meth:`info`, :meth:`start`, :meth:`close`. Methods marked "engine thread" run there only.

    Args:
        config: the worker's configuration (port already bound).
        engine: the :class:`LLMEngine` (default: :func:`~worker.loop.build_engine`).
    """

    role: str = "worker"
    #: prefill requests admitted and their uncached prompt tokens (counters, engine thread;
    #: ``None``: this role does not count them) — reported in :meth:`load_report`
    prefills: int | None = None
    prefill_tokens: int | None = None
    #: set by :meth:`begin_drain` (SIGTERM): new admissions answer 503 ``draining``
    draining: bool = False

    def __init__(self, config: WorkerConfig, engine: Any = None) -> None:
        self.config = config
        self.engine = engine if engine is not None else build_engine(config)
        self.disagg = DisaggConnector.of(self.engine)  # prefill hand-off / decode reservations
        self.block_size = self.engine.config.block_size
        self.worker_id = config.name
        self.url = config.url
        self.metrics = WorkerMetrics(self.worker_id, self.role)
        self.kv_config = config.kv
        self.kv = KVEngine(self.kv_config.engine_config())
        # the pairing check compares the same model + weights fields as the hash salt
        # a multi-rank instance transfers through rank 0's full-layout staging pools
        # CUDA pools go through a pinned host mirror (K3SERVE_KV_STAGING, kvstore/staging.py)
        self.layout = self.kv.register_pools(self.engine.runner.transfer_pools,
                                             extra=self.engine.fingerprint_fields,
                                             staging=self.kv_config.staging)
        self.metrics.add_expert_load(self.engine.runner.model)
        self.loop = EngineLoop(self.engine, self._tick_all, self.on_outputs, self.fail_all)
        self.aloop: asyncio.AbstractEventLoop | None = None
        self.store = self._store_tier()

    def _store_tier(self) -> Any:
        """The shared-store tier (:mod:`kvstore.store.tier`), or ``None`` without ``--store-url``."""
        if not self.config.store.enabled:
            return None
        from kvstore.store.tier import StoreTier

        tier = StoreTier(self.config.store, self.engine, self.loop, self.metrics.labels)
        self.metrics.registry.register(_Collector(tier.collect))
        return tier

    def _tick_all(self) -> bool:  # engine thread
        active = self.tick()
        if self.store is not None:
            self.store.export()
        return active

    # ------------------------------------------------------------------ role hooks
    def tick(self) -> bool:  # engine thread
        """Poll transfers; True while some are in flight."""
        return False

    def on_outputs(self, outs: list) -> None:  # engine thread
        """One engine step's outputs."""

    def fail_all(self, err: BaseException) -> None:  # engine thread
        """The engine step raised ``err``: fail every tracked request."""

    def num_waiting(self) -> int:  # engine thread
        return len(self.engine.scheduler.waiting)

    @abc.abstractmethod
    def abort(self, rid: str, reason: str) -> bool:  # engine thread
        """End request ``rid`` wherever it is, freeing what it holds; True if it was known."""

    @abc.abstractmethod
    def describe(self, rid: str | None) -> RequestsDebug:  # engine thread
        """``GET /internal/requests`` body: the tracked requests (all, or only ``rid``)."""

    @abc.abstractmethod
    def routes(self, app: Any) -> None:
        """Add the role's routes to the FastAPI ``app``."""

    def start(self) -> None:
        """Start the engine thread (and role services)."""
        if self.store is not None:
            self.store.start()
        self.loop.start()

    def close(self) -> None:
        """Stop the engine thread and release the transfer engine."""
        self.loop.stop()
        if self.store is not None:
            self.store.close()
        if not self.loop.alive:  # a multi-rank instance: stop ranks 1 … W−1
            with contextlib.suppress(Exception):
                getattr(self.engine.runner, "close", lambda: None)()
        with contextlib.suppress(Exception):
            self.kv.unregister_layout(self.layout)
        with contextlib.suppress(Exception):
            self.kv.close()

    # ------------------------------------------------------------------ drain
    def begin_drain(self) -> None:
        """Stop admitting: from now on ``reserve`` / ``prefill`` / ``generate`` answer 503
        ``draining`` and ``/health`` answers 503 ``draining``; what runs goes on
        (:func:`worker.serve.serve` waits for :meth:`num_tracked` to reach 0)."""
        self.draining = True

    def end_streams(self) -> None:
        """Close what would keep a connection open past the end of a drain (a decode
        worker's channels); called on the server's loop just before it stops."""

    def num_tracked(self) -> int:  # engine thread
        """Requests this worker still holds anything for: the role's tracked requests that are
        not :meth:`settled`, plus the engine's own (0: idle, a drain may end)."""
        reqs = getattr(self, "reqs", {})
        return sum(1 for r in reqs.values() if not self.settled(r)) + len(self.engine.requests)

    def settled(self, r: Any) -> bool:  # engine thread
        """Role hook: a tracked request that holds nothing and has nothing left to send (kept
        a while only so that a late caller gets its final answer)."""
        return False

    # ------------------------------------------------------------------ thread helpers
    def resolve(self, fut: asyncio.Future, value: Any = None,
                exc: BaseException | None = None) -> None:
        """Set an asyncio future from the engine thread (a no-op once it is done).

        Raises:
            RuntimeError: the app has not started (no event loop to hand the value to).
        """
        def f() -> None:
            if not fut.done():
                if exc is not None:
                    fut.set_exception(exc)
                else:
                    fut.set_result(value)

        self._event_loop().call_soon_threadsafe(f)

    def push(self, q: asyncio.Queue, item: Any) -> None:
        """Put on an asyncio queue from the engine thread."""
        self._event_loop().call_soon_threadsafe(q.put_nowait, item)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self.aloop is None:
            raise RuntimeError("the worker's app has not started")
        return self.aloop

    # ------------------------------------------------------------------ shared bodies
    def usage(self) -> WorkerUsage:  # engine thread
        """Occupancy now (``/internal/info`` ``usage``; the abort tests read it)."""
        u = self.engine.cm.usage()
        return WorkerUsage(
            pages_used=u.pages_used, pages_cached=u.pages_cached, slots_used=u.slots_used,
            snapshots_used=u.snapshots_used, snapshots_cached=u.snapshots_cached,
            num_running=len(self.engine.scheduler.running), num_waiting=self.num_waiting(),
            num_engine_requests=len(self.engine.requests),
            num_reserved=self.disagg.num_reserved)

    def info(self) -> WorkerInfo:  # engine thread
        """``GET /internal/info`` body."""
        e = self.engine.info()
        return WorkerInfo(
            role=self.role, model=e["model"], fingerprint=e["layout_fingerprint"],
            weights_id=e["weights_id"], block_size=e["block_size"],
            capacity=Capacity(num_pages=e["num_pages"], num_slots=e["num_slots"],
                              num_snapshots=e["num_snapshots"]),
            max_model_len=e["max_model_len"], worker_id=self.worker_id,
            enable_prefix_caching=e["enable_prefix_caching"],
            kv_layout_hash=self.layout.fingerprint_hash(), usage=self.usage(),
            **parallel_info(self.engine))

    def load_report(self) -> WorkerLoad:  # engine thread
        """The load this worker reports with its cache events (``CacheEvents.load``): prompt
        tokens queued and not computed yet, requests running or reserved, free (+ evictable)
        pages and free slots, the prefill counters (router replicas balance on these,
        router/replicas.py), the measured prefill rate (:class:`~worker.loop.PrefillMeter`)
        and the speculative-decoding counters (the router sums them, router/spec_metrics.py)."""
        sched, u = self.engine.scheduler, self.engine.cm.usage()
        queued = sum(max(0, s.num_prompt_tokens - s.num_computed)
                     for s in (*sched.waiting, *sched.running))
        return WorkerLoad(queued_prefill_tokens=queued,
                          running=len(sched.running) + self.disagg.num_reserved,
                          free_pages=max(0, u.num_pages - u.pages_used),
                          free_slots=max(0, u.num_slots - u.slots_used),
                          prefills=self.prefills, prefill_tokens=self.prefill_tokens,
                          prefill_rate=self.loop.prefill_meter.rate,
                          spec=self.spec_counters())

    def spec_counters(self) -> SpecCounters | None:  # engine thread
        """The engine's speculative-decoding counters, or ``None`` when it does not speculate."""
        spec = getattr(self.engine, "spec", None)
        if spec is None:
            return None
        st = spec.stats
        return SpecCounters(verify_steps=st.steps, verify_rows=st.rows,
                            proposed_tokens=st.proposed, accepted_tokens=st.accepted,
                            emitted_tokens=st.emitted,
                            accepted_per_position=list(st.accepted_per_position))

    def cache_events(self, after: int = 0, limit: int | None = None) -> CacheEvents:
        """``GET /internal/cache_events`` body: the engine's events and :meth:`load_report`
        (engine thread)."""
        ev = self.engine.cache_events(after, limit)
        return CacheEvents.model_validate({**ev, "load": self.load_report()})

    def gauges(self) -> dict[str, float]:  # engine thread
        """The metric gauges now (:meth:`WorkerMetrics.set_gauges`)."""
        u = self.engine.cm.usage()
        g = {
            "kda_snapshots": u.snapshots_used + u.snapshots_cached,
            "cache_usage_ratio": u.usage_ratio,
            "num_requests_running": len(self.engine.scheduler.running),
            "num_requests_waiting": self.num_waiting(),
        }
        sc = self.spec_counters()
        if sc is not None:  # speculative decoding counters (WorkerMetrics.set_gauges)
            g.update({f"spec_{k}": v for k, v in sc.model_dump().items()
                      if k != "accepted_per_position"})
            g.update({f"spec_accepted_position_{j}": v
                      for j, v in enumerate(sc.accepted_per_position)})
        return g


class _Collector:
    """A prometheus-client custom collector around a ``collect()`` function."""

    def __init__(self, fn: Any) -> None:
        self.collect = fn


__all__ = ["BaseWorker", "Failure", "sampling_params"]
