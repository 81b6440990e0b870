"""Plumbing shared by the prefill and decode worker processes (``prefill/``, ``decode/``).

A worker process is::

    uvicorn (asyncio)                          engine thread (EngineLoop)
    ─────────────────                          ──────────────────────────
    FastAPI handlers ── loop.call(fn) ───────▶ fn(...) runs between two engine steps
        await the answer ◀── call_soon_threadsafe ── results / token events
                                               loop: commands → role.tick() (kvstore polls)
                                                     → engine.step() → role.on_outputs(...)
    registration task: POST {router}/internal/register, re-register when the router forgets us

The engine (:class:`~k3serve.engine.engine.LLMEngine`) and the kvstore senders / receivers are
touched from the engine thread only; handlers reach them through :meth:`EngineLoop.call`.

What lives here: argument parsing (the only place the worker reads the environment), model +
engine construction (:func:`build_engine`, the same loading as the offline ``k3serve.LLM``),
:class:`EngineLoop`, :class:`WorkerMetrics` (DESIGN.md §6 worker names), :class:`BaseWorker`
(the FastAPI app with the endpoints both roles answer, the cluster-token check, registration)
and :func:`serve`.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import concurrent.futures as cf
import contextlib
import logging
import math
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from k3serve.protocol import CLUSTER_TOKEN_ENV, CLUSTER_TOKEN_HEADER

log = logging.getLogger("k3serve.worker")

TEST_HOOKS_ENV = "K3SERVE_TEST_HOOKS"
"""Set to ``1`` to accept per-request test hooks (``debug_fail_transfer_n``)."""
THREADS_ENV = "K3SERVE_WORKER_THREADS"
"""torch intra-op threads per worker process (default 1: several processes share the CPU)."""


# ============================================================================ arguments
def parse_args(role: str, argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of ``python -m {role}.worker`` (flags as ``k3serve.launcher`` passes them).

    Environment (read here only): ``K3SERVE_CLUSTER_TOKEN`` (internal calls must carry it),
    ``K3SERVE_WORKER_THREADS``, ``K3SERVE_TEST_HOOKS``; kvstore reads its own
    ``K3SERVE_KV_*`` (``kvstore.KVConfig.from_env``).
    """
    ap = argparse.ArgumentParser(prog=f"python -m {role}.worker",
                                 description=f"k3serve {role} worker")
    ap.add_argument("--host", default="127.0.0.1", help="bind address")
    ap.add_argument("--port", type=int, default=0, help="HTTP port (0: any free port)")
    ap.add_argument("--advertise-host", default=None,
                    help="host the router should call (default: --host, 127.0.0.1 for 0.0.0.0)")
    ap.add_argument("--model", default="k3-tiny", help="preset name or checkpoint folder")
    ap.add_argument("--router-url", default=None, help="register with this router")
    ap.add_argument("--worker-id", default=None, help="name in metrics and /internal/info")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per cache block")
    ap.add_argument("--num-pages", type=int, default=1024, help="MLA latent pages")
    ap.add_argument("--num-slots", type=int, default=32, help="KDA state slots")
    ap.add_argument("--num-snapshots", type=int, default=32, help="KDA snapshot budget")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="compute / cache dtype (auto: float32 on CPU, bfloat16 on CUDA); "
                         "prefill and decode workers must agree")
    ap.add_argument("--seed", type=int, default=0, help="random-init seed (no checkpoint)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get(THREADS_ENV, "1")),
                    help=f"torch threads (default ${THREADS_ENV} or 1)")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    args.role = role
    args.cluster_token = os.environ.get(CLUSTER_TOKEN_ENV) or None
    args.test_hooks = os.environ.get(TEST_HOOKS_ENV, "") == "1"
    return args


