"""The router's calls to its workers: the only place in router/ that sends them a request.

Two HTTP clients with their own connection pools: :attr:`WorkerClient.session` (aiohttp) for
the request path (reserve, prefill, generate, resume, attach, aborts, decode streams and
channels) and :attr:`WorkerClient.health` (httpx) for registration reads, cache-event polls
and liveness probes, so that request traffic can never starve the health checks; a request
that finds no free connection within ``pool_timeout_s`` fails with :class:`PoolBusy` (the
router is overloaded; no worker failed).

Every request-path call goes through the worker's circuit breaker (:meth:`calling`) and is
bounded by the deadline on a worker that stopped answering (:meth:`bounded`). Every internal
call carries the cluster token in ``CLUSTER_TOKEN_HEADER``; every body is a model of
:mod:`k3serve.messages` (the request lifecycle: :mod:`k3serve.protocol`, steps 1–10).
With tracing on, a request's calls run under call spans (:mod:`router.trace`) whose
``traceparent`` header the workers continue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, TypeVar

import aiohttp
import httpx
import pybreaker
import yarl
from pydantic import BaseModel, ValidationError

from k3serve import tracing
from k3serve.messages import (
    AbortRequest,
    AttachRequest,
    GenerateRequest,
    PrefillRequest,
    PrefillResponse,
    ReserveRequest,
    ReserveResponse,
    ResumeRequest,
    ResumeResponse,
)
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from router import trace
from router.workers import PoolBusy, Worker, WorkerError

log = logging.getLogger("k3serve.router")

M = TypeVar("M", bound=BaseModel)


@functools.lru_cache(maxsize=4096)
def url_of(base: str, path: str) -> yarl.URL:
    """A request-path URL, parsed once (a worker's base URL and one of the few paths)."""
    return yarl.URL(base + path)


class WorkerClient:
    """The HTTP calls to the workers: typed request-path calls through each worker's breaker
    and deadline, the decode streams' and channels' connections, and the health client's
    reads.

    Args:
        cluster_token: Sent on every internal call; ``None`` sends none.
        timeout_s: Timeout of one internal call (a stream: between two events).
        transport: httpx transport of the ``health`` client (registration reads, cache-event
            polls, liveness probes); the request path always goes over the network.
        poll_timeout_s: Connect timeout bound of the health client (``min(5, this)``).
        deadline_s: Seconds a request-path call (reserve, prefill, the wait between two
            stream events) waits on a worker that does not answer (its liveness probes or its
            polls fail) before it fails as hung; a worker that answers is waited for up to
            ``timeout_s`` (an open breaker alone does not cut calls already running: a busy
            worker catching up after a stall would fail them all).
        pool_timeout_s: Seconds a request-path call waits for a free connection.
        max_connections: Size of the request path's connection pool.
    """

    def __init__(self, cluster_token: str | None, timeout_s: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 poll_timeout_s: float = 10.0, deadline_s: float = 30.0,
                 pool_timeout_s: float = 5.0, max_connections: int = 1024) -> None:
        headers = {CLUSTER_TOKEN_HEADER: cluster_token} if cluster_token else {}
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        # The request path on aiohttp: its C HTTP parser costs a fraction of httpx + httpcore
        # + anyio per call and per streamed read. A stream of its own (no decode channel)
        # holds a connection; at most ``max_connections`` calls run at once (past that a call
        # waits ``pool_timeout_s`` for a turn, then sheds as PoolBusy); idle connections are
        # kept 2 s (< uvicorn's 5 s keep-alive: a connection is never reused as it closes).
        # A decode channel is one connection per decode worker, outside that count.
        self._headers = headers
        self._pool_timeout_s = pool_timeout_s
        self._slots = asyncio.Semaphore(max_connections)
        self._session: aiohttp.ClientSession | None = None  # made in the running loop
        self._background: set[asyncio.Task] = set()  # :meth:`spawn`: aborts, channels ending
        # Registration reads, the cache-event pollers and liveness probes: httpx
        # (``transport``: tests may route them in-process), its own pool (one poller per
        # worker) and short timeouts.
        self.health = httpx.AsyncClient(
            headers=headers, transport=transport,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
            timeout=httpx.Timeout(timeout_s, connect=min(5.0, poll_timeout_s)))

    async def close(self) -> None:
        """Cancel the background calls (:meth:`spawn`) and close both HTTP clients."""
        tasks = list(self._background)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._session is not None:
            await self._session.close()
        await self.health.aclose()

    def spawn(self, aw: Any) -> None:
        """Run ``aw`` (a coroutine or a task) in the background, kept until it ends;
        cancelled by :meth:`close`."""
        t = asyncio.ensure_future(aw)
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    @contextlib.contextmanager
    def calling(self, w: Worker, what: str) -> Iterator[None]:
        """Run one request-path call to ``w`` through its breaker.

        Raises:
            WorkerError: the breaker is open (``retryable``: nothing was sent), or the call
                failed (the breaker counts it when the worker is at fault).
            PoolBusy: no free connection (not counted: the router is overloaded).
        """
        if w.breaker.cut_off:
            raise WorkerError(w.url, f"{what}: circuit open", retryable=True)
        try:
            with w.breaker.calling():
                yield
        except pybreaker.CircuitBreakerError:
            raise WorkerError(w.url, f"{what}: circuit open", retryable=True) from None

    # ------------------------------------------------------------------ calls
    async def get(self, url: str, path: str, params: Mapping[str, Any] | None = None,
                  timeout: float | None = None) -> Any:
        """A GET off the request path (info, cache events and state) on the health client:
        the answer's JSON.

        Raises:
            WorkerError: no answer (``retryable``), a non-2xx status, an answer not JSON.
        """
        try:
            r = await self.health.get(url + path, params=params,
                                      timeout=httpx.USE_CLIENT_DEFAULT if timeout is None
                                      else httpx.Timeout(timeout,
                                                         connect=min(5.0, timeout)))
        except httpx.HTTPError as e:
            raise WorkerError(url, f"GET {path}: {e!r}", retryable=True) from None
        return json_body(url, path, r)

    async def probe(self, w: Worker, timeout_s: float) -> bool:
        """One liveness probe: ``GET /health`` within ``timeout_s``. True when the
        worker's event loop answered: any status below 500 (a worker without the route
        answers 404, alive all the same) or 503 ``draining``; False on no answer in time, a
        refused connection, or another 5xx (``engine_stopped``: its engine thread died)."""
        try:
            r = await self.health.get(w.url + "/health",
                                      timeout=httpx.Timeout(timeout_s))
        except httpx.HTTPError:
            return False
        if r.status_code < 500:
            return True
        with contextlib.suppress(ValueError):
            body = r.json()
            return isinstance(body, dict) and body.get("status") == "draining"
        return False

    @property
    def session(self) -> aiohttp.ClientSession:
        """The request path's HTTP client (made on first use, in the running event loop)."""
        if self._session is None:
            # every call posts a JSON message (Content-Type set once); no cookies (the jar's
            # per-call filtering is pure cost) and URLs parsed once (:func:`url_of`)
            self._session = aiohttp.ClientSession(
                headers={**self._headers, "Content-Type": "application/json"},
                cookie_jar=aiohttp.DummyCookieJar(),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0,
                                              sock_read=self.timeout_s))
        return self._session

    @contextlib.asynccontextmanager
    async def slot(self, w: Worker, what: str) -> AsyncIterator[None]:
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

    async def call(self, w: Worker, path: str, body: BaseModel) -> tuple[int, bytes]:
        """``POST`` a message on the request path; returns (status, body bytes). Under a
        traced request: in a call span, named to the worker by ``traceparent``.

        Raises:
            WorkerError: connection refused or failed (``retryable``), no answer within the
                call timeout (``hung``), a broken answer; ``PoolBusy``: no free connection.
        """
        span = trace.call_span(path, w)
        try:
            async with self.slot(w, f"POST {path}"):
                try:
                    async with self.session.post(url_of(w.url, path),
                                                 data=body.model_dump_json().encode(),
                                                 headers=trace.headers(span)) as r:
                        status, data = r.status, await r.read()
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                    raise WorkerError(w.url, f"POST {path}: {e!r}", retryable=True) from None
                except TimeoutError as e:
                    raise WorkerError(w.url, f"POST {path}: no answer in time: {e!r}",
                                      hung=True) from None
                except aiohttp.ClientError as e:
                    raise WorkerError(w.url, f"POST {path}: {e!r}") from None
        except BaseException as e:
            tracing.end_span(span, error=str(e) or type(e).__name__)
            raise
        if span is not None:
            tracing.end_span(span, {"http.status_code": status},
                             error=None if status // 100 == 2 else f"HTTP {status}")
        return status, data

    async def post(self, w: Worker, path: str, body: BaseModel, answer: type[M]) -> M:
        """A request-path call: ``body`` posted to ``w``, the answer validated as ``answer``.

        Raises:
            WorkerError: as :meth:`call`; a non-2xx status (``busy`` for a 503 ``busy``),
                an answer that is not a valid ``answer``.
        """
        with self.calling(w, path):
            status, data = await self.bounded(w, self.call(w, path, body))
            check_status(w.url, path, status, data)
            try:
                return answer.model_validate_json(data)
            except ValidationError as e:
                if e.errors()[0].get("type") == "json_invalid":
                    raise WorkerError(w.url, f"{path}: answer is not JSON") from None
                raise WorkerError(w.url, f"{path}: malformed {answer.__name__}: "
                                         f"{first_error(e)}") from None

    async def bounded(self, w: Worker, call: Any) -> Any:
        """Await an internal call in a task of its own; give up once it has waited
        ``deadline_s`` while ``w`` does not answer (:attr:`Worker.alive` or
        :attr:`Worker.healthy` false: hung or dead), or 1 s once its liveness probes took it
        out of placement (:attr:`Worker.alive` false: a stopped or wedged process). A worker that answers is busy, not hung:
        it is waited for up to the call timeout, whatever its breaker says.

        The task is cancelled at most once, here: a second cancellation of the caller
        cannot interrupt the closing of its connection (:func:`router.decode_stream.stop_reader`).

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
                waited = time.monotonic() - started
                if (waited >= self.deadline_s and not (w.alive and w.healthy)
                        or waited >= min(self.deadline_s, 1.0) and not w.alive):
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
        return await self.post(w, "/internal/reserve", body, ReserveResponse)

    async def prefill(self, w: Worker, body: PrefillRequest) -> PrefillResponse:
        """``POST /internal/prefill`` on a prefill worker: token #1.

        Raises:
            WorkerError: as :meth:`reserve`.
        """
        return await self.post(w, "/internal/prefill", body, PrefillResponse)

    async def generate(self, w: Worker, body: GenerateRequest) -> PrefillResponse:
        """``POST /internal/generate`` on a worker of a monolithic stack: token #1.

        Raises:
            WorkerError: as :meth:`reserve`.
        """
        return await self.post(w, "/internal/generate", body, PrefillResponse)

    async def resume(self, w: Worker, body: ResumeRequest) -> ResumeResponse:
        """``POST /internal/resume`` on a decode worker: continue a migrated request.

        Raises:
            WorkerError: as :meth:`reserve`.
        """
        return await self.post(w, "/internal/resume", body, ResumeResponse)

    async def attach(self, w: Worker, body: AttachRequest) -> None:
        """``POST /internal/attach``: send a request's stream on the decode channel
        ``body.channel`` (bounded by the deadline, outside the breaker: the stream's caller
        holds it).

        Raises:
            WorkerError: as :meth:`call`; a non-2xx status (``unknown_channel``: 409).
        """
        status, data = await self.bounded(w, self.call(w, "/internal/attach", body))
        check_status(w.url, "/internal/attach", status, data)

    def open_stream(self, w: Worker, path: str, body: BaseModel,
                    timeout: aiohttp.ClientTimeout) -> Any:
        """``POST path`` with ``body`` as an event stream (``/internal/stream``,
        ``/internal/channel``): the response's async context manager, read by the caller.
        A request's own stream carries its ``traceparent`` (a channel serves many requests:
        none)."""
        root = trace.REQUEST.get() if path == "/internal/stream" else None
        return self.session.post(url_of(w.url, path), data=body.model_dump_json().encode(),
                                 headers=STREAM_HEADERS if root is None
                                 else {**STREAM_HEADERS, **trace.headers(root)},
                                 timeout=timeout)

    async def abort(self, w: Worker, request_id: str) -> None:
        """Best-effort ``POST /internal/abort`` (errors are logged, never raised)."""
        try:
            async with self.session.post(
                    url_of(w.url, "/internal/abort"),
                    data=AbortRequest(request_id=request_id).model_dump_json().encode(),
                    timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                await r.read()
        except Exception as e:  # noqa: BLE001 - best effort
            log.info("abort %s on %s failed: %r", request_id, w.url, e)

STREAM_HEADERS = {"Accept": "text/event-stream", "Cache-Control": "no-store"}


def check_status(url: str, path: str, status: int, data: bytes) -> None:
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


def json_body(url: str, path: str, r: httpx.Response) -> Any:
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


def parse(model: type[M], url: str, path: str, body: Any) -> M:
    """Validate an internal answer with its message model.

    Raises:
        WorkerError: the answer does not fit the model (the first error is named).
    """
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise WorkerError(url, f"{path}: malformed {model.__name__}: {first_error(e)}") from None


def first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    return f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))