def build_engine(args: argparse.Namespace):
    """The worker's :class:`LLMEngine`, built exactly as the offline ``k3serve.LLM`` builds its
    own (one switch for model loading: ``k3serve.engine.llm.load_model`` — the embedded k3-tiny
    checkpoint when present, else random init seeded by ``--seed``).

    Raises:
        ValueError: unknown model or inconsistent capacities.
    """
    import torch

    from k3serve.engine.llm import LLM

    if args.device == "cpu":
        torch.set_num_threads(max(1, args.threads))
    dtype = args.dtype if args.dtype != "auto" else (
        "float32" if args.device == "cpu" else "bfloat16")
    llm = LLM(
        args.model, enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
        device=args.device, dtype=getattr(torch, dtype), block_size=args.block_size,
        num_pages=args.num_pages,
        num_slots=args.num_slots, num_snapshots=args.num_snapshots,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    return llm.engine


def finite(x: Any) -> float | None:
    """A float for JSON: non-finite values (``-inf`` logprobs, NaN) become ``None``."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def top_list(top: Any) -> list[list[float]] | None:
    """``((id, logprob), ...)`` → ``[[id, logprob], ...]`` (JSON-safe), or ``None``."""
    if top is None:
        return None
    return [[int(t), finite(lp)] for t, lp in top]


def parse_sampling(d: dict[str, Any]) -> Any:
    """The ``SamplingParams`` of an internal request's ``sampling`` dict, or the 400 answer
    (``invalid_sampling``) to send instead: a dict that does not parse, or ``n != 1`` (the
    router splits ``n > 1`` into sub-requests)."""
    from k3serve.sampling import SamplingParams

    try:
        params = SamplingParams.from_dict(d)
    except (ValueError, TypeError) as e:
        return error(400, "invalid_sampling", str(e))
    if params.n != 1:
        return error(400, "invalid_sampling", "sampling.n: must be 1 (the router splits "
                                              "n > 1 into sub-requests)")
    return params


class RequestBody(BaseModel):
    """``POST /internal/abort`` body (both roles)."""

    model_config = ConfigDict(extra="ignore")
    request_id: str = Field(min_length=1)


# ============================================================================ engine thread
class EngineLoop:
    """Runs ``engine.step()`` in a thread; everything else reaches the engine through it.

    Args:
        engine: the worker's engine.
        tick: called every iteration (before and after each step); polls transfers. Returns
            True while transfers are in flight (the loop then polls every ``active_s``).
        on_outputs: called with each step's outputs.
        on_error: called with the exception when a step raises (the role fails its requests).
        idle_s, active_s: wait between iterations when the engine has nothing to run (s).
    """

    def __init__(self, engine: Any, tick: Callable[[], bool],
                 on_outputs: Callable[[list], None], on_error: Callable[[BaseException], None],
                 idle_s: float = 0.05, active_s: float = 0.002) -> None:
        self.engine = engine
        self._tick, self._on_outputs, self._on_error = tick, on_outputs, on_error
        self.idle_s, self.active_s = idle_s, active_s
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.error: BaseException | None = None
        self.num_step_errors = 0

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._q.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        """Run ``fn(*args)`` on the engine thread; its result / exception in the future."""
        fut: cf.Future = cf.Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("worker is stopping"))
            return fut
        self._q.put((fut, fn, args))
        return fut

    async def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
        """Await ``fn(*args)`` run on the engine thread.

        Raises:
            TimeoutError: not run within ``timeout`` seconds (the engine thread is stuck).
            Exception: whatever ``fn`` raised.
        """
        return await asyncio.wait_for(asyncio.wrap_future(self.submit(fn, *args)), timeout)

    def _drain(self, wait_s: float) -> None:
        try:
            item = self._q.get(timeout=wait_s) if wait_s > 0 else self._q.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - delivered to the caller
                    fut.set_exception(e)
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        active = False
        while not self._stop.is_set():
            busy = self.engine.has_unfinished_requests()
            self._drain(0 if busy else (self.active_s if active else self.idle_s))
            if self._stop.is_set():
                break
            try:
                active = self._tick()
                if self.engine.has_unfinished_requests():
                    outs = self.engine.step()
                    self._on_outputs(outs)
                    active = self._tick() or active
            except Exception as e:
                self.num_step_errors += 1
                log.exception("engine loop error")
                try:
                    self._on_error(e)
                except Exception:
                    log.exception("on_error failed")
                    self.error = e
                    return
        # answer whatever is still queued
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._q.get_nowait()
                if item is not None and item[0].set_running_or_notify_cancel():
                    item[0].set_exception(RuntimeError("worker is stopping"))


# ============================================================================ metrics
class WorkerMetrics:
    """The worker metrics of DESIGN.md §6, labelled ``worker`` and ``role``, on their own
    registry. Counters may be incremented from any thread; gauges are set at scrape time.

    Families (prometheus-client appends ``_total`` to counters)::

        k3serve:prefix_cache_queries_total{worker,role}         prompt tokens looked up
        k3serve:prefix_cache_hits_total{worker,role,source}     tokens reused (local|store)
        k3serve:kv_transfer_bytes_total{worker,role}            bytes written (prefill side)
        k3serve:kv_transfer_seconds{worker,role}                histogram, admission → done
        k3serve:kda_snapshots{worker,role}                      gauge, snapshots held
        k3serve:cache_usage_ratio{worker,role}                  gauge, referenced pages / all
        k3serve:num_requests_running{worker,role}               gauge
        k3serve:num_requests_waiting{worker,role}               gauge
        k3serve:kv_transfer_fallbacks_total{worker,role}        decode recomputed the prefill
        k3serve:kv_transfers_total{worker,role,outcome}         finished transfers by outcome

    Transfers are counted once, by the side that owns the figure: bytes, seconds and outcomes
    by the sender (prefill worker), fallbacks by the decode worker.
    """

    def __init__(self, worker: str, role: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.labels = {"worker": worker, "role": role}
        r = self.registry = CollectorRegistry()
        lab = ["worker", "role"]
        self._queries = Counter("k3serve:prefix_cache_queries",
                                "Prompt tokens looked up in the prefix cache.", lab, registry=r)
        self._hits = Counter("k3serve:prefix_cache_hits",
                             "Prompt tokens reused from the prefix cache, by source.",
                             lab + ["source"], registry=r)
        self._bytes = Counter("k3serve:kv_transfer_bytes",
                              "Cache bytes written to decode workers.", lab, registry=r)
        self._seconds = Histogram(
            "k3serve:kv_transfer_seconds", "Cache transfer time, admission to completion.",
            lab, registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0))
        self._snapshots = Gauge("k3serve:kda_snapshots", "KDA snapshots held.", lab, registry=r)
        self._usage = Gauge("k3serve:cache_usage_ratio", "Referenced cache pages / all pages.",
                            lab, registry=r)
        self._running = Gauge("k3serve:num_requests_running", "Requests running.", lab,
                              registry=r)
        self._waiting = Gauge("k3serve:num_requests_waiting",
                              "Requests waiting (queued, or waiting for their cache).", lab,
                              registry=r)
        self._fallbacks = Counter("k3serve:kv_transfer_fallbacks",
                                  "Failed transfers recomputed by the decode worker.", lab,
                                  registry=r)
        self._transfers = Counter("k3serve:kv_transfers", "Finished transfers by outcome.",
                                  lab + ["outcome"], registry=r)
        for fam in (self._queries, self._bytes, self._fallbacks):
            fam.labels(**self.labels)
        for src in ("local", "store"):
            self._hits.labels(**self.labels, source=src)
        for oc in ("success", "failed"):
            self._transfers.labels(**self.labels, outcome=oc)
        self._seconds.labels(**self.labels)

    def prefix_query(self, prompt_tokens: int, cached_tokens: int, source: str = "local") -> None:
        self._queries.labels(**self.labels).inc(prompt_tokens)
        self._hits.labels(**self.labels, source=source).inc(cached_tokens)

    def transfer(self, ok: bool, nbytes: int, seconds: float | None) -> None:
        self._bytes.labels(**self.labels).inc(nbytes)
        self._transfers.labels(**self.labels, outcome="success" if ok else "failed").inc()
        if ok and seconds is not None:
            self._seconds.labels(**self.labels).observe(seconds)

    def fallback(self) -> None:
        self._fallbacks.labels(**self.labels).inc()

    def set_gauges(self, g: dict[str, float]) -> None:
        self._snapshots.labels(**self.labels).set(g["kda_snapshots"])
        self._usage.labels(**self.labels).set(g["cache_usage_ratio"])
        self._running.labels(**self.labels).set(g["num_requests_running"])
        self._waiting.labels(**self.labels).set(g["num_requests_waiting"])

    def render(self) -> tuple[bytes, str]:
        """``(body, content type)``: the families above, without prometheus-client's
        ``*_created`` timestamp series (DESIGN.md §6 names only, as the router does)."""
        from k3serve.prometheus import render

        return render(self.registry)


# ============================================================================ the worker
class BaseWorker(abc.ABC):
    """What both roles share: engine + loop, kvstore engine, metrics, common endpoints.

    Subclasses implement :meth:`tick`, :meth:`on_outputs`, :meth:`fail_all`,
    :meth:`num_waiting`, :meth:`abort`, :meth:`describe`, :meth:`routes` and may extend
    :meth:`usage`.

    Args:
        args: :func:`parse_args` result.
        engine: the :class:`LLMEngine` (default: :func:`build_engine`).
    """

    role = "worker"

    def __init__(self, args: argparse.Namespace, engine: Any = None) -> None:
        from kvstore import KVConfig, KVEngine, PoolLayout

        self.args = args
        self.engine = engine if engine is not None else build_engine(args)
        self.block_size = self.engine.config.block_size
        self.worker_id = args.worker_id or f"{self.role}@{args.host}:{args.port}"
        self.metrics = WorkerMetrics(self.worker_id, self.role)
        self.kv_config = KVConfig.from_env()
        self.kv = KVEngine(self.kv_config.engine_config())
        # the pairing check compares the same model + weights fields as the hash salt
        self.layout = PoolLayout.from_kvpools(self.engine.pools,
                                              extra=self.engine.fingerprint_fields)
        self.kv.register_layout(self.layout)
        self.loop = EngineLoop(self.engine, self.tick, self.on_outputs, self.fail_all)
        self.aloop: asyncio.AbstractEventLoop | None = None
        self.url = ""  # set by serve() once the port is known
        self.started = time.time()

    # ------------------------------------------------------------------ role hooks
    def tick(self) -> bool:  # engine thread
        return False

    def on_outputs(self, outs: list) -> None:  # engine thread
        pass

    def fail_all(self, err: BaseException) -> None:  # engine thread
        pass

    def num_waiting(self) -> int:  # engine thread
        return len(self.engine.scheduler.waiting)

    @abc.abstractmethod
    def abort(self, rid: str, reason: str) -> bool:  # engine thread
        """End request ``rid`` wherever it is, freeing what it holds; True if it was known."""

    @abc.abstractmethod
    def describe(self, rid: str | None) -> dict[str, Any]:  # engine thread
        """``GET /internal/requests`` body: the tracked requests (all, or only ``rid``)."""

    def routes(self, app: Any) -> None:
        pass

    def start(self) -> None:
        """Start the engine thread (and role services)."""
        self.loop.start()

    def close(self) -> None:
        """Stop the engine thread and release the transfer engine."""
        self.loop.stop()
        with contextlib.suppress(Exception):
            self.kv.unregister_layout(self.layout)
        with contextlib.suppress(Exception):
            self.kv.close()

    # ------------------------------------------------------------------ thread helpers
    def resolve(self, fut: asyncio.Future, value: Any = None,
                exc: BaseException | None = None) -> None:
        """Set an asyncio future from the engine thread."""
        def f() -> None:
            if not fut.done():
                if exc is not None:
                    fut.set_exception(exc)
                else:
                    fut.set_result(value)

        assert self.aloop is not None
        self.aloop.call_soon_threadsafe(f)

    def push(self, q: asyncio.Queue, item: Any) -> None:
        """Put on an asyncio queue from the engine thread."""
        assert self.aloop is not None
        self.aloop.call_soon_threadsafe(q.put_nowait, item)

    # ------------------------------------------------------------------ shared bodies
    def usage(self) -> dict[str, Any]:  # engine thread
        """Occupancy now (``/internal/info`` ``usage``; the abort tests read it)."""
        u = self.engine.cm.usage()
        return {
            "pages_used": u.pages_used, "pages_cached": u.pages_cached,
            "slots_used": u.slots_used, "snapshots_used": u.snapshots_used,
            "snapshots_cached": u.snapshots_cached,
            "num_running": len(self.engine.scheduler.running),
            "num_waiting": self.num_waiting(),
            "num_engine_requests": len(self.engine.requests),
            "num_reserved": self.engine.num_reserved,
        }

    def info(self) -> dict[str, Any]:  # engine thread
        e = self.engine.info()
        return {
            "role": self.role,
            "model": e["model"],
            "fingerprint": e["layout_fingerprint"],
            "weights_id": e["weights_id"],
            "block_size": e["block_size"],
            "capacity": {"num_pages": e["num_pages"], "num_slots": e["num_slots"],
                         "num_snapshots": e["num_snapshots"]},
            "max_model_len": e["max_model_len"],
            "worker_id": self.worker_id,
            "enable_prefix_caching": e["enable_prefix_caching"],
            "kv_layout_hash": self.layout.fingerprint_hash(),
            "usage": self.usage(),
        }

    def gauges(self) -> dict[str, float]:  # engine thread
        u = self.engine.cm.usage()
        return {
            "kda_snapshots": u.snapshots_used + u.snapshots_cached,
            "cache_usage_ratio": u.usage_ratio,
            "num_requests_running": len(self.engine.scheduler.running),
            "num_requests_waiting": self.num_waiting(),
        }

    # ------------------------------------------------------------------ the app
    def app(self) -> Any:
        """The FastAPI app: common endpoints + :meth:`routes`, token check, registration."""
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, Response

        worker = self

        @asynccontextmanager
        async def lifespan(app: FastAPI):
            worker.aloop = asyncio.get_running_loop()
            worker.start()
            reg = None
            if worker.args.router_url:
                reg = asyncio.create_task(worker.register_loop(), name="register")
            try:
                yield
            finally:
                if reg is not None:
                    reg.cancel()
                    with contextlib.suppress(BaseException):
                        await reg
                worker.close()

        app = FastAPI(title=f"k3serve {self.role} worker", lifespan=lifespan, docs_url=None,
                      redoc_url=None, openapi_url=None)

        @app.middleware("http")
        async def token_check(request: Request, call_next):
            tok = worker.args.cluster_token
            if tok and request.url.path.startswith("/internal"):
                got = request.headers.get(CLUSTER_TOKEN_HEADER, "")
                # as bytes: a non-ASCII header value must be a 403, not a TypeError (500)
                if not secrets.compare_digest(got.encode("utf-8", "surrogateescape"),
                                              tok.encode("utf-8", "surrogateescape")):
                    return error(403, "forbidden", "missing or wrong cluster token")
            return await call_next(request)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
            first = e.errors()[0] if e.errors() else {}
            where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
            return error(400, "invalid_request", f"{where}: {first.get('msg', 'invalid body')}")

        @app.exception_handler(Exception)
        async def _unexpected(_: Request, e: Exception) -> JSONResponse:
            log.exception("unexpected error")
            return error(500, "internal_error", f"{type(e).__name__}: {e}")

        @app.get("/health")
        async def health() -> JSONResponse:
            ok = worker.loop.alive
            return JSONResponse({"status": "ok" if ok else "engine_stopped", "role": worker.role,
                                 "worker_id": worker.worker_id},
                                status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            with contextlib.suppress(Exception):
                worker.metrics.set_gauges(await worker.loop.call(worker.gauges, timeout=10))
            body, ctype = worker.metrics.render()
            return Response(body, media_type=ctype)

        @app.get("/internal/info")
        async def info() -> dict[str, Any]:
            return await worker.loop.call(worker.info)

        @app.get("/internal/cache_events")
        async def cache_events(after: int = 0, limit: int | None = None) -> dict[str, Any]:
            return await worker.loop.call(worker.engine.cache_events, after, limit)

        @app.get("/internal/cache_state")
        async def cache_state() -> dict[str, Any]:
            return await worker.loop.call(worker.engine.cache_state)

        @app.get("/internal/requests")
        async def requests(request_id: str | None = None) -> dict[str, Any]:
            return await worker.loop.call(worker.describe, request_id)

        @app.post("/internal/abort")
        async def abort(body: RequestBody) -> dict[str, Any]:
            found = await worker.loop.call(worker.abort, body.request_id, "aborted by the router")
            return {"ok": True, "found": bool(found)}

        self.routes(app)
        return app

    # ------------------------------------------------------------------ registration
    async def register_loop(self, check_every_s: float = 2.0) -> None:
        """Register with the router; re-register whenever its ``/health?detail=1`` stops
        listing this worker (router restart). Never raises; retries with backoff."""
        import httpx

        router = self.args.router_url.rstrip("/")
        headers = {CLUSTER_TOKEN_HEADER: self.args.cluster_token} if self.args.cluster_token \
            else {}
        backoff = 0.2
        async with httpx.AsyncClient(timeout=10.0, headers=headers, trust_env=False) as c:
            while True:
                try:
                    known = False
                    r = await c.get(f"{router}/health", params={"detail": 1})
                    if r.status_code in (200, 503):
                        known = any(w.get("url") == self.url
                                    for w in r.json().get("workers") or ())
                    if not known:
                        r = await c.post(f"{router}/internal/register", json={"url": self.url})
                        if 400 <= r.status_code < 500:  # e.g. another model or layout
                            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
                        if r.status_code != 200:  # e.g. 503: it could not reach us yet
                            raise ConnectionError(f"HTTP {r.status_code}: {r.text[:300]}")
                        log.info("registered with %s as %s", router, self.worker_id)
                    backoff = 0.2
                    await asyncio.sleep(check_every_s)
                except asyncio.CancelledError:
                    raise
                except RuntimeError as e:  # the router answered but refused us
                    log.warning("registration with %s refused: %s", router, e)
                    await asyncio.sleep(check_every_s)
                    continue
                except Exception as e:  # noqa: BLE001 - the router may be down; keep trying
                    log.info("registration with %s: %r", router, e)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, check_every_s)


def error(status: int, code: str, message: str):
    """An error answer of the internal API: ``{"error": code, "message": message}``."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": code, "message": message}, status_code=status)


def serve(worker_cls: type[BaseWorker], role: str, argv: list[str] | None = None) -> int:
    """``python -m {role}.worker``: parse flags, build the worker, serve until SIGTERM."""
    import socket

    import uvicorn

    args = parse_args(role, argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {role} %(name)s %(levelname)s %(message)s")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    args.port = sock.getsockname()[1]
    worker = worker_cls(args)
    host = args.advertise_host or ("127.0.0.1" if args.host in ("0.0.0.0", "") else args.host)
    worker.url = f"http://{host}:{args.port}"
    cfg = uvicorn.Config(worker.app(), log_level=args.log_level, access_log=False,
                         timeout_graceful_shutdown=3)
    server = uvicorn.Server(cfg)
    print(f"k3serve {role} worker {worker.worker_id} listening on {worker.url}", flush=True)
    server.run(sockets=[sock])
    return 0


__all__ = ["BaseWorker", "EngineLoop", "RequestBody", "WorkerMetrics", "build_engine", "error",
           "finite", "parse_args", "parse_sampling", "serve", "top_list"]
